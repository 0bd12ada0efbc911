"""The suites a launch runs in-process, one function each (benchmarks/worker.py calls them by name), and their flags.

Each takes the launch's Launch (benchmarks/launch.py): lesson runs are the lessons' own main(argv); the plain loop,
the peer (benchmarks/peer_ddp.py), the overlap picture, the FSDP2 tools and lesson 06 run in the same processes.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import llm_suites, overlap, plain_loop
from benchmarks.launch import QUICK, QUICK_DATA, ROOT, Launch, epochs, module
from benchmarks.tables import summary
from common.data import load_mnist
from common.download import dataset_root
from common.model import Net, count_parameters

SEEDS = (1, 2, 3, 4, 5)
# Time to 99%: data on the GPUs, AdamW + OneCycle, 6 epochs; (batch per GPU, lr) by GPU count. On 2 GPUs x 512
# at lr 1e-2, 5 epochs ended at a mean 99.08-99.12% over three runs, 6 at 99.19% (2x H100, 2026-11-27); on 4 GPUs
# x 512 no seed reached 99% (c3cd817), x 256 did.
RECIPE_EPOCHS = 6
RECIPE = ["--data-on-device", "--optimizer", "adamw", "--schedule", "onecycle", "--epochs", RECIPE_EPOCHS,
          "--num-workers", "0"]
RECIPE_BATCH_LR = {1: (512, 6e-3), 2: (512, 1e-2)}
RECIPE_MANY_GPUS = (256, 1e-2)
# 3 epochs, the median one reported: the first also starts the DataLoader's workers.
THROUGHPUT = {"dataloader": ["--batch-size", "64", "--epochs", "3"],
              "on-device": ["--data-on-device", "--batch-size", "512", "--epochs", "3", "--num-workers", "0"]}
# The peer (benchmarks/peer_ddp.py): pytorch/examples' batch 64 per GPU, 8 DataLoader workers, the median epoch of 3.
PEER = {"epochs": 3, "batch": 64, "num_workers": 8}
QUICK_PEER = {"epochs": 1, "batch": int(QUICK["--batch-size"]), "num_workers": 0, "samples": int(QUICK_DATA[1])}
# Large batches: the classic Adadelta at a FIXED 512 per GPU; linear lr scaling needs its warm-up.
SCALING = {"lr-none": ["--lr-scaling", "none"], "lr-linear": ["--lr-scaling", "linear", "--warmup-steps", "100"]}
SCALING_FLAGS = ["--data-on-device", "--batch-size", "512", "--epochs", "6", "--num-workers", "0"]
# FSDP2 out of memory: DDP holds 16 B per parameter (weights, gradients, AdamW) on EVERY GPU: 434 M parameters
# (--blocks 10 --hidden 6144) need 6.5 GiB, over a 6 GiB cap; FSDP2 holds 1/N of it plus two gathered units.
OOM = {"cap_gib": 6.0, "flags": ["--blocks", "10", "--hidden", "6144", "--optimizer", "adamw", "--lr", "1e-4",
                                 "--epochs", "1", "--max-steps", "30", "--data-on-device", "--num-workers", "0"]}
# The FSDP2 tools (fsdp_memory.py --sweep): FSDP2 against DDP as the model grows; every tool at the OOM model's
# size; activation checkpointing where activations dominate (--width 8).
TOOLS = ("blocks=4;batch_size=512;hidden=512,2048,8192,16384;steps=12;tools=ddp,fsdp|blocks=10;hidden=6144;"
         "batch_size=512;steps=8;tools=ddp,fsdp,checkpoint-activations,no-reshard-after-forward,prefetch,cpu-offload|"
         "width=8;batch_size=512;steps=8;tools=fsdp,checkpoint-activations")
QUICK_TOOLS = ("blocks=4;batch_size=16;hidden=64;steps=2;tools=ddp,fsdp|blocks=4;hidden=128;batch_size=16;steps=2;"
               "tools=ddp,fsdp,checkpoint-activations,no-reshard-after-forward,prefetch|width=2;batch_size=16;steps=2;"
               "tools=checkpoint-activations")
# Lesson 06 on GPUs: TPNet's parameter-heavy head (4 blocks of 4 x 4096 wide: 575 M parameters), 64 images per
# data-parallel rank; DDP, FSDP2, TP and (4+ GPUs) 2-D one after the other (06_tensor_parallel/tp_gpu_bench.py).
TP = {"blocks": 4, "hidden": 4096, "batch_size": 64, "warmup": 5, "steps": 20, "profiled_steps": 5, "seed": 1}
QUICK_TP = {"blocks": 1, "hidden": 64, "batch_size": 8, "warmup": 1, "steps": 2, "profiled_steps": 1, "seed": 1}
# Lesson 07 on GPUs (07_pipeline_parallel/pp_gpu_bench.py): PP (1F1B, 8 micro-batches of 128) against DDP, FSDP2 and
# TP on the tp suite's TPNet, one GLOBAL batch of 1,024 images for all four; over NCCL's sockets (launch pp-socket-2)
# FSDP2 and PP only, FSDP2 moving ~3.5 GB a step at ~3 GB/s: fewer steps. Then the bubble of each schedule
# (bubble.py) on lesson 07's Net, 8,192 images a step: a micro-batch of 1,024-2,048 images computes for milliseconds
# per stage, long against the schedule's own overhead. zb last: a failure inside its step could stop the launch
# (pp_gpu_bench.attempt), after every other row is written.
PP = {**TP, "batch_size": 1024, "warmup": 3, "steps": 10, "profiled_steps": 1, "schedule": "1f1b", "microbatches": 8}
PP_SOCKETS = {"warmup": 2, "steps": 3}
QUICK_PP = {**QUICK_TP, "blocks": 2, "batch_size": 16, "schedule": "1f1b", "microbatches": 4}
BUBBLE = {"steps": 3, "blocks": 16, "hidden": 4096, "batch": 8192}
BUBBLE_RUNS = (("gpipe", 4), ("gpipe", 8), ("1f1b", 4), ("1f1b", 8), ("interleaved", 8), ("zb", 8))
QUICK_BUBBLE = {"steps": 2, "blocks": 4, "hidden": 32, "batch": 16}
QUICK_BUBBLE_RUNS = (("gpipe", 4), ("1f1b", 4), ("interleaved", 4), ("zb", 4))


def throughput(L: Launch) -> None:
    programs = ["02", "04", "05"] if L.world == 1 else ["04", "05"]  # lesson 02 is the one-GPU program
    for program in programs:
        for path, flags in THROUGHPUT.items():
            if program == "05" and path == "dataloader":
                continue  # lesson 05 is about memory: its DataLoader path adds nothing to 04's
            record, _ = L.lesson(program, flags, f"throughput-{program}-{path}")
            batch = record["args"]["batch_size"]
            L.emit("throughput", program=program, variant=path, batch=batch, **epochs(record, batch, L.world))


def peer(L: Launch) -> None:
    """The hand-written DataLoader + DDP loop, in the launch of lesson 04's DataLoader throughput run: one run."""
    from benchmarks import peer_ddp  # torchvision: imported by the launches that run the peer only (seconds on a CPU)
    settings = QUICK_PEER if L.quick else PEER
    with L.group("peer"):
        run = peer_ddp.train(str(dataset_root(L.spec["data_dir"], L.spec["data"])), L.device, **settings)
    L.emit("peer", program="peer", variant="dataloader", batch=settings["batch"], num_workers=settings["num_workers"],
           **run)


def recipe_flags(world: int) -> tuple[int, float, list]:
    batch, lr = RECIPE_BATCH_LR.get(world, RECIPE_MANY_GPUS)
    return batch, lr, RECIPE + ["--batch-size", batch, "--lr", lr]


def recipe(L: Launch) -> None:
    """Lesson 04's recipe, seed by seed; with the plain suite, each seed's plain run right after it: drifts of the
    machine's speed (clocks, neighbours) then reach both sides of the ratio alike."""
    batch, lr, flags = recipe_flags(L.world)
    ran = int(QUICK["--batch-size"]) if L.quick else batch  # the batch as run (--quick shrinks it)
    for seed in SEEDS[:1] if L.quick else SEEDS:
        record, _ = L.lesson("04", flags + ["--seed", seed], f"recipe-{seed}")
        L.emit("recipe", program="04", variant=f"{ran}x{lr:g}", seed=seed, batch=ran, lr=lr,
               flags=" ".join(map(str, flags)), **epochs(record, ran, L.world))
        if "plain" in L.spec["suites"]:
            plain(L, [seed])


def plain(L: Launch, seeds=None) -> None:
    batch, lr, _ = recipe_flags(L.world)
    batch = int(QUICK["--batch-size"]) if L.quick else batch  # what lesson 04 ran with, --quick too
    samples = (int(QUICK_DATA[1]), int(QUICK_DATA[3])) if L.quick else (None, None)
    if not hasattr(L, "plain_data"):  # once per launch: 60,000 images through the Dataset, then on the GPU
        L.plain_data = plain_loop.tensors(L.spec["data_dir"], L.spec["data"], L.device, *samples)
    for seed in seeds or (SEEDS[:1] if L.quick else SEEDS):
        with L.group(f"plain-{seed}"):
            plain_loop.warm_up(L.plain_data, L.device, L.world, batch)
            run = plain_loop.train(seed, L.plain_data, L.device, batch, lr,
                                   int(QUICK["--epochs"]) if L.quick else RECIPE_EPOCHS)
        L.emit("plain", program="plain", variant=f"{batch}x{lr:g}", seed=seed, batch=batch, lr=lr, **run,
               **summary(run["epoch_seconds"], run["accuracy"]))


def scaling(L: Launch) -> None:
    for name, extra in SCALING.items():
        if L.world == 1 and name == "lr-linear":
            continue  # linear scaling on one GPU is no scaling
        record, _ = L.lesson("04", SCALING_FLAGS + extra, f"scaling-{name}")
        L.emit("scaling", program="04", variant=name, batch=record["args"]["batch_size"],
               **epochs(record, record["args"]["batch_size"], L.world))


def dp(L: Launch) -> None:
    """Lesson 03: ONE process drives every visible GPU (64 images each); 100 steps are enough for images/s."""
    gpus = max(torch.cuda.device_count(), 1) if L.device.type == "cuda" else 1
    record, printed = L.lesson("03", ["--batch-size", 64 * gpus, "--epochs", 1, "--max-steps", 100], "dp")
    paths = [line.strip() for line in printed.splitlines() if "GPU 0 <-> GPU" in line]
    L.emit("dp", program="03", variant="dataloader", gpus=gpus, batch=64, gpu_paths=paths,
           **epochs(record, 64 * gpus, 1))


def tools(L: Launch) -> None:
    """fsdp_memory.py's sweep: every rank's bytes; rank 0 keeps the largest rank's bytes and the slowest time."""
    with contextlib.redirect_stdout(io.StringIO()):
        rows = module("tools").main(["--sweep", QUICK_TOOLS if L.quick else TOOLS, "--device", L.device.type])
    everyone = [None] * L.world
    with L.group("tools-gather"):
        dist.all_gather_object(everyone, rows)
    for same in zip(*everyone):
        worst = {k: max(r.get(k) or 0 for r in same) or None for k in ("held_bytes", "peak_bytes", "s_per_step")}
        bad = [r["status"] for r in same if r["status"] != "ok"]
        L.emit("tools", **{**{k: v for k, v in same[0].items() if k != "rank"}, **worst, "program": "fsdp_memory",
                           "status": bad[0] if bad else "ok"})


def fsdp_oom(L: Launch) -> None:
    """Under the cap: lesson 05 (FSDP2) trains the model, then lesson 04 (DDP) runs out of memory on it."""
    from common.exits import run
    flags = L.sized(OOM["flags"])
    size = dict(zip(flags, flags[1:]))
    with torch.device("meta"):  # shapes only: the count costs no memory
        params = count_parameters(Net(1, int(size["--blocks"]), int(size["--hidden"])))
    for program in ("05", "04"):  # DDP last: an out-of-memory error leaves the process's CUDA state behind
        stderr, record = io.StringIO(), {}
        if L.quick and program == "04":  # no cap on a CPU: the first AdamW step fails as a capped GPU would
            torch.optim.AdamW.step = simulated_oom
        argv = L.fresh(f"oom-{program}") + flags
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()), snapshot(L, program):
            try:
                run(lambda a: record.update(module(program).main(a) or {}), argv)
            except SystemExit:  # run() printed the one-line error (rank 0) and exited: the row says why
                pass
        error = next((ln for ln in stderr.getvalue().splitlines() if ln.startswith("error: ")), None)
        row = epochs(record, record["args"]["batch_size"], L.world) if record else {}
        if record:  # --max-steps ends the epoch early: its seconds are those steps'
            row["s_per_step"] = row["epoch_seconds"][0] / min(row["steps_per_epoch"], int(size["--max-steps"]))
        L.emit("fsdp_oom", program=program, variant="capped", cap_gib=None if L.quick else OOM["cap_gib"],
               parameters=params, status="ok" if record else "out of memory" if error and "out of memory" in error
               else "failed", error=error, **row)
        shutil.rmtree(L.scratch / f"oom-{program}", ignore_errors=True)


@contextlib.contextmanager
def snapshot(L: Launch, program: str):
    """On GPUs: every allocation and free of the run, with its Python stack, dumped by rank 0 as
    OUT/memory_PROGRAM.pickle (drag it onto https://pytorch.org/memory_viz); memory.py draws it by category."""
    if L.device.type != "cuda":
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        yield
    finally:
        if L.rank == 0:
            torch.cuda.memory._dump_snapshot(str(Path(L.spec["out"]) / f"memory_{program}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)


def simulated_oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (SIMULATED by --quick: no GPU)")


def ddp_overlap(L: Launch) -> None:
    traces, buckets = Path(L.spec["out"]) / "overlap", {}
    traces.mkdir(parents=True, exist_ok=True)
    with L.group("overlap"):
        for variant in overlap.VARIANTS:
            buckets[variant] = overlap.profile_step(variant, L.device, 16 if L.quick else 512,
                                                    str(traces / f"trace_{variant}_rank{L.rank}.json"))
    if L.rank == 0:
        results = {v: (info := overlap.lanes(str(traces / f"trace_{v}_rank0.json")), overlap.numbers(info))
                   for v in overlap.VARIANTS}
        for v, (_, n) in results.items():
            L.emit("overlap", program="ddp", variant=v, buckets=buckets[v], batch=16 if L.quick else 512, **n)
        overlap.draw(results, Path(L.spec["out"]) / "ddp_overlap.png", f"{L.world} x {L.gpu}, batch 512 per GPU")


def tp(L: Launch) -> None:
    """Lesson 06: s/step, peak memory and communication of DDP, FSDP2, TP and (4+ GPUs) 2-D on one TPNet."""
    sys.path.insert(0, str(ROOT / "06_tensor_parallel"))
    import tp_gpu_bench
    args = argparse.Namespace(**(QUICK_TP if L.quick else TP))
    needed = (args.warmup + args.steps + args.profiled_steps) * args.batch_size * L.world
    train = load_mnist(L.spec["data_dir"], L.spec["data"], needed, 100, seed=args.seed, download=False)[0]
    with L.group("tp"):
        busbw = tp_gpu_bench.bus_bandwidth(L.device, L.world, 2**20 if L.quick else 64 * 2**20)
        for strategy in tp_gpu_bench.strategies(L.world):
            row = tp_gpu_bench.measure(strategy, args, L.device, L.world, train, busbw)
            L.emit("tp", program="06", variant=strategy, blocks=args.blocks, hidden=args.hidden,
                   batch=args.batch_size, busbw=busbw, parameters=tp_gpu_bench.parameters(args), **row)


def pp(L: Launch) -> None:
    """Lesson 07: PP against DDP, FSDP2 and TP on one model and global batch, at this launch's NCCL transport (the
    spec's env); at the default one, the bubble of each schedule too."""
    sys.path.insert(0, str(ROOT / "07_pipeline_parallel"))
    import bubble
    import pp_gpu_bench
    env = L.spec.get("env") or {}
    args = argparse.Namespace(**(QUICK_PP if L.quick else {**PP, **(PP_SOCKETS if env else {})}))
    needed = (args.warmup + args.steps + args.profiled_steps) * args.batch_size
    train = load_mnist(L.spec["data_dir"], L.spec["data"], needed, 100, seed=args.seed, download=False)[0]
    transport = "sockets" if env else "default"  # the env itself goes in the row
    size = {"blocks": args.blocks, "hidden": args.hidden, "parameters": pp_gpu_bench.tp_gpu_bench.parameters(args)}
    with L.group("pp"):
        busbw = pp_gpu_bench.tp_gpu_bench.bus_bandwidth(L.device, L.world, 2**20 if L.quick else 64 * 2**20)
        for strategy in ("fsdp2", "pp") if env else ("ddp", "fsdp2", "tp", "pp"):
            row = pp_gpu_bench.attempt(partial(pp_gpu_bench.compare, strategy, args, L.device, L.world, train, busbw),
                                       strategy=strategy)
            L.emit("pp", program="compare", variant=f"{strategy} {transport}", transport=transport,
                   nccl_env=" ".join(f"{k}={v}" for k, v in env.items()), **size,
                   batch=args.batch_size, warmup=args.warmup, steps=args.steps, busbw=busbw, **row)
        settings = QUICK_BUBBLE if L.quick else BUBBLE
        for schedule, microbatches in () if env else QUICK_BUBBLE_RUNS if L.quick else BUBBLE_RUNS:
            row = pp_gpu_bench.attempt(partial(bubble.measure, schedule, microbatches, L.device, **settings),
                                       schedule=schedule, microbatches=microbatches, pp=L.world)
            L.emit("pp", program="bubble", variant=f"{schedule} m{microbatches}", **settings, **row)


SUITES = {"throughput": throughput, "peer": peer, "scaling": scaling, "recipe": recipe, "plain": plain, "dp": dp,
          "tools": tools, "overlap": ddp_overlap, "fsdp_oom": fsdp_oom, "tp": tp, "pp": pp, **llm_suites.SUITES}


