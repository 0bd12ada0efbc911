"""The FSDP2 tools people use to fit a model, on lesson 05's own model: what each one saves, and what it costs.

    torchrun --standalone --nproc_per_node=2 05_multigpu_fsdp_training/fsdp_memory.py --blocks 8 --hidden 2048
    torchrun ... fsdp_memory.py --blocks 8 --hidden 2048 --checkpoint-activations      # add any tool flag below
    torchrun ... fsdp_memory.py --sweep "blocks=0,8,32;hidden=2048;tools=ddp,fsdp,checkpoint-activations"

The model is lesson 05's, sharded by unit as mnist_fsdpmodel.py shards it, but built on the meta device: no rank ever
holds the whole model (init_weights, from trainer/fsdp2.py, fills each rank's shards with what
`torch.manual_seed(seed); Net()` draws).
After --steps AdamW steps on random MNIST-shaped batches, every rank prints one JSON line: the bytes of parameters,
gradients and optimizer state it really holds, its peak GPU memory and its median seconds per step.
  --checkpoint-activations    keep only each block's INPUT, recompute its activations in backward: less memory, +1 forward
  --no-reshard-after-forward  keep gathered weights from forward to backward (ZeRO-2): one all-gather less, more memory
  --cpu-offload               shards, gradients and AdamW state in CPU memory, AdamW steps on the CPU (GPUs only)
  --prefetch                  each unit starts the next one's all-gather early: more overlap, one more unit in memory
  --ddp                       the same model under DistributedDataParallel, everything replicated: the comparison
--sweep: several configs in ONE launch. `key=v1,v2;key=...` is every combination (keys: width, blocks, hidden, batch_size,
steps, tools; a tools value joins flags with +, `fsdp` is none of them); `|` separates groups, run one after another.
"""
import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `common`, from any working directory

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from common.cli import Parser, count, positive_int
from common.distributed import init_timeout, launch_env, pick_device
from common.errors import CourseError
from common.exits import run
from common.files import work_in_course_folder
from common.model import Net, count_parameters, model_flags
from trainer.fsdp2 import init_weights

TOOLS = ("checkpoint-activations", "no-reshard-after-forward", "cpu-offload", "prefetch", "ddp")
SWEEP_KEYS = ("width", "blocks", "hidden", "batch_size", "steps")
CPU_NOTE = ("on CPU: no peak memory (torch.cuda.max_memory_allocated counts GPU memory only), and held MiB counts "
            "weights, gradients and AdamW state, not activations or gathered units: --checkpoint-activations, "
            "--no-reshard-after-forward and --prefetch change only s/step here; their memory shows on GPUs")


def build(args, device, mesh):
    """Lesson 05's model, sharded as the lesson shards it, plus the chosen tools (or under DDP with --ddp)."""
    if args.ddp:
        torch.manual_seed(args.seed)
        model = Net(**model_flags(args))  # real tensors: init_weights draws these very values for FSDP
    else:
        with torch.device("meta"):  # shapes only: no memory, no values
            model = Net(**model_flags(args))
    if args.checkpoint_activations:  # BEFORE fully_shard: the wrapper sits inside the unit that gathers its weights
        model.features = checkpoint_wrapper(model.features)  # the conv outputs, the largest activations at --width 8
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if args.ddp:
        return DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None,
                   gradient_as_bucket_view=True)  # as in lesson 04: the gradients ARE the all-reduce buckets
    options = {}
    if args.no_reshard_after_forward:  # a unit's full weights stay from its forward to its backward (ZeRO-2)
        options["reshard_after_forward"] = False
    if args.cpu_offload:  # sharded weights, gradients and AdamW state live in (pinned) CPU memory
        options["offload_policy"] = CPUOffloadPolicy()  # each all-gather starts with a host-to-device copy
    units = [model.features, model.fc1, *model.blocks, model.fc2]  # lesson 05's units, and each block
    for unit in [*units, model]:  # then the root
        fully_shard(unit, mesh=mesh, **options)
    if args.prefetch:  # the next unit's all-gather is issued while this unit computes
        for this, after in zip(units, units[1:]):
            this.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([this])  # backward runs the units in reverse
    model.to_empty(device="cpu" if args.cpu_offload else device)  # this rank's shards, where they will live
    init_weights(model, args)  # the values `torch.manual_seed(seed); Net()` draws (trainer/fsdp2.py)
    return model


def held_bytes(model, optimizer) -> dict:
    """What THIS rank really stores: of a DTensor its local shard (to_local), of a plain tensor all of it."""
    def size(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()
    params = list(model.parameters())
    sizes = {"param_bytes": sum(size(p) for p in params),
             "grad_bytes": sum(size(p.grad) for p in params if p.grad is not None),
             # AdamW: exp_avg and exp_avg_sq (sharded like the weights) and one 4-byte `step` per tensor (not sharded)
             "optim_bytes": sum(size(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))}
    return {**sizes, "held_bytes": sum(sizes.values())}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the GPU works asynchronously: wait for it, or the clock measures nothing


def train(args, model, device, rank):
    """--steps AdamW steps; returns (optimizer, mean loss of the last step over all ranks, median s/step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)  # lesson 05's --optimizer adamw
    batches = torch.Generator().manual_seed(1000 * args.seed + rank)  # per rank; the same for every tool
    torch.manual_seed(args.seed + rank)  # dropout masks, as in lesson 05
    profiler, times = None, []
    model.train()
    for step in range(args.steps):
        images = torch.randn(args.batch_size, 1, 28, 28, generator=batches).to(device)
        labels = torch.randint(0, 10, (args.batch_size,), generator=batches).to(device)
        if args.profile and step == max(0, args.steps - 3):  # the last 3 steps, after the one-off costs
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []))
            profiler.start()
        sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)  # here, not after step(): the last gradients stay to be counted
        loss = F.nll_loss(model(images), labels)
        loss.backward()  # FSDP: gradients reduce-scattered unit by unit; DDP: all-reduced bucket by bucket
        optimizer.step()  # on this rank's shards only (with --cpu-offload: on the CPU)
        sync(device)
        times.append(time.perf_counter() - start)
    if profiler:
        profiler.stop()
        if rank == 0:
            profiler.export_chrome_trace(args.profile)  # open it in ui.perfetto.dev (or chrome://tracing)
    loss = loss.detach().clone()
    dist.all_reduce(loss)  # a SUM (gloo's AVG is unreliable), then divided
    timed = times[1:len(times) - 3] if profiler else times[1:]  # not the first step, nor the profiled ones (slower)
    return optimizer, loss.item() / dist.get_world_size(), statistics.median(timed or times)


def measure(args, device, mesh, rank) -> dict:
    """One config: build, train, count; a CUDA out-of-memory error becomes the row's status."""
    tools = "+".join(t for t in TOOLS if getattr(args, t.replace("-", "_"))) or "fsdp"
    row = {"rank": rank, "world_size": mesh.size(), "group": args.group, "tools": tools,
           **{key: getattr(args, key) for key in SWEEP_KEYS}, "status": "ok"}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # each config its own peak
    try:
        model = build(args, device, mesh)
        row["parameters"] = count_parameters(model)  # a DTensor's numel is the full tensor's
        optimizer, row["loss"], row["s_per_step"] = train(args, model, device, rank)
        row.update(held_bytes(model, optimizer))
    except torch.OutOfMemoryError as exc:  # with several ranks, only if all of them run out (else the rest wait)
        row["status"] = ". ".join(str(exc).split(". ")[:2])  # "CUDA out of memory. Tried to allocate 16.00 MiB"
    row["peak_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    model = optimizer = None  # free everything before the next config
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def configs(args) -> list:
    """--sweep "blocks=0,8;hidden=2048|width=8;tools=fsdp,checkpoint-activations": every combination, group by group."""
    out = []
    for number, group in enumerate(args.sweep.split("|") if args.sweep else []):
        parts = [part.partition("=") for part in group.split(";") if part.strip()]
        keys = [key.strip().replace("-", "_") for key, _, _ in parts]
        if set(keys) - {*SWEEP_KEYS, "tools"}:
            raise CourseError(f"--sweep: unknown key(s) {sorted(set(keys) - {*SWEEP_KEYS, 'tools'})}: use "
                              f"{', '.join(SWEEP_KEYS)} or tools")
        for combo in itertools.product(*[[v.strip() for v in values.split(",")] for _, _, values in parts]):
            config = argparse.Namespace(**{**vars(args), "group": number,  # the row says which group it came from
                                           **{k: int(v) for k, v in zip(keys, combo) if k != "tools"}})
            for tools in (v.split("+") for k, v in zip(keys, combo) if k == "tools"):
                if set(tools) - {"fsdp", *TOOLS}:
                    raise CourseError(f"--sweep: unknown tool(s) {sorted(set(tools) - {'fsdp', *TOOLS})}")
                vars(config).update({t.replace("-", "_"): t in tools for t in TOOLS})
            out.append(config)
    return out or [argparse.Namespace(**vars(args), group=0)]


def check(args, device):
    if args.ddp and (args.no_reshard_after_forward or args.cpu_offload or args.prefetch):
        raise CourseError("--no-reshard-after-forward, --cpu-offload and --prefetch are FSDP tools: drop them with --ddp")
    # torch 2.14 on CPU: CPUOffloadPolicy() fails in fully_shard ("Found no NVIDIA driver": it pins host memory for
    # GPU copies); with pin_memory=False it runs, but the shards were in CPU memory already: nothing is offloaded.
    if args.cpu_offload and device.type != "cuda":
        raise CourseError("--cpu-offload moves shards from GPU memory to CPU memory: it needs GPUs (drop it on CPU)")


def table(rows) -> str:
    """Rank 0's summary of every rank's rows (zip: the same config on every rank): the largest rank's MiB."""
    lines = ["tools                                    width blocks hidden batch   params  held MiB/rank  peak MiB  s/step"]
    for same in zip(*rows):
        r, mib = same[0], lambda key: max(x.get(key) or 0 for x in same) / 2 ** 20
        bad = [x["status"] for x in same if x["status"] != "ok"]
        peak = f"{mib('peak_bytes'):>9,.0f}" if r["peak_bytes"] is not None else f"{'-':>9}"  # None: a CPU run
        lines.append(f"{r['tools']:<40} {r['width']:>5} {r['blocks']:>6} {r['hidden'] or '-':>6} {r['batch_size']:>5} "
                     f"{r.get('parameters', 0) / 1e6:>7.1f}M " + (bad[0] if bad else f"{mib('held_bytes'):>14,.1f} "
                     f"{peak} {r['s_per_step']:>7.4f}"))
    return "\n".join(lines)


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=positive_int, default=1, help="CNN channels x N: ACTIVATIONS grow (default: 1)")
    p.add_argument("--blocks", type=count, default=0, help="hidden-to-hidden blocks: PARAMETERS grow (default: 0)")
    p.add_argument("--hidden", type=positive_int, default=None, help="width of fc1 and the blocks (default: 128 x --width)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="images per rank per step (default: 64)")
    p.add_argument("--steps", type=positive_int, default=5,
                   help="AdamW steps; s/step is the median after the first (default: 5)")
    p.add_argument("--seed", type=count, default=1, help="random seed (default: 1)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="(default: auto)")
    for tool in TOOLS:
        p.add_argument(f"--{tool}", action="store_true", help=f"the {tool.replace('-', ' ')} tool (see the table above)")
    p.add_argument("--sweep", default=None, help='several configs in one launch, e.g. "blocks=0,8;hidden=2048"')
    p.add_argument("--profile", metavar="TRACE.json", help="trace the last 3 steps of the last config (rank 0 writes)")
    args = p.parse_args(argv)
    env = launch_env()  # torchrun's RANK, WORLD_SIZE, ...; a plain `python` run is a world of one
    device = pick_device(args.device, env)
    todo = configs(args)
    for i, config in enumerate(todo):
        check(config, device)
        config.profile = args.profile if i == len(todo) - 1 else None  # --profile: the last config only
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # the lesson's GPU switches: like for like with its timings
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    dist.init_process_group(backend=dist.get_default_backend_for_device(device), timeout=init_timeout(),
                            device_id=device if device.type == "cuda" else None)
    rank = dist.get_rank()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # 1-D: every rank holds 1/N, as in lesson 05
    rows = []
    for config in todo:
        rows.append(measure(config, device, mesh, rank))
        sys.stdout.write(json.dumps(rows[-1]) + "\n")  # one JSON line per rank and config, in ONE write: lines of
        sys.stdout.flush()  # several ranks sharing a log never interleave
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        print(table(everyone), flush=True)
        if device.type != "cuda":  # the tools' savings are GPU memory: say so, rather than print a 0 or no difference
            print(CPU_NOTE, flush=True)
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    run(main)
