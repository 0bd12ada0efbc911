"""Will it fit? The bytes per GPU of training a Hugging Face decoder, by category, and a verdict: before you submit.

    python 08_your_model/will_it_fit.py 08_your_model/configs/llama3_8b.json --gpus 8 --gpu-memory 80 --strategy fsdp2
    python 08_your_model/will_it_fit.py 08_your_model/configs/llama3_70b.json --gpus 32 --strategy fsdp2-ac

No GPU and no download. The parameters are counted exactly, from LlamaForCausalLM(config) built on the meta device
(shapes, no memory); every other byte follows from them and from the shapes below. Any Llama-style config.json
(Mistral, Qwen2 and the like are counted as a Llama of the same shape). The step priced is this lesson's:
zero_grad() (set_to_none), loss = model(input_ids, labels=labels, use_cache=False).loss, backward, AdamW's step.
(use_cache=True, the configs' default, builds a KV cache in training too: under checkpoint_wrapper, the cache and
each recomputation's k and v stay alive until backward ends, measured on CPU. Pass use_cache=False.)
  ddp       DistributedDataParallel(gradient_as_bucket_view=True) and bf16 autocast: everything on every GPU
  fsdp2     fully_shard per decoder layer, then the root (embeddings, final norm, lm_head), MixedPrecisionPolicy(bf16
            params, fp32 reduce): fp32 weights, gradients and AdamW state sharded (rank 0 holds ceil(rows / N) rows)
  fsdp2-ac  fsdp2 with each decoder layer in checkpoint_wrapper: it saves its input only, and recomputes in backward
  fsdp2-tp  a (N / tp, tp) mesh: q, k, v, gate, up colwise and o, down rowwise in each layer (no sequence parallel),
            then fsdp2 over N / tp; embeddings, norms and lm_head whole on each TP rank. --batch-size: per TP group
--dtype float32: no mixed precision; gathered weights and activations in fp32 too.

The formula, in bytes per token (t = batch x seq tokens per GPU; e = 2 for bf16, 4 for fp32; h hidden, I intermediate,
V vocab, L layers, n heads, q = n x head_dim, k = kv heads x head_dim, T = tp, 1 without TP):
  A = 2 r h + (e (2q + 2k + 4I) + 4n) / T      saved for backward by one decoder layer
      r = 4 + 2e: each RMSNorm keeps its input in fp32 and its output twice, before and after its weight (DDP's
      autocast: r = 10, its residual stream stays fp32); SDPA (flash) keeps q, k, v (GQA: k and v at kv width), its
      output and 4 bytes of log-sum-exp per head; the MLP keeps gate, silu(gate), up and their product
  a checkpointed layer saves e h (its input), and holds its A again while its backward recomputes it
  the loss, as backward starts: r h (the final norm) + 12 V (log_softmax's fp32 output, its gradient, its input's)
  in flight: 20 h of fp32 temporaries in the final norm's backward; G = e (2I / T + h) in a layer's
The peak is the largest of these moments of the step; each printed category is that moment's (W: gathered weights):
  loss        shards + W(root, the last layer prefetched) + (L A + r h + 12 V) t
  final norm  shards + W(root, last layer) + lm_head's gradient + (L A + (r + 20) h) t
  layer i     shards + the gradients of layers > i + W(root, layers i and i - 1) + layer i + 1's fp32 reduce-scatter
              input + the gradients of lm_head and down_proj + ((i + 1) A + G) t    (AC: ((i + 1) e h + A + G) t)
  reduce      shards + all gradients + the root's gradients (e) + their fp32 reduce-scatter input and output
  step        shards + all gradients + foreach AdamW's temporary (one fp32 copy of the shards)
  ddp: everything whole on every GPU, the gradients too (they are the buckets); instead of W, autocast's bf16
  copies of the Linear weights
On top: ALLOWANCE_GIB for the CUDA context, cuBLAS and NCCL workspaces, and ALLOCATOR_SHARE of the tensors for the
caching allocator's fragmentation (reserved, not allocated). 08_your_model/measure_memory.py measures the tensors
with torch's FSDPMemTracker on CPU: within 2% of this estimate, category by category, for fsdp2 and fsdp2-ac
(ddp and fsdp2-tp follow the same rules, not measured).
"""
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common`, from any working directory

import torch

from common.cli import Parser, positive_float, positive_int
from common.errors import CourseError
from common.exits import run
from common.files import work_in_course_folder

GIB = 2 ** 30
ALLOWANCE_GIB, ALLOCATOR_SHARE = 1.0, 0.10
STRATEGIES = ("ddp", "fsdp2", "fsdp2-ac", "fsdp2-tp")
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
COLWISE, ROWWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")
CATEGORIES = {"parameters": "parameters (fp32{} + buffers)",
              "gradients": "gradients (fp32{})",
              "optimizer": "AdamW state (2 x fp32{}; in its step, +1)",
              "gathered": "gathered units / communication buffers",
              "unsharded": "gradients before their reduce-scatter (unsharded)",
              "activations": "activations (saved for backward, loss, in flight)"}
EXAMPLE = "e.g. 08_your_model/configs/llama3_8b.json"


def read_config(path: str) -> dict:
    """The fields of a decoder's config.json, or a one-line CourseError saying what is wrong with the file."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise CourseError(f"{path}: no such file: give a Hugging Face config.json, {EXAMPLE}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CourseError(f"{path}: cannot read it as text ({exc}): give a config.json, {EXAMPLE}") from None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CourseError(f"{path} is not JSON ({exc.msg}, line {exc.lineno}): give a config.json, {EXAMPLE}") from None
    fields = fields if isinstance(fields, dict) else {}
    missing = [k for k in SHAPE_KEYS if type(fields.get(k)) is not int or fields[k] < 1]
    causal = fields.get("model_type") == "llama" or any(str(a).endswith("ForCausalLM")
                                                         for a in fields.get("architectures") or [])
    if missing or not causal or fields.get("is_encoder_decoder"):
        why = f"no positive {', '.join(missing)}" if missing else \
            f"model_type {fields.get('model_type')!r}, architectures {fields.get('architectures')}"
        raise CourseError(f"{path} is not a decoder config ({why}): give a Llama-style config.json (model_type llama "
                          f"or a ...ForCausalLM architecture, with {', '.join(SHAPE_KEYS)}), {EXAMPLE}")
    return fields


def load_config(path: str):
    """The config.json as a LlamaConfig (transformers is imported only once the file is known to be one)."""
    fields = read_config(path)
    from transformers import LlamaConfig
    try:
        return LlamaConfig(**{k: v for k, v in fields.items() if k not in ("model_type", "architectures")})
    except (TypeError, ValueError) as exc:
        raise CourseError(f"{path}: transformers cannot read it as a LlamaConfig ({exc})") from None


def count(config) -> tuple[dict, int]:
    """{name: shape} of every parameter of LlamaForCausalLM(config) (tied weights once), and its buffers' elements."""
    from transformers import LlamaForCausalLM
    with torch.device("meta"):  # shapes only: a 70 B model in no memory, in seconds
        model = LlamaForCausalLM(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}, sum(b.numel() for b in model.buffers())


def pieces(name: str, shape: tuple, dp: int, tp: int) -> tuple[int, int]:
    """(elements rank 0 holds, elements a gather of the unit allocates): the TP cut first, then FSDP2's rows, padded."""
    shape, module = list(shape), name.split(".")[-2]
    if tp > 1 and module in COLWISE:
        shape[0] //= tp  # by output features, the bias too
    elif tp > 1 and module in ROWWISE and name.endswith("weight"):
        shape[1] //= tp  # by input features
    rows, rest = -(-shape[0] // dp), math.prod(shape[1:])
    return rows * rest, rows * dp * rest


def check(fields: dict, args) -> None:
    if args.tp is not None and args.strategy != "fsdp2-tp":
        raise CourseError(f"--tp is for --strategy fsdp2-tp, not {args.strategy}: drop --tp, or use fsdp2-tp")
    tp = tp_of(args)
    if args.gpus % tp:
        raise CourseError(f"--tp {tp} does not divide --gpus {args.gpus}: use a --tp that divides it, or more GPUs")
    heads = {"attention heads": fields["num_attention_heads"], "intermediate features": fields["intermediate_size"],
             "key/value heads": fields.get("num_key_value_heads") or fields["num_attention_heads"]}
    for what, number in heads.items():
        if number % tp:
            raise CourseError(f"--tp {tp} does not divide the {number} {what}: use a --tp that divides "
                              f"{math.gcd(*heads.values())}")


def tp_of(args) -> int:
    return (args.tp or 2) if args.strategy == "fsdp2-tp" else 1


def estimate(config, shapes: dict, buffers: int, strategy: str, gpus: int, tp: int, batch: int, seq: int,
             dtype: str) -> dict:
    """{moment: {category: bytes on the fullest GPU}} of one training step; the docstring's formula."""
    tp = tp if strategy == "fsdp2-tp" else 1
    dp, e, ac = (1 if strategy == "ddp" else gpus // tp), (2 if dtype == "bfloat16" else 4), strategy == "fsdp2-ac"
    shard = layer = layer_shard = root = matmul = 0
    for name, shape in shapes.items():
        held, gathered = pieces(name, shape, dp, tp)
        shard += held
        matmul += math.prod(shape) if name.endswith("proj.weight") or name == "lm_head.weight" else 0
        if ".layers.0." in name:
            layer, layer_shard = layer + gathered, layer_shard + held
        elif ".layers." not in name:
            root += gathered
    h, inter, vocab, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_attention_heads
    q, k, depth, t = n * config.head_dim, config.num_key_value_heads * config.head_dim, config.num_hidden_layers, \
        batch * seq
    r = 10 if (strategy == "ddp" and e == 2) else 4 + 2 * e
    per_layer = 2 * r * h + (e * (2 * q + 2 * k + 4 * inter) + 4 * n) / tp
    saved = (e * h if ac else per_layer) * t  # one layer's, kept from forward to its backward
    in_flight = e * (2 * inter / tp + h) * t
    state = {"parameters": 4 * (shard + buffers), "optimizer": 8 * shard}
    grads = 4 * shard
    loss = depth * saved + (r * h + 12 * vocab) * t
    if strategy == "ddp":  # gradients ARE the all-reduce buckets, allocated once; autocast's bf16 weight copies
        copies = 2 * matmul if e == 2 else 0
        state.update(gradients=grads, unsharded=0)
        return {"loss": {**state, "gathered": copies, "activations": loss},
                "final norm": {**state, "gathered": copies, "activations": depth * saved + (r + 20) * h * t},
                "layer": {**state, "gathered": copies, "activations": depth * saved + in_flight},
                "step": {**state, "gathered": 0, "activations": 0, "optimizer": 12 * shard}}
    lm_head = vocab * h  # its gradient, unsharded, waits for the root's reduce-scatter at the end of backward
    moments = {"loss": {**state, "gradients": 0, "gathered": e * (root + layer), "unsharded": 0, "activations": loss},
               "final norm": {**state, "gradients": 0, "gathered": e * (root + layer), "unsharded": e * lm_head,
                              "activations": depth * saved + (r + 20) * h * t}}
    for i in reversed(range(depth)):  # backward runs the layers last to first
        gathered = e * root + e * layer * (2 if i else 1) + (4 * layer if i < depth - 1 else 0)
        acts = (i + 1) * saved + (per_layer * t if ac else 0) + in_flight
        moments[f"layer {i}"] = {**state, "gradients": 4 * layer_shard * (depth - 1 - i), "gathered": gathered,
                                 "unsharded": e * (lm_head + h * inter / tp), "activations": acts}
    moments["reduce"] = {**state, "gradients": grads, "gathered": 4 * root + 4 * root / dp,  # the root resharded
                         "unsharded": e * root, "activations": 0}
    moments["step"] = {**state, "gradients": grads, "gathered": 0, "unsharded": 0, "activations": 0,
                       "optimizer": 12 * shard}
    return moments


def peak(moments: dict) -> tuple[str, dict]:
    return max(moments.items(), key=lambda item: sum(item[1].values()))


def with_allowance(tensors: float) -> float:
    return tensors * (1 + ALLOCATOR_SHARE) + ALLOWANCE_GIB * GIB


def advice(config, shapes, buffers, args) -> str:
    """The smallest change that fits: fewer GPUs first, then no activation checkpointing, else a smaller batch."""
    plain = "fsdp2-tp" if args.strategy == "fsdp2-tp" else "fsdp2"
    tp = tp_of(args)
    for gpus in (args.gpus * 2 ** k for k in range(11)):
        for strategy in (plain, "fsdp2-ac"):
            if (strategy, gpus) == (args.strategy, args.gpus) or (strategy == plain and args.strategy == "fsdp2-ac"):
                continue
            size = with_allowance(sum(peak(estimate(config, shapes, buffers, strategy, gpus, tp, args.batch_size,
                                                    args.seq_len, args.dtype))[1].values()))
            if size <= args.gpu_memory * GIB:
                change = f"--strategy {strategy}" + (f" --gpus {gpus}" if gpus != args.gpus else "")
                return f"try {change} ({size / GIB:.1f} GiB)"
    return "lower --batch-size or --seq-len: even 1024x the GPUs with fsdp2-ac do not fit (activations are per GPU)"


def human(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} k"


def report(args) -> dict:
    check(read_config(args.config), args)  # bad input stops here, before transformers is imported
    config = load_config(args.config)
    shapes, buffers = count(config)
    moments = estimate(config, shapes, buffers, args.strategy, args.gpus, tp_of(args), args.batch_size,
                       args.seq_len, args.dtype)
    moment, cats = peak(moments)
    total = sum(cats.values())
    size = with_allowance(total)
    params = sum(math.prod(s) for s in shapes.values())
    layer = sum(math.prod(s) for n, s in shapes.items() if ".layers.0." in n)
    mesh = f" (mesh {args.gpus // tp_of(args)} x tp {tp_of(args)})" if args.strategy == "fsdp2-tp" else ""
    share = "" if args.strategy == "ddp" else " shards"
    print(f"{args.config}: {human(params)} parameters ({params:,}): {config.num_hidden_layers} decoder layers of "
          f"{human(layer)}, {human(params - config.num_hidden_layers * layer)} outside them")
    print(f"{args.strategy} on {args.gpus} GPU(s){mesh} of {args.gpu_memory:g} GiB, batch {args.batch_size} x "
          f"{args.seq_len} tokens, {args.dtype}{' mixed precision' if args.dtype == 'bfloat16' else ''}; "
          f"the peak: {moment} (of {len(moments)} moments of the step)")
    print(f"{'bytes per GPU':<52}{'bytes':>18}{'GiB':>9}")
    rows = [(CATEGORIES[c].format(share if c != "gathered" else ""), cats[c]) for c in CATEGORIES]
    rows += [(f"CUDA context + allocator ({ALLOWANCE_GIB:g} GiB + {ALLOCATOR_SHARE:.0%})", size - total),
             ("total", size)]
    for label, value in rows:
        print(f"{label:<52}{value:>18,.0f}{value / GIB:>9.2f}")
    if not cats["gradients"]:
        print("(no gradients at that moment: zero_grad() freed them, and backward has reduced none yet)")
    fits = size <= args.gpu_memory * GIB
    print(f"fits: {size / GIB:.1f} of {args.gpu_memory:g} GiB" if fits else
          f"does not fit: {size / GIB:.1f} of {args.gpu_memory:g} GiB; {advice(config, shapes, buffers, args)}")
    return {"parameters": params, "moment": moment, "bytes": cats, "total": size, "fits": fits}


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("config", help=f"a Hugging Face decoder config.json ({EXAMPLE})")
    p.add_argument("--gpus", type=positive_int, default=1, help="GPUs in the job, all nodes together (default: 1)")
    p.add_argument("--gpu-memory", type=positive_float, default=80.0, metavar="GIB",
                   help="memory of one GPU in GiB, e.g. 80 for an H100, 141 for an H200 (default: 80)")
    p.add_argument("--strategy", choices=STRATEGIES, default="fsdp2", help="how the model is spread (default: fsdp2)")
    p.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel degree of fsdp2-tp (default: 2)")
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="sequences per GPU per step (fsdp2-tp: per TP group) (default: 1)")
    p.add_argument("--seq-len", type=positive_int, default=4096, help="tokens per sequence (default: 4096)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="bfloat16: mixed precision over fp32 master weights; float32: none (default: bfloat16)")
    return report(p.parse_args(argv))


if __name__ == "__main__":
    run(main)
