"""Inside ONE launch (one process per GPU): the suites bench.py gives it, in-process; rank 0 appends the rows.

    torchrun --standalone --nproc_per_node=N benchmarks/worker.py SPEC.json      (bench.py writes SPEC.json)

A process start (Python, torch, CUDA, NCCL, the data) costs 10-15 s; a lesson run 1-5 s. So every run of one
GPU count shares one launch: each lesson run is the lesson's own main(argv), as `torchrun lesson.py ...` would
run it, in its own key space of torchrun's store (TORCHELASTIC_RESTART_COUNT, read by restart_safe_store).
The plain loop, the overlap picture and the FSDP2 tools run in the same processes, one after the other.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's engine (overlap suite) prints start/stop lines
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import overlap, plain_loop  # noqa: E402
from benchmarks.tables import summary  # noqa: E402
from common.data import load_mnist  # noqa: E402
from common.distributed import launch_env, restart_safe_store  # noqa: E402
from common.model import Net, count_parameters  # noqa: E402

LESSONS = {"02": "02_singlegpu_training/mnist_singlegpu.py", "03": "03_dp_training/mnist_dpmodel.py",
           "04": "04_ddp_training/mnist_ddpmodel.py", "05": "05_multigpu_fsdp_training/mnist_fsdpmodel.py",
           "tools": "05_multigpu_fsdp_training/fsdp_memory.py"}
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
# --quick: the same code on the CPU in seconds (gloo, synthetic digits); its numbers are no result.
QUICK = {"--batch-size": "16", "--epochs": "1", "--max-steps": "4", "--warmup-steps": "4", "--blocks": "1",
         "--hidden": "64"}
QUICK_DATA = ["--train-samples", "256", "--test-samples", "64", "--num-workers", "0"]
QUICK_TOOLS = ("blocks=4;batch_size=16;hidden=64;steps=2;tools=ddp,fsdp|blocks=4;hidden=128;batch_size=16;steps=2;"
               "tools=ddp,fsdp,checkpoint-activations,no-reshard-after-forward,prefetch|width=2;batch_size=16;steps=2;"
               "tools=checkpoint-activations")
# Lesson 06 on GPUs: TPNet's parameter-heavy head (4 blocks of 4 x 4096 wide: 575 M parameters), 64 images per
# data-parallel rank; DDP, FSDP2, TP and (4+ GPUs) 2-D one after the other (06_tensor_parallel/tp_gpu_bench.py).
TP = {"blocks": 4, "hidden": 4096, "batch_size": 64, "warmup": 5, "steps": 20, "profiled_steps": 5, "seed": 1}
QUICK_TP = {"blocks": 1, "hidden": 64, "batch_size": 8, "warmup": 1, "steps": 2, "profiled_steps": 1, "seed": 1}


class Launch:
    """This process's rank and device, the spec, and the rows rank 0 writes."""

    def __init__(self, spec: dict):
        self.spec, self.quick, env = spec, spec["quick"], launch_env()
        self.rank, self.world = env.rank, env.world_size
        self.device = torch.device("cpu") if self.quick else torch.device("cuda", env.local_rank)
        self.scratch = Path(spec["scratch"]) / f"rank{self.rank}"
        self.gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cudnn.benchmark = True  # as the lessons do: fixed shapes, fastest convolutions
            torch.backends.cuda.matmul.fp32_precision = "tf32"

    def emit(self, suite: str, **row) -> None:
        if self.rank == 0:  # one line per row, appended at once: a killed launch keeps what it measured
            with open(self.spec["rows"], "a") as f:
                f.write(json.dumps({"suite": suite, "gpus": self.world, "device_name": self.gpu, **row}) + "\n")

    def sized(self, flags: list) -> list:
        """The flags as given; with --quick, CPU-sized values and a few hundred images."""
        if not self.quick:
            return [str(f) for f in flags]
        out = [str(f) for f in flags]
        for i in range(len(out) - 1):
            out[i + 1] = QUICK.get(out[i], out[i + 1])
        return out + QUICK_DATA

    def fresh(self, key: str) -> list:
        """Before a run: its own store key space, the last run's memory freed, a new peak; its common flags."""
        os.environ["TORCHELASTIC_RESTART_COUNT"] = key
        gc.collect()
        if self.device.type == "cuda":  # the lessons read max_memory_allocated: one peak per run, not per process
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        return ["--data", self.spec["data"], "--data-dir", self.spec["data_dir"], "--device", self.device.type,
                "--output-dir", str(self.scratch / key)]

    def lesson(self, number: str, flags: list, key: str) -> tuple[dict, str]:
        """lesson.main(argv) in a fresh output folder and store key space: (its metrics record, what it printed)."""
        out, argv = self.scratch / key, self.fresh(key) + self.sized(flags)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            record = module(number).main(argv)
        shutil.rmtree(out, ignore_errors=True)  # checkpoints: GBs for the big models, and never read again
        return record, printed.getvalue()

    @contextlib.contextmanager
    def group(self, name: str):
        """A process group of this launch's ranks, in its own key space of torchrun's store."""
        os.environ["TORCHELASTIC_RESTART_COUNT"] = name
        cuda = self.device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", store=restart_safe_store(launch_env()), rank=self.rank,
                                world_size=self.world, device_id=self.device if cuda else None)
        try:
            yield
        finally:
            dist.destroy_process_group()


def module(number: str):
    """A lesson script as a module (cached): importing it runs nothing, its main() waits for __main__."""
    name = f"lesson_{number}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / LESSONS[number])
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def epochs(record: dict, batch: int, world: int) -> dict:
    """What a row keeps of a lesson's metrics record."""
    e, images = record["epochs"], record["args"].get("train_samples") or 60_000
    seconds, accuracy = [x["epoch_seconds"] for x in e], [x["test_accuracy"] for x in e]
    return {"epoch_seconds": seconds, "accuracy": accuracy, **summary(seconds, accuracy),
            "images_per_second": statistics.median(x["train_images_per_second"] for x in e),
            "warmup_s": record["warmup_seconds"],
            "peak_bytes": record["peak_memory_bytes"], "steps_per_epoch": -(-images // world // batch),
            "train_loss": e[-1]["train_loss"]}


def throughput(L: Launch) -> None:
    programs = ["02", "04", "05"] if L.world == 1 else ["04", "05"]  # lesson 02 is the one-GPU program
    for program in programs:
        for path, flags in THROUGHPUT.items():
            if program == "05" and path == "dataloader":
                continue  # lesson 05 is about memory: its DataLoader path adds nothing to 04's
            record, _ = L.lesson(program, flags, f"throughput-{program}-{path}")
            batch = record["args"]["batch_size"]
            L.emit("throughput", program=program, variant=path, batch=batch, **epochs(record, batch, L.world))


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


SUITES = {"throughput": throughput, "scaling": scaling, "recipe": recipe, "plain": plain, "dp": dp, "tools": tools,
          "overlap": ddp_overlap, "fsdp_oom": fsdp_oom,
          "tp": tp}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    L = Launch(spec)
    if spec.get("cap_gib") and L.device.type == "cuda":  # a smaller card: this process may use cap_gib GiB
        total = torch.cuda.get_device_properties(L.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_gib"] * 2**30 / total), L.device)
    for suite in spec["suites"]:
        if suite == "plain" and "recipe" in spec["suites"]:
            continue  # run by recipe(), seed by seed
        began = time.perf_counter()
        SUITES[suite](L)
        if L.rank == 0:  # what --plan's estimates are checked against
            print(f"[worker {L.world} x {L.gpu}] {suite}: {time.perf_counter() - began:.1f} s", flush=True)
    if dist.is_initialized():  # left by lesson 04's out-of-memory stop
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
