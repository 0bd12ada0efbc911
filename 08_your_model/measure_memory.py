"""will_it_fit.py checked against measured steps of digits_lm.py's step: on the CPU by torch's trackers, or on GPUs.

    torchrun --standalone --nproc_per_node=2 08_your_model/measure_memory.py
    torchrun --standalone --nproc_per_node=2 08_your_model/measure_memory.py --strategies fsdp2-ac --vocab 256
    torchrun --standalone --nproc_per_node=2 08_your_model/measure_memory.py --device cuda --strategies ddp,fsdp2 \
        --config 08_your_model/configs/tinyllama_1.1b.json --batch-size 2 --seq-len 2048

The model is a Llama of the shape flags (or --config's model, random weights: no download), wrapped as will_it_fit.py
assumes: ddp, DistributedDataParallel(gradient_as_bucket_view=True) with bf16 autocast around forward and loss;
fsdp2, fully_shard per decoder layer, then the root, bf16 MixedPrecisionPolicy with fp32 reduce; fsdp2-ac, with
checkpoint_wrapper per layer. Each strategy runs 3 steps: zero_grad + forward (logits.float(), F.cross_entropy) +
backward + AdamW (fused on GPUs). AdamW's state exists from the first step's end, DDP's rebuilt buckets from the second.
On the CPU (gloo) the third step runs inside torch's tracker, a TorchDispatchMode that sees every tensor an op creates
or frees and labels its storage: FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker) for fsdp2, MemTracker
(mem_tracker) for ddp, with the DDP buckets labelled gradients (they hold them). Its peak is the largest sum of live
storages, exact bytes, no allocator: what will_it_fit.py calls the tensors. Rank 0 prints, per strategy, the
measured and the estimated bytes by category, then one JSON line. Run it on 2 ranks or more: on one, FSDP2 keeps no
all-gather or reduce-scatter buffer, and only the totals agree (within 2%), not the categories.
On GPUs (nccl), torch.cuda.max_memory_allocated over the 3 steps is the measure, and every rank prints its line: the
device, its total memory, will_it_fit.py's estimate (the tensors), the measured peak and their ratio, and each step's
peak and allocated bytes at its loss (before backward). On the CPU the same line carries the tracker's peak.
"""
import gc
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common`, from any working directory
sys.path.insert(1, str(Path(__file__).resolve().parent))  # this folder's modules, also when imported from elsewhere

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from common.cli import Parser, positive_int
from common.distributed import launch_env
from common.errors import CourseError
from common.exits import run
from common.files import work_in_course_folder
from hf_config import read_config
from memory_formula import CATEGORIES, count, estimate, peak

STEP = "digits_lm"  # the step measured: digits_lm.py's logits.float() and F.cross_entropy, as will_it_fit.py prices
STEPS = 3
STRATEGIES = ("ddp", "fsdp2", "fsdp2-ac")
GIB = 2 ** 30
# The trackers' labels (FSDPMemTracker's _FSDPRefType, MemTracker's _MemRefType) in will_it_fit.py's categories
TRACKED = {"Sharded Param": "parameters", "Buffer": "parameters", "Sharded Grad": "gradients", "OptState": "optimizer",
           "Unsharded Param": "gathered", "Unsharded Grad": "unsharded", "All Gather": "gathered",
           "Reduce Scatter": "gathered", "Activation": "activations", "Temp": "activations", "Inputs": "activations",
           "Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer", "Other": "activations"}
# The rows compared. FSDPMemTracker labels a gradient of a gathered weight "Temp" until its unit's post-backward, and
# MemTracker labels autocast's bf16 weight copies activations: those are compared together.
ROWS = {"parameters": ("parameters",), "gradients": ("gradients",), "optimizer state": ("optimizer",),
        "gathered weights, all-gather and reduce-scatter buffers": ("gathered",),
        "activations + unsharded gradients": ("activations", "unsharded"), "total": tuple(CATEGORIES)}
DDP_ROWS = {**{k: v for k, v in ROWS.items() if v in (("parameters",), ("gradients",), ("optimizer",))},
            "activations + autocast's bf16 weight copies": ("activations", "gathered"), "total": tuple(CATEGORIES)}


def build(config, strategy: str, mesh, device, dtype):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # random weights: fp32 masters
    if strategy == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       gradient_as_bucket_view=True)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.model.layers):
        if strategy == "fsdp2-ac":  # before fully_shard: the wrapper sits inside the unit that gathers its weights
            layer = model.model.layers[i] = checkpoint_wrapper(layer)
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: embeddings, final norm, lm_head
    return model


def measure(config, strategy: str, args, mesh, device) -> dict:
    """{"peak": bytes, "steps": [(step's peak, allocated at its loss)] on GPUs, "measured": {category: bytes} on the
    CPU} on this rank."""
    cuda, dtype = device.type == "cuda", getattr(torch, args.dtype)
    gc.collect()  # the previous strategy's model (DDP's reducer holds reference cycles)
    model = build(config, strategy, mesh, device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=cuda)
    tokens = torch.Generator().manual_seed(dist.get_rank())
    autocast = torch.autocast(device.type, dtype, enabled=strategy == "ddp" and dtype != torch.float32)
    steps = []
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # the model and DDP's buckets stay counted: they are allocated

    def step(tracker=None):
        ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1), generator=tokens).to(device)
        if isinstance(tracker, FSDPMemTracker):
            tracker.track_inputs((ids,))
        optimizer.zero_grad()
        with autocast:
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits.float()  # seq_len tokens in
            loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        del logits  # the output, with its bf16 logits, dropped as in digits_lm.py
        at_loss = torch.cuda.memory_allocated(device) if cuda else 0
        loss.backward()
        optimizer.step()
        if cuda:
            steps.append((torch.cuda.max_memory_allocated(device), at_loss))

    for _ in range(STEPS - (0 if cuda else 1)):
        step()
    if cuda:
        return {"peak": torch.cuda.max_memory_allocated(device), "steps": steps}
    if strategy == "ddp":  # the buckets, as the gradients still in them show, before the tracked zero_grad
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    else:
        tracker = FSDPMemTracker(model, optimizer)
    with tracker:
        step(tracker)
    found = dict.fromkeys(CATEGORIES, 0)
    for label, size in tracker.get_tracker_snapshot("peak")[device].items():
        if label != "Total":
            found[TRACKED[getattr(label, "value", label)]] += size
    return {"peak": sum(found.values()), "measured": found}


def where(device) -> tuple[str, int]:
    """(the device's name, its total memory in bytes)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory
    return f"cpu ({platform.processor() or platform.machine()})", os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")


def model_config(args):
    if args.config:
        return read_config(args.config, "--config")
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                       tie_word_embeddings=False)


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated, of {', '.join(STRATEGIES)} "
                   f"(default: all)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: gloo and the trackers; cuda: nccl and max_memory_allocated (default: cpu)")
    p.add_argument("--config", help="a decoder's config.json, built with random weights (default: the shape flags)")
    p.add_argument("--hidden", type=positive_int, default=256, help="hidden size (default: 256)")
    p.add_argument("--intermediate", type=positive_int, default=688, help="MLP width (default: 688)")
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers (default: 4)")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads (default: 4)")
    p.add_argument("--kv-heads", type=positive_int, default=2, help="key/value heads (default: 2)")
    p.add_argument("--vocab", type=positive_int, default=1024, help="vocabulary (default: 1024)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="sequences per rank (default: 4)")
    p.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="(default: bfloat16)")
    args = p.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",")]
    if set(strategies) - set(STRATEGIES):
        raise CourseError(f"--strategies {args.strategies}: only {', '.join(STRATEGIES)} are measured here")
    config = model_config(args)
    shapes, buffers = count(config)  # a layer the formula cannot price stops here, before any process group
    env = launch_env()  # torchrun's RANK, WORLD_SIZE, ...; a plain `python` run is a world of one
    device = torch.device(args.device, env.local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CourseError("--device cuda but no CUDA GPU is visible: run on a GPU node or use --device cpu")
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    name, total = where(device)
    rows = []
    for strategy in strategies:
        found = measure(config, strategy, args, mesh, device)
        moment, guess = peak(estimate(config, shapes, buffers, strategy, dist.get_world_size(), 1, args.batch_size,
                                      args.seq_len, args.dtype, nccl=device.type == "cuda"))
        estimated = sum(guess.values())
        measured_by = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "the tracker's peak"
        steps = "".join(f"; step {i + 1}: peak {p / GIB:.2f} GiB, {a / GIB:.2f} GiB at its loss"
                        for i, (p, a) in enumerate(found.get("steps", ())))
        print(f"rank {dist.get_rank()}: {name}, total memory {total:,} bytes ({total / GIB:.2f} GiB); {strategy}: "
              f"estimate (tensors) {estimated:,.0f} bytes ({estimated / GIB:.2f} GiB), {measured_by} "
              f"{found['peak']:,} bytes ({found['peak'] / GIB:.2f} GiB), ratio {found['peak'] / estimated:.3f}{steps}",
              flush=True)
        if "measured" in found:
            rows.append({"strategy": strategy, "ranks": dist.get_world_size(), "moment": moment, "step": STEP,
                         "measured": found["measured"], "estimated": {c: int(guess[c]) for c in CATEGORIES}})
    dist.barrier()  # the per-rank lines first
    if dist.get_rank() == 0:
        for row in rows:
            print(f"{row['strategy']} on {row['ranks']} rank(s), {config.num_hidden_layers} layers, hidden "
                  f"{config.hidden_size}, vocab {config.vocab_size}, batch {args.batch_size} x {args.seq_len}; "
                  f"estimated peak: {row['moment']}")
            print(f"{'bytes on rank 0':<56}{'measured':>14}{'estimated':>14}{'ratio':>8}")
            for label, keys in (DDP_ROWS if row["strategy"] == "ddp" else ROWS).items():
                m, e = (sum(row[k][c] for c in keys) for k in ("measured", "estimated"))
                print(f"{label:<56}{m:>14,}{e:>14,}{e / m if m else 1:>8.3f}")
        for row in rows:
            print(json.dumps(row))
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    run(main)
