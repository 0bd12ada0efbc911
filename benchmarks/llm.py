"""Lesson 08's model class on GPUs, one run at a time: a LlamaForCausalLM from its config (no download), sharded as
digits_lm.py does, trained on synthetic tokens; tokens/s per GPU, MFU, peak memory, or the out-of-memory error.

A run (Setup) builds the model on this process's device (the same seed on every rank: one model), shards it
(fully_shard per decoder layer, then the root; bf16 params, fp32 reduce; fsdp2-ac: checkpoint_wrapper per layer; ddp:
DistributedDataParallel with bf16 autocast), optionally compiles each decoder layer and converts the Linears to
float8 (torchao), then takes `warmup` untimed steps and `steps` timed ones between two torch.cuda.synchronize.
The data: each sequence is a random segment of 64 tokens repeated (a copy task: the loss falls as the model learns to
copy), drawn from (seed, step, rank): the same data for every run of one launch. MFU = 08_your_model/flops.py's
FLOPs per token (6 N + 12 L a s, N without the input embedding) x tokens/s per GPU / the GPU's dense bf16 peak.
The suites that use runs: benchmarks/llm_suites.py.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.launch import ROOT

sys.path.insert(0, str(ROOT / "08_your_model"))
import flops  # noqa: E402  (08_your_model/flops.py: the FLOPs formula and the peaks, in one place)

SEQ, QUICK_SEQ, SEGMENT = 2048, 64, 64
# TinyLlama's shape (1.1 B parameters) and a hidden-4096 Llama of 8 layers (2.0 B); 152k: a large vocabulary on the
# 1.1 B shape's layers, for the memory verdict (its fp32 logits are 4.6 GiB at batch 4).
SHAPES = {"1.1B": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
                   "num_key_value_heads": 4, "vocab_size": 32000},
          "h4096": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 8, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "vocab_size": 32000},
          "152k": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8, "num_attention_heads": 32,
                   "num_key_value_heads": 4, "vocab_size": 152064}}


@dataclasses.dataclass(frozen=True)
class Setup:
    shape: str
    batch: int
    strategy: str = "fsdp2"          # fsdp2 | fsdp2-ac | ddp
    compile: bool = False            # torch.compile per decoder layer
    loss_compile: bool = False       # False: model(input_ids, labels=...).loss; True: a torch.compile of the loss
    fused: bool = True               # AdamW(fused=True) on GPUs; else foreach
    reshard_last: bool = True        # False: the last layer keeps its gathered weights from forward to backward
    float8: str | None = None        # torchao recipe: tensorwise | rowwise
    warmup: int = 3
    steps: int = 10


def config(shape: str, quick: bool):
    """The shape's LlamaConfig; --quick: the same structure, 32x narrower, 2 layers."""
    from transformers import LlamaConfig
    s = dict(SHAPES[shape])
    if quick:
        s.update(hidden_size=s["hidden_size"] // 32, intermediate_size=s["intermediate_size"] // 32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=min(4, s["num_key_value_heads"]),
                 vocab_size=s["vocab_size"] // 64)
    return LlamaConfig(**s, max_position_embeddings=QUICK_SEQ if quick else SEQ, attn_implementation="sdpa",
                       use_cache=False, tie_word_embeddings=False)


def tokens(vocab: int, batch: int, seq: int, seed: int, step: int, rank: int, device) -> torch.Tensor:
    """Step `step`'s batch on rank `rank`: each row a random 64-token segment, repeated to `seq` tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    segment = torch.randint(0, vocab, (batch, SEGMENT), generator=g)
    return segment.repeat(1, -(-seq // SEGMENT))[:, :seq].to(device, non_blocking=True)


def compiled_loss(logits, ids):
    """The next-token cross-entropy as transformers computes it (fp32), for torch.compile to fuse."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def float8_filter(module, fqn: str) -> bool:
    """torchao's float8 Linears need both dimensions divisible by 16; lm_head stays bf16 (as torchtitan does)."""
    return fqn != "lm_head" and module.in_features % 16 == 0 and module.out_features % 16 == 0


def build(setup: Setup, cfg, mesh, device):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)  # every rank the same model
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    if setup.float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(setup.float8),
                                   module_filter_fn=float8_filter)
    if setup.strategy == "ddp":  # eager: the memory verdict's runs
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    backend = "inductor" if device.type == "cuda" else "aot_eager"  # --quick: dynamo and autograd's tracing only
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if setup.strategy == "fsdp2-ac":  # before fully_shard: the wrapper sits inside the unit that gathers
            layer = layers[i] = checkpoint_wrapper(layer)
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=setup.reshard_last or i < len(layers) - 1)
        if setup.compile:
            layer.compile(backend=backend)  # FSDP2's hooks stay outside the graph (they are dynamo-disabled)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def memory(device) -> dict:
    """Peak allocated and reserved bytes; the context (CUDA, cuBLAS, NCCL): the device's used bytes less reserved."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.max_memory_reserved(device)
    return {"peak_allocated": torch.cuda.max_memory_allocated(device), "peak_reserved": reserved,
            "context": total - free - reserved, "total_memory": total}


def clean(device) -> None:
    gc.collect()
    torch._dynamo.reset()  # the next run compiles for its own shapes: no automatic dynamic shapes carried over
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(setup: Setup, L, mesh, seed: int = 1, cap_bytes: int | None = None, trace: str | None = None) -> dict:
    """One run: its row's numbers, or its out-of-memory error, caught: the launch goes on. (On several GPUs a rank
    that runs out alone would leave the others waiting in a collective: the capped runs take one GPU.) cap_bytes:
    the allocator's limit (torch.cuda.set_per_process_memory_fraction), set once the model is sharded. trace: after
    the timed steps, 2 more under torch.profiler, written there (Chrome trace JSON)."""
    device, quick = L.device, L.quick
    seq, cfg = QUICK_SEQ if quick else SEQ, config(setup.shape, quick)
    row = {"seq": seq, **dataclasses.asdict(setup), "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")}
    clean(device)
    try:
        row.update(_run(setup, cfg, seq, L, mesh, seed, cap_bytes, trace), outcome="trained", **memory(device))
    except Exception as exc:  # out of memory (the allocator's, cuBLAS's or NCCL's), or a failed compile: one row
        text = f"{type(exc).__name__}: {exc}".split("\n")[0][:300]
        row.update(outcome="out of memory" if "out of memory" in text.lower() or "ALLOC_FAILED" in text else "failed",
                   error=text, **memory(device))
    finally:
        if cap_bytes:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        clean(device)
    if "tokens_per_s" in row:
        per_token, peak = flops_per_token(cfg, seq), flops.peak_flops(L.gpu)
        row.update(flops_per_token=per_token, peak_flops=peak,
                   mfu=per_token * row["tokens_per_s"] / peak if peak else None)
    return row


def flops_per_token(cfg, seq: int) -> float:
    """flops.py's 6 N + 12 L a s with N = the parameters less the input embedding (a lookup, no multiply); lm_head,
    a matmul, counts; a = heads x head_dim."""
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return flops.flops_per_token(flops.multiplying_parameters(model), cfg.num_hidden_layers,
                                 flops.attention_width(cfg), seq)


def _run(setup: Setup, cfg, seq: int, L, mesh, seed: int, cap_bytes, trace) -> dict:
    """The run's steps; an exception frees this frame, and with it every tensor of the run."""
    device = L.device
    model = build(setup, cfg, mesh, device)
    parameters = sum(p.numel() for p in model.parameters())  # DTensors count their global elements
    clean(device)  # the full model each rank built before sharding: not part of the step's memory
    if cap_bytes:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / torch.cuda.mem_get_info(device)[1]), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                  **({"fused": True} if setup.fused and device.type == "cuda" else {"foreach": True}))
    loss_fn = torch.compile(compiled_loss, backend="inductor" if device.type == "cuda" else "aot_eager") \
        if setup.loss_compile else None
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=setup.strategy == "ddp")
    losses = []

    def step(i):
        ids = tokens(cfg.vocab_size, setup.batch, seq, seed, i, L.rank, device)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss if loss_fn is None else loss_fn(model(input_ids=ids).logits,
                                                                                         ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    began = time.perf_counter()
    for i in range(setup.warmup):
        step(i)
    sync(device)
    warmup_s, began = time.perf_counter() - began, time.perf_counter()
    for i in range(setup.warmup, setup.warmup + setup.steps):
        step(i)
    sync(device)
    seconds = time.perf_counter() - began
    if trace:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(setup.warmup + setup.steps, setup.warmup + setup.steps + 2):
                step(i)
            sync(device)
        prof.export_chrome_trace(trace)
    return {"parameters": parameters, "warmup_s": warmup_s, "step_s": seconds / setup.steps,
            "tokens_per_s": setup.batch * seq * setup.steps / seconds,
            "losses": [float(x) for x in torch.stack(losses)[:setup.warmup + setup.steps]]}
