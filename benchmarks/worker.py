"""Inside ONE launch (one process per GPU): the suites bench.py gives it, in-process; rank 0 appends the rows.

    torchrun --standalone --nproc_per_node=N benchmarks/worker.py SPEC.json      (bench.py writes SPEC.json)

A process start (Python, torch, CUDA, NCCL, the data) costs 10-15 s; a lesson run 1-5 s. So every run of one
GPU count shares one launch: each lesson run is the lesson's own main(argv), as `torchrun lesson.py ...` would
run it, in its own key space of torchrun's store (TORCHELASTIC_RESTART_COUNT, read by restart_safe_store).
The plain loop, the peer, the overlap picture and the FSDP2 tools run in the same processes, one after the other.
The suites are benchmarks/suites.py's; this process's rank, device and rows, benchmarks/launch.py's Launch.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's engine (overlap suite) prints start/stop lines
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.launch import Launch  # noqa: E402
from benchmarks.suites import SUITES  # noqa: E402


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
