"""How bench.py runs each kind of launch and reads back its rows: a worker launch (benchmarks/worker.py under
torchrun, one per GPU count), NCCL's bandwidth sweep per transport, the parity pair (the reference script and lesson
02). Each runner returns its status ('ok', 'failed (...)' or 'timeout') and its rows; bench.py stamps and merges them.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env_for(gpus: int, quick: bool, first: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1" if quick else "4"}
    if not quick:  # the first `gpus` of the visible GPUs, from `first` on
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(16)))).split(",")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[first:first + gpus])
    return env


def call(cmd: list, env: dict, log: Path, timeout: float, cwd=ROOT) -> str:
    """Run cmd to the end or its timeout (its whole process group stopped); 'ok', 'failed (exit N)' or 'timeout'."""
    with open(log, "a") as f:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: torchrun and its workers stop together
        try:
            return "ok" if proc.wait(timeout=timeout) == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return "timeout"


def torchrun(n: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]


def run_worker(job, args, scratch: Path, timeout: float) -> tuple[str, list]:
    rows = scratch / f"{job['name']}.jsonl"
    spec = {"suites": job["suites"], "quick": args.quick, "data": args.data, "data_dir": args.data_dir,
            "rows": str(rows), "out": str(args.out), "scratch": str(scratch / job["name"]),
            "cap_gib": 6.0 if job.get("capped") else None, "env": job.get("env"),
            "deadline_s": timeout - 120}  # the llm suites start no run after it: the launch ends before its timeout
    (scratch / f"{job['name']}.json").write_text(json.dumps(spec))
    env = {**env_for(job["visible"], args.quick), "DIST_TIMEOUT_SECONDS": "120",  # a hung collective fails in 2 min
           **job.get("env", {})}
    status = call(torchrun(job["gpus"]) + ["benchmarks/worker.py", scratch / f"{job['name']}.json"],
                  env, args.out / "bench.log", timeout)
    return status, [json.loads(line) for line in rows.read_text().splitlines()] if rows.exists() else []


def run_bandwidth(job, args, scratch: Path, timeout: float) -> tuple[str, list]:
    """NCCL's transports one by one (troubleshooting/nccl_transports.sh); --quick: one gloo sweep on the CPU."""
    out, n = args.out / f"nccl-{job['gpus']}", job["gpus"]  # NCCL's own lines stay, next to the page
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        status = call(torchrun(n) + ["01_setup/allreduce_bandwidth.py", "--device", "cpu", "--max-bytes", "64K",
                                     "--iters", "2", "--json", out / "default.json"],
                      env_for(n, True), out / "default.log", timeout)
    else:
        status = call(["bash", "troubleshooting/nccl_transports.sh", out],
                      {**env_for(n, False), "NPROC": str(n), "PYTHON": sys.executable}, args.out / "bench.log", timeout)
    rows = []
    for name, env in (("default", ""), ("no_p2p", "NCCL_P2P_DISABLE=1"),
                      ("no_p2p_shm", "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1")):
        if (out / f"{name}.json").exists():
            sweep = json.loads((out / f"{name}.json").read_text())
            log = (out / f"{name}.log").read_text(errors="replace") if (out / f"{name}.log").exists() else ""
            via = sorted({re.sub(r"^\S+ ", "", ln.strip()) for ln in log.splitlines() if " via " in ln})
            sizes = [[r["bytes"], r["busbw_gbps"]] for r in sweep["rows"]]
            rows.append({"suite": "bandwidth", "program": "allreduce", "variant": name, "env": env, "gpus": n,
                         "device_name": sweep.get("gpu", "CPU"), "sizes": sizes, "via": via[:4],
                         "avg_busbw": sum(s[1] for s in sizes) / len(sizes), "peak_busbw": max(s[1] for s in sizes),
                         "peak_bytes": max(sizes, key=lambda s: s[1])[0]})
    return status, rows


def run_parity(job, args, scratch: Path, timeout: float) -> tuple[str, list]:
    """The reference script and lesson 02's default (trainer --parallel single: its metrics.json), seed 1, side by
    side (on two GPUs when there are two)."""
    work = scratch / "parity" / "work"  # the reference reads ../data/MNIST, as pytorch/examples' main.py does
    (work.parent / "data").mkdir(parents=True, exist_ok=True)
    os.symlink(Path(args.data_dir, "MNIST").resolve(), work.parent / "data" / "MNIST")
    work.mkdir()
    quick = ["--epochs", "1", "--train-samples", "256", "--test-samples", "128", "--num-workers", "0",
             "--device", "cpu"] if args.quick else []
    lesson = [sys.executable, "trainer/train.py", "--parallel", "single", "--seed", "1", "--data", args.data,
              "--data-dir", args.data_dir, "--output-dir", scratch / "parity" / "lesson02"] + quick
    ref = [sys.executable, Path(args.reference).resolve(), "--seed", "1"] + (["--epochs", "1"] if args.quick else [])
    logs, procs, deadline = {}, [], time.monotonic() + timeout
    for i, (name, cmd, cwd) in enumerate((("reference", ref, work), ("02", lesson, ROOT))):
        logs[name] = args.out / f"parity-{name}.log"  # kept: the reference's own lines are the evidence
        with open(logs[name], "w") as f:
            procs.append(subprocess.Popen([str(c) for c in cmd], cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                                          env=env_for(1, args.quick, first=i if job["gpus"] == 2 else 0)))
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    status = "ok" if codes == [0, 0] else f"failed (exit codes {codes})"
    tests = re.findall(r"Test set: Average loss: ([\d.]+), Accuracy: (\d+)/(\d+)", logs["reference"].read_text())
    rows = [{"suite": "parity", "program": "reference", "variant": Path(args.reference).name, "seed": 1, "gpus": 1,
             "accuracy": [int(c) / int(t) for _, c, t in tests], "test_loss": [float(x) for x, _, _ in tests]}]
    rows = rows if tests else []  # the reference failed or printed no test line: its log says why
    metrics = scratch / "parity" / "lesson02" / "metrics.json"
    if metrics.exists():
        epochs = json.loads(metrics.read_text())["epochs"]
        rows.append({"suite": "parity", "program": "02", "variant": "default", "seed": 1, "gpus": 1,
                     "accuracy": [e["test_accuracy"] for e in epochs], "test_loss": [e["test_loss"] for e in epochs]})
    return status, rows


RUNNERS = {"worker": run_worker, "bandwidth": run_bandwidth, "parity": run_parity}  # a launch's "kind"
