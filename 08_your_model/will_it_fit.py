"""Will it fit? The bytes per GPU of training a Hugging Face decoder, by category, and a verdict: before you submit.

    python 08_your_model/will_it_fit.py 08_your_model/configs/llama3_8b.json --gpus 8 --gpu-memory 80 --strategy fsdp2
    python 08_your_model/will_it_fit.py 08_your_model/configs/llama3_70b.json --gpus 32 --strategy fsdp2-ac

No GPU and no download. The parameters are counted exactly, from the config's own model class
(AutoModelForCausalLM.from_config on the meta device: shapes, no memory), so Qwen2's q/k/v biases count; the config is
read by hf_config.py (dense decoders only: a mixture of experts is refused). The layer formula below is a Llama-style
layer's (q, k, v, o, gate, up, down projections, RMSNorm, SwiGLU): a model whose layers hold other pieces is refused.
The step priced is digits_lm.py's: zero_grad() (set_to_none), logits = model(input_ids, use_cache=False).logits.float(),
loss = F.cross_entropy(logits, targets), backward, AdamW's step. (use_cache=True, the configs' default, builds a KV
cache in training too: under checkpoint_wrapper, the cache and each recomputation's k and v stay alive until backward
ends, measured on CPU. Pass use_cache=False.)
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
  the loss, as backward starts: r h (the final norm) + 12 V (log_softmax's fp32 output, its gradient, its input's;
      the bf16 logits and their fp32 copy are freed by then: neither is saved for backward)
  in flight: 20 h of fp32 temporaries in the final norm's backward; G = e (2I / T + h) in a layer's
The peak is the largest of these moments of the step; each printed category is that moment's (W: gathered weights):
  loss        shards + W(root) + (L A + r h + 12 V) t   (the loss is outside the model: backward reaches the root's
              hook, which gathers the last layer, only once the loss's backward is done)
  final norm  shards + W(root, last layer) + lm_head's gradient + (L A + (r + 20) h) t
  layer i     shards + the gradients of layers > i + W(root, layers i and i - 1) + layer i + 1's fp32 reduce-scatter
              input + the gradients of lm_head and down_proj + ((i + 1) A + G) t    (AC: ((i + 1) e h + A + G) t)
  reduce      shards + all gradients + the root's gradients (e) + their fp32 reduce-scatter input and output
  step        shards + all gradients + foreach AdamW's temporary (one fp32 copy of the shards)
  ddp: everything whole on every GPU, the gradients too (they are the buckets); instead of W, autocast's bf16
  copies of the Linear weights
On top, measured on H100s (issue 45; the constants below): CONTEXT_BYTES per process for the CUDA context, cuBLAS
and NCCL, and the caching allocator's reserved memory over the allocated tensors, RESERVED_OVER_ALLOCATED. The
verdict: "fits" when tensors x RESERVED_OVER_ALLOCATED + CONTEXT_BYTES is at most the GPU, "tight" when only
tensors + CONTEXT_BYTES is (it trains only if the allocator fragments less than measured), else "does not fit".
08_your_model/measure_memory.py measures the tensors with torch's FSDPMemTracker on CPU, digits_lm.py's step: within
2% of this estimate, the total and each category, for fsdp2 and fsdp2-ac (tests/test_will_it_fit.py; ddp and
fsdp2-tp follow the same rules, not measured).
"""
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common`, from any working directory
sys.path.insert(1, str(Path(__file__).resolve().parent))  # hf_config, also when imported from elsewhere

import torch

from common.cli import Parser, positive_float, positive_int
from common.errors import CourseError
from common.exits import run
from common.files import work_in_course_folder
from hf_config import read_config

GIB = 2 ** 30
# The allowance on top of the tensors, each part from a measurement (issue 45: 2x H100, torch 2.11.0+cu130, a136b1a):
CONTEXT_BYTES = 1.70e9  # CUDA context + cuBLAS + NCCL per process: mem_get_info() less max_memory_reserved() after
#                         FSDP2 steps over NCCL on H100 (docs: platform notes), 1.58 GiB
RESERVED_OVER_ALLOCATED = dict.fromkeys(("ddp", "fsdp2", "fsdp2-ac", "fsdp2-tp"), 1.31)  # peak reserved over peak
#                         allocated: 1.13-1.31 over fsdp2, fsdp2-ac, ddp and a 152k vocabulary; the largest, for all
STRATEGIES = tuple(RESERVED_OVER_ALLOCATED)
LAYER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the formula's Llama-style layer
COLWISE, ROWWISE = LAYER[:3] + LAYER[4:6], (LAYER[3], LAYER[6])
CATEGORIES = {"parameters": "parameters (fp32{} + buffers)",
              "gradients": "gradients (fp32{})",
              "optimizer": "AdamW state (2 x fp32{}; in its step, +1)",
              "gathered": "gathered units / communication buffers",
              "unsharded": "gradients before their reduce-scatter (unsharded)",
              "activations": "activations (saved for backward, loss, in flight)"}
EXAMPLE = "e.g. 08_your_model/configs/llama3_8b.json"


@dataclasses.dataclass
class Price:
    """One training step's bytes on the fullest GPU: the tensors (by category, at the peak moment), the allowance."""
    moment: str  # the step's moment with the most bytes
    bytes: dict  # {category: bytes} at that moment
    tensors: float  # their sum: what torch.cuda.max_memory_allocated() should show
    fits_line: float  # tensors x RESERVED_OVER_ALLOCATED + CONTEXT_BYTES: a GPU this large trains
    tight_line: float  # tensors + CONTEXT_BYTES: below it, nothing trains
    verdict: str = ""  # fits / tight / does not fit, against gpu_bytes
    gpu_bytes: float = 0

    @property
    def allowance(self) -> float:
        return self.fits_line - self.tensors


def lines(tensors: float, strategy: str) -> tuple[float, float]:
    """(the "fits" line, the "tight" line) in bytes for `tensors` bytes of tensors under `strategy`."""
    return tensors * RESERVED_OVER_ALLOCATED[strategy] + CONTEXT_BYTES, tensors + CONTEXT_BYTES


def verdict(fits_line: float, tight_line: float, gpu_bytes: float) -> str:
    return "fits" if fits_line <= gpu_bytes else "tight" if tight_line <= gpu_bytes else "does not fit"


def with_allowance(tensors: float, strategy: str = "fsdp2") -> float:
    return lines(tensors, strategy)[0]


ALLOWANCE_GIB = CONTEXT_BYTES / GIB  # benchmarks/llm_fit.py's "tight" line: tensors + the context


def load_config(path, flag: str = "config"):
    """The config.json as its transformers config (hf_config.read_config: one line for anything it cannot use)."""
    return read_config(path, flag)


def count(config) -> tuple[dict, int]:
    """{name: shape} of every parameter of the config's model class (tied weights once), and its buffers' elements."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):  # shapes only: a 70 B model in no memory, in seconds
        model = AutoModelForCausalLM.from_config(config)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    found = {n.split(".")[-2] for n in shapes if ".layers.0." in n and n.endswith(".weight") and "_proj." in n}
    if found != set(LAYER):
        raise CourseError(f"{config.model_type}: its decoder layer holds {sorted(found) or 'no *_proj weights'}, not "
                          f"a Llama-style layer's {', '.join(LAYER)}: this formula cannot price it")
    return shapes, sum(b.numel() for b in model.buffers())


def price(config, strategy: str, gpus: int, batch: int, seq: int, tp: int | None = None, dtype: str = "bfloat16",
          gpu_memory_gib: float = 80.0, counted: tuple | None = None) -> Price:
    """The estimate of `strategy` on `gpus` GPUs of `gpu_memory_gib` GiB, batch x seq tokens per GPU, with its
    verdict. `counted`: count(config)'s result, when the caller keeps it (a count builds the model on meta)."""
    shapes, buffers = counted or count(config)
    moment, cats = peak(estimate(config, shapes, buffers, strategy, gpus, tp or 2, batch, seq, dtype))
    tensors = sum(cats.values())
    fits_line, tight_line = lines(tensors, strategy)
    gpu_bytes = gpu_memory_gib * GIB
    return Price(moment, cats, tensors, fits_line, tight_line, verdict(fits_line, tight_line, gpu_bytes), gpu_bytes)


def pieces(name: str, shape: tuple, dp: int, tp: int) -> tuple[int, int]:
    """(elements rank 0 holds, elements a gather of the unit allocates): the TP cut first, then FSDP2's rows, padded."""
    shape, module = list(shape), name.split(".")[-2]
    if tp > 1 and module in COLWISE:
        shape[0] //= tp  # by output features, the bias too
    elif tp > 1 and module in ROWWISE and name.endswith("weight"):
        shape[1] //= tp  # by input features
    rows, rest = -(-shape[0] // dp), math.prod(shape[1:])
    return rows * rest, rows * dp * rest


def check(config, args) -> None:
    if args.tp is not None and args.strategy != "fsdp2-tp":
        raise CourseError(f"--tp is for --strategy fsdp2-tp, not {args.strategy}: drop --tp, or use fsdp2-tp")
    tp = tp_of(args)
    if args.gpus % tp:
        raise CourseError(f"--tp {tp} does not divide --gpus {args.gpus}: use a --tp that divides it, or more GPUs")
    heads = {"attention heads": config.num_attention_heads, "intermediate features": config.intermediate_size,
             "key/value heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
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
    q, k = (shapes[f"model.layers.0.self_attn.{m}.weight"][0] for m in ("q_proj", "k_proj"))  # any head_dim
    depth, t = config.num_hidden_layers, batch * seq
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
    moments = {"loss": {**state, "gradients": 0, "gathered": e * root, "unsharded": 0, "activations": loss},
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


def advice(config, shapes, buffers, args) -> str:
    """The smallest change that fits: fewer GPUs first, then no activation checkpointing, else a smaller batch."""
    plain = "fsdp2-tp" if args.strategy == "fsdp2-tp" else "fsdp2"
    tp = tp_of(args)
    for gpus in (args.gpus * 2 ** k for k in range(11)):
        for strategy in (plain, "fsdp2-ac"):
            if (strategy, gpus) == (args.strategy, args.gpus) or (strategy == plain and args.strategy == "fsdp2-ac"):
                continue
            size = price(config, strategy, gpus, args.batch_size, args.seq_len, tp, args.dtype, args.gpu_memory,
                         (shapes, buffers)).fits_line
            if size <= args.gpu_memory * GIB:
                change = f"--strategy {strategy}" + (f" --gpus {gpus}" if gpus != args.gpus else "")
                return f"try {change} ({size / GIB:.1f} GiB)"
    return "lower --batch-size or --seq-len: even 1024x the GPUs with fsdp2-ac do not fit (activations are per GPU)"


def human(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} k"


def report(args) -> dict:
    config = load_config(args.config)
    shapes, buffers = count(config)  # a layer that is not Llama-style stops here
    check(config, args)
    result = price(config, args.strategy, args.gpus, args.batch_size, args.seq_len, tp_of(args), args.dtype,
                   args.gpu_memory, (shapes, buffers))
    cats = result.bytes
    params = sum(math.prod(s) for s in shapes.values())
    layer = sum(math.prod(s) for n, s in shapes.items() if ".layers.0." in n)
    mesh = f" (mesh {args.gpus // tp_of(args)} x tp {tp_of(args)})" if args.strategy == "fsdp2-tp" else ""
    share = "" if args.strategy == "ddp" else " shards"
    print(f"{args.config}: {human(params)} parameters ({params:,}, {type(config).__name__[:-6]}ForCausalLM): "
          f"{config.num_hidden_layers} decoder layers of {human(layer)}, "
          f"{human(params - config.num_hidden_layers * layer)} outside them")
    print(f"{args.strategy} on {args.gpus} GPU(s){mesh} of {args.gpu_memory:g} GiB, batch {args.batch_size} x "
          f"{args.seq_len} tokens, {args.dtype}{' mixed precision' if args.dtype == 'bfloat16' else ''}; "
          f"the peak: {result.moment}")
    print(f"{'bytes per GPU':<52}{'bytes':>18}{'GiB':>9}")
    rows = [(CATEGORIES[c].format(share if c != "gathered" else ""), cats[c]) for c in CATEGORIES]
    rows += [("tensors (torch.cuda.max_memory_allocated)", result.tensors),
             (f"allocator reserved ({RESERVED_OVER_ALLOCATED[args.strategy]:g}x) + context "
              f"({CONTEXT_BYTES / GIB:.2f} GiB)", result.allowance), ("total: fits at", result.fits_line)]
    for label, value in rows:
        print(f"{label:<52}{value:>18,.0f}{value / GIB:>9.2f}")
    if not cats["gradients"]:
        print("(no gradients at that moment: zero_grad() freed them, and backward has reduced none yet)")
    of = f"of {args.gpu_memory:g} GiB"
    print(f"fits: {result.fits_line / GIB:.1f} {of}" if result.verdict == "fits" else
          f"tight: {result.fits_line / GIB:.1f} {of} with the measured allocator share, {result.tight_line / GIB:.1f} "
          f"without it; {advice(config, shapes, buffers, args)}" if result.verdict == "tight" else
          f"does not fit: {result.fits_line / GIB:.1f} {of}; {advice(config, shapes, buffers, args)}")
    return {"parameters": params, **dataclasses.asdict(result)}


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
