"""The llm suites (`bench.py --suite llm` runs all four): lesson 08's model class, a LlamaForCausalLM sharded with
FSDP2 (benchmarks/llm.py), on this launch's GPUs. Each run is a row; a run past the launch's deadline is skipped.

  llm_speed   a bf16 torch.mm sweep (the achievable ceiling); then tokens/s per GPU and MFU of the 1.1 B and the
              hidden-4096 shapes at the batch that fills the GPU (will_it_fit.py), with and without per-layer compile
  llm_trace   what limits the step: the hidden-4096 shape from a plain start (eager, batch 2, foreach AdamW), one
              change at a time; the first and the last run traced (torch.profiler; benchmarks/llm_trace.py)
  llm_fp8     torchao float8 (tensorwise, rowwise) on llm_speed's compiled h4096 row; 200 steps of the loss against
              bf16's
  llm_fit     will_it_fit.py's verdict at the margin (benchmarks/llm_fit.py)

On a 4-GPU host (about 17 GPU minutes; --budget: no run starts after the launch's share of it), two calls of under
9 minutes, each two bench.py runs into one --out DIR, then `bench.py --report-only --merge DIR/benchmarks.json`:
    1.  --gpus 2 --suite llm_trace,llm_speed --budget 335;   then --gpus 1 --suite llm_speed --budget 190
    2.  --gpus 1 --suite llm_fit --budget 150;   then --gpus 4 --suite llm_speed,llm_fp8 --budget 400
        (torchao first: python3 -m pip install --no-deps wheels/torchao-*.whl, wheels/ carried)
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks import llm_fit, llm_trace
from benchmarks.llm import Setup, train
from common.distributed import init_timeout, launch_env, restart_safe_store

BEGAN = time.monotonic()  # imported as the launch starts (benchmarks/worker.py)
SHAPES = ("h4096", "1.1B")  # the target's shape first
SWEEP = (8192, 4096)  # torch.mm of bf16 n x n matrices, the best of 10
BASE_BATCH = 2
LOSS_STEPS, LOSS_BATCH = 200, 1
RECIPES = ("tensorwise", "rowwise")


def short(L) -> dict:
    return {"warmup": 1, "steps": 2} if L.quick else {}


def late(L, what: str) -> bool:
    """True (and one line) once the launch is past its deadline (bench.py's budget): the run is skipped. Every rank
    skips, or none (an all_reduce of the ranks' clocks: one rank alone in a run would wait for the others)."""
    deadline = L.spec.get("deadline_s")
    if deadline is None:
        return False
    past = torch.tensor([float(time.monotonic() - BEGAN >= deadline)], device=L.device)
    dist.all_reduce(past, op=dist.ReduceOp.MAX)  # collective: every rank of the launch's group
    if not past.item():
        return False
    if L.rank == 0:
        print(f"llm: {what} skipped: past the launch's deadline ({deadline:.0f} s)", flush=True)
    return True


@contextlib.contextmanager
def mesh_of(L, name: str):
    """Launch.group's process group, with $DIST_TIMEOUT_SECONDS (bench.py: 120 s): were one rank to run out of
    memory alone, the others' collective fails in 2 minutes, not NCCL's 10, and the launch ends."""
    os.environ["TORCHELASTIC_RESTART_COUNT"] = name  # its own key space of torchrun's store
    cuda = L.device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=restart_safe_store(launch_env()), rank=L.rank,
                            world_size=L.world, device_id=L.device if cuda else None, timeout=init_timeout())
    try:
        yield init_device_mesh(L.device.type, (L.world,))
    finally:
        dist.destroy_process_group()


def batch_and_estimate(L, shape: str) -> tuple[int, dict]:
    """The batch that fills this GPU (will_it_fit.py), and the estimate at that batch."""
    memory = torch.cuda.mem_get_info(L.device)[1] if L.device.type == "cuda" else None
    batch = llm_fit.fill_batch(shape, L.world, memory, L.quick)
    return batch, llm_fit.lines(shape, L.quick, "fsdp2", L.world, batch)


def sweep(L) -> None:
    if L.device.type != "cuda":
        return print("llm_speed: matmul sweep skipped (no GPU)", flush=True) if L.rank == 0 else None
    for n in SWEEP:
        a, b = (torch.randn(n, n, device=L.device, dtype=torch.bfloat16) for _ in range(2))
        times = []
        for i in range(13):  # 3 warm-up products, then 10 timed one by one
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.mm(a, b)
            end.record()
            end.synchronize()
            times += [start.elapsed_time(end) / 1e3] if i >= 3 else []
        L.emit("llm_speed", program="matmul", variant=f"{n}^3", n=n, tflops=2 * n ** 3 / min(times) / 1e12)
        del a, b


def speed(L) -> None:
    sweep(L)
    with mesh_of(L, "llm_speed") as mesh:
        for compiled in (True, False):  # compiled first: it holds less memory, and it is the targets' row
            for shape in SHAPES:
                batch, estimate = batch_and_estimate(L, shape)
                variant = "compile" if compiled else "eager"
                if late(L, f"llm_speed {shape} {variant}"):
                    return
                row = train(Setup(shape, batch, compile=compiled, loss_compile=compiled, reshard_last=False,
                                  **short(L)), L, mesh)
                L.emit("llm_speed", program=shape, variant=variant, **estimate, **row)


def changes(L) -> None:
    shape, cuda = SHAPES[0], L.device.type == "cuda"
    start = Setup(shape, 1 if L.quick else BASE_BATCH, fused=False, **short(L))
    fill = batch_and_estimate(L, shape)[0]
    steps = [("none", start)]
    for change, field in (("compile", {"compile": True}), ("batch", {"batch": max(fill, start.batch + 1)}),
                          ("reshard_after_forward=False on the last layer", {"reshard_last": False}),
                          ("compiled loss", {"loss_compile": True}), ("fused AdamW", {"fused": True})):
        steps.append((change, dataclasses.replace(steps[-1][1], **field)))
    if not cuda and L.rank == 0:
        print("llm_trace: traces skipped (no GPU kernels on the CPU)", flush=True)
    L.scratch.mkdir(parents=True, exist_ok=True)
    with mesh_of(L, "llm_trace") as mesh:
        for i, (change, setup) in enumerate(steps):
            if late(L, f"llm_trace {change}"):
                return
            path = L.scratch / f"llm_trace_{i}.json" if cuda and i in (0, len(steps) - 1) else None
            row = train(setup, L, mesh, trace=str(path) if path else None)
            if path and path.exists() and L.rank == 0:
                row.update(shares=llm_trace.shares(str(path), 2), busiest=llm_trace.busiest(str(path)))
            if path:
                path.unlink(missing_ok=True)  # tens of MB: the row keeps what it says
            L.emit("llm_trace", program=shape, variant=f"{i} {change}", change=change, order=i, **row)


def fp8_missing(L) -> str | None:
    if L.device.type != "cuda" or not any(name in L.gpu for name in ("H100", "H200")):
        return f"float8 training needs an H100 or H200, not {L.gpu}"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (python3 -m pip install --no-deps wheels/torchao-0.18.0-*.whl)"
    return None


def fp8(L) -> None:
    if why := fp8_missing(L):
        if L.rank == 0:
            print(f"llm_fp8: skipped: {why}", flush=True)
        return L.emit("llm_fp8", program="-", variant="skipped", outcome="skipped", error=why)
    shape = SHAPES[0]  # the target's shape: its Linears are 87% of its FLOPs
    with mesh_of(L, "llm_fp8") as mesh:
        batch, estimate = batch_and_estimate(L, shape)
        for recipe in RECIPES:  # llm_speed's compiled row, its Linears in float8
            if late(L, f"llm_fp8 {shape} {recipe}"):
                return
            row = train(Setup(shape, batch, compile=True, loss_compile=True, reshard_last=False, float8=recipe,
                              **short(L)), L, mesh)
            L.emit("llm_fp8", program=shape, variant=recipe, **estimate, **row)
        for recipe in (None,) + RECIPES:  # the same seed, model and data: the loss of 200 steps, eager
            if late(L, f"llm_fp8 loss {recipe or 'bf16'}"):
                return
            row = train(Setup(shape, LOSS_BATCH, reshard_last=False, float8=recipe, warmup=0, steps=LOSS_STEPS),
                        L, mesh)
            L.emit("llm_fp8", program=shape, variant=f"loss {recipe or 'bf16'}", **row)


def fit(L) -> None:
    with mesh_of(L, "llm_fit") as mesh:
        llm_fit.fit(L, mesh)


SUITES = {"llm_speed": speed, "llm_trace": changes, "llm_fp8": fp8, "llm_fit": fit}
