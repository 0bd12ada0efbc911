"""will_it_fit.py's formula: the bytes per GPU of one training step of a Llama-style decoder, by moment and category.

The parameters are counted exactly, from the config's own model class (AutoModelForCausalLM.from_config on the meta
device: shapes, no memory), so Qwen2's q/k/v biases count. The layer formula is a Llama-style layer's (q, k, v, o,
gate, up, down projections, two RMSNorms, SwiGLU): a layer that holds anything else (Gemma-2's four norms per layer,
Qwen3's q/k norms, a fused qkv_proj) is refused: its saved tensors are not in the formula.
The step priced is digits_lm.py's: zero_grad() (set_to_none), logits = model(input_ids, use_cache=False).logits.float(),
loss = F.cross_entropy(logits, targets), backward, AdamW's step. (use_cache=True, the configs' default, builds a KV
cache in training too: under checkpoint_wrapper, the cache and each recomputation's k and v stay alive until backward
ends, measured on CPU. Pass use_cache=False.)

In bytes per token (t = batch x seq tokens per GPU; e = 2 for bf16, 4 for fp32; h hidden, I intermediate, V vocab,
L layers, n heads, q = n x head_dim, k = kv heads x head_dim, T = tp, 1 without TP):
  A = 2 r h + (e (2q + 2k + 4I) + 4n) / T      saved for backward by one decoder layer
      r = 4 + 2e: each RMSNorm keeps its input in fp32 and its output twice, before and after its weight; SDPA (flash)
      keeps q, k, v (GQA: k and v at kv width), its output and 4 bytes of log-sum-exp per head; the MLP keeps gate,
      silu(gate), up and their product
  ddp (bf16 autocast over fp32 weights): the residual stream stays fp32, so 2 r h becomes 26 h: each norm keeps its
      fp32 input and normalized output (8 h), and each of the five projections that read a norm (q, k, v; gate, up)
      saves its own bf16 cast of it (5 x 2 h): autocast caches the casts of leaf weights only, not of activations
      (aten's cached_cast); the final norm keeps r h = 10 h (8 h, and lm_head's cast)
  a checkpointed layer saves e h (its input), and holds its A again while its backward recomputes it
  the loss, as backward starts: r h (the final norm) + 12 V (log_softmax's fp32 output, its gradient, its input's;
      the bf16 logits and their fp32 copy are freed by then: neither is saved for backward)
  in flight: 20 h of fp32 temporaries in the final norm's backward; G = e (2I / T + h) in a layer's
The peak is the largest of these moments of the step; each category is that moment's (W: gathered weights):
  loss        shards + W(root) + (L A + r h + 12 V) t   (the loss is outside the model: backward reaches the root's
              hook, which gathers the last layer, only once the loss's backward is done)
  final norm  shards + W(root, last layer) + lm_head's gradient + (L A + (r + 20) h) t
  layer i     shards + the gradients of layers > i + W(root, layers i and i - 1) + layer i + 1's fp32 reduce-scatter
              input + the gradients of lm_head and down_proj + ((i + 1) A + G) t    (AC: ((i + 1) e h + A + G) t)
  reduce      shards + all gradients + the root's gradients (e) + their fp32 reduce-scatter input and output
  step        shards + all gradients + foreach AdamW's temporary (one fp32 copy of the shards)
  ddp: everything whole on every GPU, the gradients too (they are the buckets, allocated with the model); instead of
  W, autocast's bf16 copies of every Linear's weight and bias (a tied lm_head's too: the embedding cast for lm_head);
  on more than one GPU, the second step's forward and backward also hold the old buckets (4 bytes a parameter): DDP
  rebuilds its buckets before that forward (torch's distributed.py: "It may allocate new buckets before deallocating
  old buckets"); over NCCL the old ones were still allocated through that step, on one rank or both, and gone by
  the third (measured on 2 H200s, torch 2.11.0+cu130, 2026-11-28; not seen on gloo)
Checked against torch's memory trackers on CPU (08_your_model/measure_memory.py, tests/test_will_it_fit.py): ddp, fsdp2
and fsdp2-ac within 2%, the total and each category, on one 4-layer Llama; on 2 H200s, max_memory_allocated of the
fullest rank against the tensors: ddp 1.002 (TinyLlama-1.1B) and 1.004 (Qwen2-1.5B), fsdp2 1.004 for both, batch 2 x
2048 (tests/test_will_it_fit.py keeps those rows); fsdp2-tp follows the same rules, not measured. CPU autocast casts linear and SDPA to bf16 as CUDA's does; the ops it leaves alone that CUDA runs in fp32
(pow, rsqrt, log_softmax) get fp32 inputs here anyway: the ddp findings carry over.
"""
import math

import torch

from common.errors import CourseError

LAYER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the formula's Llama-style layer
NORMS = ("input_layernorm", "post_attention_layernorm")
COLWISE, ROWWISE = LAYER[:3] + LAYER[4:6], (LAYER[3], LAYER[6])
CATEGORIES = {"parameters": "parameters (fp32{} + buffers)",
              "gradients": "gradients (fp32{})",
              "optimizer": "AdamW state (2 x fp32{}; in its step, +1)",
              "gathered": "gathered units / communication buffers",
              "unsharded": "gradients before their reduce-scatter (unsharded)",
              "activations": "activations (saved for backward, loss, in flight)"}


def count(config) -> tuple[dict, int]:
    """{name: shape} of every parameter of the config's model class (tied weights once), and its buffers' elements."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):  # shapes only: a 70 B model in no memory, in seconds
        model = AutoModelForCausalLM.from_config(config)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    modules = {n.split(".")[-2] for n in shapes if ".layers.0." in n}
    if not set(LAYER) <= modules:
        holds = ", ".join(sorted(modules)) or "no *_proj weights"
        raise CourseError(f"{config.model_type}: its decoder layer holds {holds}, not a Llama-style layer's "
                          f"{', '.join(LAYER)}: this formula cannot price it")
    if extra := sorted(modules - set(LAYER) - set(NORMS)):
        raise CourseError(f"{config.model_type}: its decoder layer also holds {', '.join(extra)}, beside a Llama-style "
                          f"layer's projections, {' and '.join(NORMS)}: this formula cannot price it")
    return shapes, sum(b.numel() for b in model.buffers())


def pieces(name: str, shape: tuple, dp: int, tp: int) -> tuple[int, int]:
    """(elements rank 0 holds, elements a gather of the unit allocates): the TP cut first, then FSDP2's rows, padded."""
    shape, module = list(shape), name.split(".")[-2]
    if tp > 1 and module in COLWISE:
        shape[0] //= tp  # by output features, the bias too
    elif tp > 1 and module in ROWWISE and name.endswith("weight"):
        shape[1] //= tp  # by input features
    rows, rest = -(-shape[0] // dp), math.prod(shape[1:])
    return rows * rest, rows * dp * rest


def estimate(config, shapes: dict, buffers: int, strategy: str, gpus: int, tp: int, batch: int, seq: int,
             dtype: str, nccl: bool = True) -> dict:
    """{moment: {category: bytes on the fullest GPU}} of one training step; the docstring's formula. nccl=False:
    without what only NCCL keeps (DDP's old buckets in its second step): for the CPU trackers on gloo."""
    tp = tp if strategy == "fsdp2-tp" else 1
    dp, e, ac = (1 if strategy == "ddp" else gpus // tp), (2 if dtype == "bfloat16" else 4), strategy == "fsdp2-ac"
    autocast = strategy == "ddp" and e == 2
    shard = layer = layer_shard = root = linear = 0
    for name, shape in shapes.items():
        held, gathered = pieces(name, shape, dp, tp)
        shard += held
        linear += math.prod(shape) if name.split(".")[-2] in (*LAYER, "lm_head") else 0
        if ".layers.0." in name:
            layer, layer_shard = layer + gathered, layer_shard + held
        elif ".layers." not in name:
            root += gathered
    h, inter, vocab, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_attention_heads
    if "lm_head.weight" not in shapes:  # tied: lm_head multiplies by the embedding's weight
        linear += vocab * h
    q, k = (shapes[f"model.layers.0.self_attn.{m}.weight"][0] for m in ("q_proj", "k_proj"))  # any head_dim
    depth, t = config.num_hidden_layers, batch * seq
    r = 10 if autocast else 4 + 2 * e
    per_layer = (26 if autocast else 2 * r) * h + (e * (2 * q + 2 * k + 4 * inter) + 4 * n) / tp
    saved = (e * h if ac else per_layer) * t  # one layer's, kept from forward to its backward
    in_flight = e * (2 * inter / tp + h) * t
    state = {"parameters": 4 * (shard + buffers), "optimizer": 8 * shard}
    grads = 4 * shard
    loss = depth * saved + (r * h + 12 * vocab) * t
    if strategy == "ddp":  # gradients ARE the all-reduce buckets, allocated once; autocast's bf16 weight copies
        copies = 2 * linear if autocast else 0
        state.update(gradients=grads * (2 if nccl and gpus > 1 else 1), unsharded=0)  # + the old buckets (docstring)
        return {"loss": {**state, "gathered": copies, "activations": loss},
                "final norm": {**state, "gathered": copies, "activations": depth * saved + (r + 20) * h * t},
                "layer": {**state, "gathered": copies, "activations": depth * saved + in_flight},
                "step": {**state, "gradients": grads, "gathered": 0, "activations": 0, "optimizer": 12 * shard}}
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
