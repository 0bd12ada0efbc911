"""will_it_fit.py checked against a measured step: a tiny Llama under FSDP2 on gloo, on the CPU, digits_lm.py's step.

    torchrun --standalone --nproc_per_node=2 08_your_model/measure_memory.py
    torchrun --standalone --nproc_per_node=2 08_your_model/measure_memory.py --strategies fsdp2-ac --vocab 256

The model is sharded as will_it_fit.py assumes (fully_shard per decoder layer, then the root, bf16
MixedPrecisionPolicy with fp32 reduce, checkpoint_wrapper per layer for fsdp2-ac). After one warm-up step (AdamW's
state exists from then on), one more step, zero_grad + forward (logits.float(), F.cross_entropy) + backward + AdamW,
runs inside torch's FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker): a TorchDispatchMode that sees every
tensor an op creates or frees, on any device, and labels its storage (sharded or gathered parameter, gradient,
optimizer state, all-gather and reduce-scatter buffer, activation, backward temporary, input). Its peak is the largest
sum of live storages, and the categories are those of that moment. On the CPU it counts exact storage bytes, no
allocator: what will_it_fit.py calls the tensors, before its allowance for the CUDA context and the allocator. Rank 0
prints, per strategy, the measured and the estimated bytes by category, then one JSON line. Run it on 2 ranks or more:
on one, FSDP2 keeps no all-gather or reduce-scatter buffer, and only the totals agree (within 2%), not the categories.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common`, from any working directory

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from common.cli import Parser, positive_int
from common.distributed import launch_env
from common.errors import CourseError
from common.exits import run
from common.files import work_in_course_folder
from will_it_fit import CATEGORIES, count, estimate, peak

STEP = "digits_lm"  # the step measured: digits_lm.py's logits.float() and F.cross_entropy, as will_it_fit.py prices
# FSDPMemTracker's labels (_FSDPRefType) in will_it_fit.py's categories
TRACKED = {"Sharded Param": "parameters", "Buffer": "parameters", "Sharded Grad": "gradients", "OptState": "optimizer",
           "Unsharded Param": "gathered", "Unsharded Grad": "unsharded", "All Gather": "gathered",
           "Reduce Scatter": "gathered", "Activation": "activations", "Temp": "activations", "Inputs": "activations"}
# The rows compared. The tracker labels a gradient of a gathered weight "Temp" until its unit's post-backward: there,
# it is counted with the activations, so the two are compared together.
ROWS = {"parameters": ("parameters",), "gradients": ("gradients",), "optimizer state": ("optimizer",),
        "gathered weights, all-gather and reduce-scatter buffers": ("gathered",),
        "activations + unsharded gradients": ("activations", "unsharded"), "total": tuple(CATEGORIES)}


def build(config, strategy: str, mesh, dtype):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # real weights: the model is small
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.model.layers):
        if strategy == "fsdp2-ac":  # before fully_shard: the wrapper sits inside the unit that gathers its weights
            layer = model.model.layers[i] = checkpoint_wrapper(layer)
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: embeddings, final norm, lm_head
    return model


def measure(config, strategy: str, args, mesh) -> dict:
    """{category: bytes} at the tracked step's peak, on this rank."""
    model = build(config, strategy, mesh, getattr(torch, args.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.Generator().manual_seed(dist.get_rank())

    def step(tracker=None):
        ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1), generator=tokens)
        if tracker:
            tracker.track_inputs((ids,))
        optimizer.zero_grad()
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits.float()  # digits_lm.py's step: seq_len tokens in
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        del logits  # the output, with its bf16 logits, dropped as in digits_lm.py
        loss.backward()
        optimizer.step()

    step()  # warm-up: AdamW creates its state in its first step
    tracker = FSDPMemTracker(model, optimizer)
    with tracker:
        step(tracker)
    found = dict.fromkeys(CATEGORIES, 0)
    for label, size in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items():
        if label in TRACKED:  # not "Total"
            found[TRACKED[label]] += size
    return found


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default="fsdp2,fsdp2-ac", help="comma-separated (default: fsdp2,fsdp2-ac)")
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
    if set(strategies) - {"fsdp2", "fsdp2-ac"}:
        raise CourseError(f"--strategies {args.strategies}: only fsdp2 and fsdp2-ac are measured here")
    from transformers import LlamaConfig
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                         tie_word_embeddings=False)
    launch_env()  # torchrun's RANK, WORLD_SIZE, ...; a plain `python` run is a world of one
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shapes, buffers = count(config)
    rows = []
    for strategy in strategies:
        found = measure(config, strategy, args, mesh)
        moment, guess = peak(estimate(config, shapes, buffers, strategy, dist.get_world_size(), 1, args.batch_size,
                                      args.seq_len, args.dtype))
        rows.append({"strategy": strategy, "ranks": dist.get_world_size(), "moment": moment, "step": STEP,
                     "measured": found, "estimated": {c: int(guess[c]) for c in CATEGORIES}})
    if dist.get_rank() == 0:
        for row in rows:
            print(f"{row['strategy']} on {row['ranks']} rank(s), {args.layers} layers, hidden {args.hidden}, vocab "
                  f"{args.vocab}, batch {args.batch_size} x {args.seq_len}; estimated peak: {row['moment']}")
            print(f"{'bytes on rank 0':<56}{'measured':>14}{'estimated':>14}{'ratio':>8}")
            for label, keys in ROWS.items():
                m, e = (sum(row[k][c] for c in keys) for k in ("measured", "estimated"))
                print(f"{label:<56}{m:>14,}{e:>14,}{e / m if m else 1:>8.3f}")
        for row in rows:
            print(json.dumps(row))
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    run(main)
