"""Every benchmark of the course, one runner: measure on 1..N GPUs, then write docs/benchmarks.md, .json and plots.

    python benchmarks/bench.py --plan                         # the launches, their suites and estimated seconds
    python benchmarks/bench.py --data-dir DIR --reference REF  # all; on 4 H100s at a2e8514 (1, 2 and 4 GPUs) it took
                                                               # three --suite calls of 6.2, 6.8 and 3.0 min (each
                                                               # under a 10-minute limit), then --report-only --merge
    python benchmarks/bench.py --suite recipe,plain --budget 300
    python benchmarks/bench.py --report-only --merge A.json B.json   # the page again, from rows measured elsewhere
    python benchmarks/bench.py --quick                         # CPU smoke mode (gloo, synthetic, tiny): the tests

The runs of lessons 02-05 are the production trainer's (trainer/single.py ... fsdp2.py, the lessons' code with
metrics.json, warm-up and --max-steps; benchmarks/launch.py).
Suites: throughput (lessons 02/04/05 img/s), peer (a hand-written DataLoader + DDP loop, torch and torchvision only,
in the throughput suite's launch: lesson 04's scaling against the peer's), scaling (large batches), recipe (lesson
04, seeds 1-5, time to 99%), plain (the plain loop, same seeds and GPUs, each seed's run right after lesson 04's: a
round of the ratio), dp (lesson 03), tools (the FSDP2 tools, 2 GPUs), overlap (DDP's all_reduce against backward, 2
GPUs), fsdp_oom (DDP out of memory where FSDP2 trains, 2 capped GPUs, with a memory snapshot of each), tp (lesson
06: DDP, FSDP2, TP and on 4+ GPUs 2-D, 2+ GPUs), pp (lesson 07: the bubble per schedule, and PP against DDP, FSDP2
and TP on one model and batch, 2+ GPUs; PP and FSDP2 again over NCCL's sockets, 2 GPUs), bandwidth (all_reduce per
NCCL transport), parity (lesson 02 against --reference, a pytorch/examples mnist/main.py). Lesson 08's model class,
not part of "all" (`--suite llm` names all four; benchmarks/llm_suites.py): llm_speed (every GPU count), llm_trace
(the first count above one), llm_fp8 (every count above one), llm_fit (the smallest count, a launch of its own). For
the GPU calls of the llm suites, see benchmarks/llm_suites.py. One launch per GPU count runs that count's suites
in-process (benchmarks/worker.py; how each kind of launch runs: benchmarks/runners.py); rows are merged into
OUT/benchmarks.json after every launch, keyed by measurement, so a killed run keeps what it measured.
"""
from __future__ import annotations

import argparse
import datetime
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import report  # noqa: E402
from benchmarks.runners import RUNNERS  # noqa: E402

SUITES = ("throughput", "peer", "scaling", "recipe", "plain", "dp", "tools", "overlap", "fsdp_oom", "tp", "pp",
          "bandwidth", "parity")
# Lesson 08's model class: not in "all"; "llm" names the four. Their seconds are guesses until measured: a start with
# transformers 25 s, a decoder layer's first compile 50 s (10 s from Inductor's cache), a step 0.1-0.5 s.
LLM = ("llm_trace", "llm_speed", "llm_fp8", "llm_fit")  # a launch's order
LLM_START_S = 25
# The speed runs' allocator, as torchtitan's: less fragmentation, so the batch will_it_fit.py fills leaves room for
# eager's temporaries too. llm_fit's launch keeps the default one, whose reserved share the estimate allows for.
LLM_ALLOCATOR = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
START_S = 15  # a launch: Python, torch, CUDA and NCCL, the data (2x H100, c3cd817)
# NCCL over its sockets only (troubleshooting/nccl_transports.sh: ~3 GB/s against ~300 GB/s peer to peer on 2x H100):
# a stand-in for a slow link between nodes. NCCL reads it when a process starts: the pp suite's launch of its own.
SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
PP_SOCKETS_S = 20  # a guess until measured: FSDP2's 6 steps at ~1.3 s, PP's at milliseconds, two builds


def estimate(suite: str, n: int) -> float:
    """GPU seconds of one suite on n GPUs, from the c3cd817 runs on 2x H100 (real MNIST)."""
    loader, device = 3.5 / n ** 0.8, 0.35 / n ** 0.8  # lesson 04's s/epoch: DataLoader batch 64, on-device 512
    run = 3.0  # a lesson run's warm-up, tests and checkpoints
    return {"throughput": (2 * run + 3 * 3.2 + 3 * 0.31 if n == 1 else 0) + 2 * run + 3 * loader + 3 * device
            + run + 3 * 1.3 / n ** 0.6,
            "peer": 2 + 3 * (loader + 0.5),  # a guess until measured: its 8 workers start every epoch
            "scaling": (1 if n == 1 else 2) * (run + 6 * device), "recipe": 5 * (run + 6 * device),
            "plain": 3 + 5 * (1 + 6 * 0.8 * device), "dp": 15, "tools": 60, "overlap": 10,
            "fsdp_oom": START_S + 35, "tp": 20, "bandwidth": 3 * 12,  # 868b4f0, 2x H100: 60, 42, 32, 33 s
            "pp": 40,  # a guess until measured: lesson 06's four builds (tp: 20 s for three), six bubble runs
            "parity": 150,  # the reference's single-worker DataLoader: 117 s (868b4f0) to 167 s (d0e260e)
            "llm_speed": 160, "llm_trace": 145, "llm_fp8": 215, "llm_fit": 100}[suite]


def plan(suites, gpus: list[int], reference: str | None) -> list[dict]:
    """The launches: one worker launch per GPU count, the capped one, the bandwidth runs and the parity runs."""
    out, pair = [], 2 in gpus
    for n in gpus:
        # Time to 99% and the plain loop first and side by side (one ratio, one run); lesson 03 last: it turns
        # cuDNN's autotuning off for the rest of the process.
        here = [s for s in ("recipe", "plain", "throughput", "peer", "scaling") if s in suites]
        here += ["dp"] if n == 1 and "dp" in suites else []  # one process drives every visible GPU
        here += [s for s in ("tools", "overlap") if s in suites and n == 2]
        if here:  # lesson 03 drives every GPU its process sees: worker-1 sees two when there are two
            out.append({"name": f"worker-{n}", "kind": "worker", "gpus": n, "suites": here,
                        "visible": 2 if "dp" in here and pair else n,
                        "seconds": START_S + sum(estimate(s, n) for s in here)})
    # Lesson 06 in a process of its own: run after the other suites in one process, its FSDP2 step crashed
    # (SIGSEGV, torch 2.11, 2x H100); in a fresh process, as a learner runs it, it did not (d0e260e).
    out += [{"name": f"tp-{n}", "kind": "worker", "gpus": n, "visible": n, "suites": ["tp"],
             "seconds": START_S + estimate("tp", n)} for n in gpus if n > 1 and "tp" in suites]
    out += [{"name": f"pp-{n}", "kind": "worker", "gpus": n, "visible": n, "suites": ["pp"],
             "seconds": START_S + estimate("pp", n)} for n in gpus if n > 1 and "pp" in suites]
    if "pp" in suites and pair:
        out.append({"name": "pp-socket-2", "kind": "worker", "gpus": 2, "visible": 2, "suites": ["pp"], "env": SOCKETS,
                    "seconds": START_S + PP_SOCKETS_S})
    if "fsdp_oom" in suites and pair:
        out.append({"name": "fsdp_oom-2", "kind": "worker", "gpus": 2, "visible": 2, "suites": ["fsdp_oom"],
                    "capped": True, "seconds": estimate("fsdp_oom", 2)})
    out += [{"name": f"bandwidth-{n}", "kind": "bandwidth", "gpus": n, "suites": ["bandwidth"],
             "seconds": estimate("bandwidth", n)} for n in gpus if n >= 2 and "bandwidth" in suites]
    if "parity" in suites and reference:
        out.append({"name": "parity", "kind": "parity", "gpus": 2 if pair else 1, "suites": ["parity"],
                    "seconds": estimate("parity", 1)})  # accuracy only: side by side, even on one GPU
    multi = [n for n in gpus if n > 1] or gpus
    for n in gpus:  # lesson 08's model class: a launch of its own per GPU count
        here = [s for s in LLM if s in suites and {"llm_speed": True, "llm_fp8": n > 1, "llm_trace": n == multi[0],
                                                   "llm_fit": False}[s]]
        out += [{"name": f"llm-{n}", "kind": "worker", "gpus": n, "visible": n, "suites": here, "env": LLM_ALLOCATOR,
                 "seconds": LLM_START_S + sum(estimate(s, n) for s in here)}] if here else []
    if "llm_fit" in suites:  # the capped runs need one GPU (benchmarks/llm_fit.py); the default allocator
        out.append({"name": f"llm_fit-{min(gpus)}", "kind": "worker", "gpus": min(gpus), "visible": min(gpus),
                    "suites": ["llm_fit"], "seconds": LLM_START_S + estimate("llm_fit", min(gpus))})
    return out


def machine(args) -> dict:
    """What every row is stamped with; nvidia-smi, not torch, so this process holds no GPU."""
    def out(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    own = Path(out(["git", "rev-parse", "--show-toplevel"]) or "/nonexistent").resolve() == ROOT  # not a copy
    commit = args.commit or (out(["git", "rev-parse", "--short", "HEAD"]) if own else "") or "unknown"
    if not args.commit and own and out(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += "+uncommitted"
    import torch
    name, _, driver = out(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]).split("\n")[0] \
        .partition(", ")
    return {"commit": commit, "torch": torch.__version__, "driver": "-" if args.quick else driver or "?",
            "device_name": "CPU" if args.quick else name or "?", "date": datetime.date.today().isoformat(),
            "data": args.data, "quick": args.quick}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", default="all", help=f"comma-separated, of {','.join(SUITES + LLM)}, llm (the four "
                   "llm_ suites) (default: all: every suite but the llm ones)")
    p.add_argument("--gpus", default=None, help="GPU counts, e.g. 1,2 (default: 1, 2, 4, 8 up to those visible)")
    p.add_argument("--data", choices=("mnist", "synthetic"), default="mnist", help="(default: mnist; --quick: synthetic)")
    p.add_argument("--data-dir", default="data", help="folder holding MNIST/raw (default: ./data)")
    p.add_argument("--reference", help="pytorch/examples mnist/main.py, for the parity suite (default: no parity)")
    p.add_argument("--out", default=None, help="page, rows, plots (default: docs; --quick: runs/bench-quick)")
    p.add_argument("--budget", type=float, default=None, help="start no launch that would end after this many seconds")
    p.add_argument("--commit", default=None, help="the course commit to name (default: git, where the course folder is its own repository; "
                   "else unknown)")
    p.add_argument("--merge", nargs="*", default=[], help="benchmarks.json files of other runs to merge in first")
    p.add_argument("--plan", action="store_true", help="print the launches and their estimated seconds; run nothing")
    p.add_argument("--report-only", action="store_true", help="measure nothing: merge --merge and write the page")
    p.add_argument("--quick", action="store_true", help="CPU smoke mode: tiny synthetic runs with gloo, no result")
    args = p.parse_args(argv)
    suites = SUITES if args.suite == "all" else [x for s in args.suite.split(",") for x in (LLM if s == "llm" else [s])]
    if unknown := set(suites) - set(SUITES + LLM):
        p.error(f"unknown suite(s) {', '.join(sorted(unknown))}: choose from {', '.join(SUITES + LLM)}, llm")
    args.data = "synthetic" if args.quick else args.data  # the smoke mode never pretends to be MNIST
    args.out = Path(args.out or (ROOT / "runs" / "bench-quick" if args.quick else ROOT / "docs")).resolve()
    if args.reference and not Path(args.reference).is_file():
        p.error(f"--reference {args.reference}: no such file (pytorch/examples' mnist/main.py)")
    jobs = [] if args.report_only else plan(suites, gpu_counts(args), args.reference)
    if args.plan:
        for job in jobs:
            print(f"{job['seconds']:5.0f} s  {job['name']}: {', '.join(job['suites'])}")
        skipped = " (parity skipped: no --reference)" if "parity" in suites and not args.reference else ""
        return print(f"{sum(j['seconds'] for j in jobs) / 60:.1f} min estimated (GPU) for {len(jobs)} launches{skipped}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = report.load(args.out / "benchmarks.json")
    for extra in args.merge:
        rows = report.merge(rows, report.load(Path(extra)))
    if jobs:
        from common.data import prepare_data
        if any(set(job["suites"]) - set(LLM) for job in jobs):  # the llm suites make their own tokens
            prepare_data(args.data_dir, args.data, download=False)  # once, here: the ranks never race to extract
        args.data_dir = str(Path(args.data_dir).resolve())
        rows = measure(jobs, args, rows)
    report.save(args.out / "benchmarks.json", rows)
    report.write(args.out, rows)
    print(f"bench: {args.out / 'benchmarks.md'} from {len(rows)} rows")


def measure(jobs, args, rows) -> list:
    stamp, t0 = machine(args), time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="bench-"))
    for job in jobs:
        left = (args.budget or float("inf")) - (time.monotonic() - t0)
        if job["seconds"] > left:
            print(f"bench: {job['name']} SKIPPED: ~{job['seconds']:.0f} s would pass --budget {args.budget:.0f} s")
            continue
        began = time.monotonic()
        timeout = min(2 * job["seconds"] + 60, left + 60) * (3 if args.quick else 1)
        status, new = RUNNERS[job["kind"]](job, args, scratch, timeout)
        rows = report.merge(rows, [{**stamp, **r} for r in new])  # a worker names its GPU itself
        report.save(args.out / "benchmarks.json", rows)  # after every launch: a kill keeps what was measured
        print(f"bench: {job['name']} ({', '.join(job['suites'])}): {status}, {len(new)} rows in "
              f"{time.monotonic() - began:.0f} s (estimated {job['seconds']:.0f} s)", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"bench: measured in {(time.monotonic() - t0) / 60:.1f} min")
    return rows


def gpu_counts(args) -> list[int]:
    if args.quick:
        return [1, 2]  # two gloo processes stand in for two GPUs
    if args.gpus:
        return [int(g) for g in args.gpus.split(",")]
    import torch
    visible = torch.cuda.device_count() or (2 if args.plan else 0)  # counts GPUs without creating a context
    if not visible:
        raise SystemExit("error: no GPU visible: use --quick for the CPU smoke mode, or --plan")
    return [n for n in (1, 2, 4, 8) if n <= visible]


if __name__ == "__main__":
    main()
