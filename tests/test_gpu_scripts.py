"""CPU smoke tests (gloo, 2 real processes) of the scripts written for the GPU machine.

benchmarks/plain_loop.py and benchmarks/ddp_overlap.py run on GPUs with NCCL; here the same code
paths run on the CPU with tiny sizes, so a GPU run does not fail on a typo. The CUDA-only half of
ddp_overlap (reading kernels out of a CUDA trace) is checked on a hand-made trace of the same format.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}}
ENV["OMP_NUM_THREADS"] = "1"


def torchrun(script: str, *args, timeout: int = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, *map(str, args)]
    run = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "warn" not in run.stderr.lower(), run.stderr[-3000:]  # a clean run prints no warnings
    return run


def test_plain_loop_one_epoch_on_synthetic_digits(synthetic_dir, tmp_path):
    out = tmp_path / "plain.json"
    run = torchrun("benchmarks/plain_loop.py", "--data", "synthetic", "--data-dir", synthetic_dir,
                   "--train-samples", 512, "--test-samples", 256, "--batch-size", 32, "--epochs", 1,
                   "--warmup-steps", 1, "--seeds", "1,2", "--json", out)
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["device"] == "cpu" and result["data"] == "synthetic"
    assert result["train_samples"] == 512 and result["test_samples"] == 256
    assert result["batch_per_process"] == 32 and result["global_batch"] == 64
    assert [r["seed"] for r in result["runs"]] == [1, 2]
    for r in result["runs"]:
        assert r["epochs"] == 1 and len(r["epoch_seconds"]) == len(r["epoch_ms_per_step"]) == 1 and r["ms_per_step"] > 0
        assert 0 < r["s_per_epoch"] == r["epoch_seconds"][0]
        assert 0 <= r["final_accuracy"] <= 1 and r["final_accuracy"] == r["accuracy"][-1]
        assert r["reached_target"] == (r["final_accuracy"] >= 0.99)
        assert r["time_to_target_s"] == (sum(r["epoch_seconds"]) if r["reached_target"] else None)
    assert "seed 2: time to 99.00%" in run.stdout


def test_ddp_overlap_draws_every_variant_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.ddp_overlap import main

    run = torchrun("benchmarks/ddp_overlap.py", "--device", "cpu", "--batch-size", 8, "--warmup-steps", 2,
                   "--out", tmp_path)
    variants = ["default", "one", "small", "no_sync"]
    for variant in variants:
        assert (tmp_path / f"overlap_{variant}.png").stat().st_size > 1024
        for rank in (0, 1):
            assert (tmp_path / f"trace_{variant}_rank{rank}.json").stat().st_size > 1024
    assert (tmp_path / "overlap_all.png").stat().st_size > 1024
    numbers = json.loads((tmp_path / "overlap.json").read_text())["variants"]
    assert list(numbers) == variants
    # Bucket counts, from DDP's own log: 2 by default (a 1 MB first bucket), 1 with a 100 MB cap, 5 with 1 KB.
    assert numbers["default"]["buckets"].count(",") == 1 and "," not in numbers["one"]["buckets"]
    assert numbers["small"]["buckets"].count(",") == 4
    for variant in variants:  # gloo collectives were found in the profiled step, and the sums add up
        n = numbers[variant]
        assert n["comm_kernels"] >= 1 and n["comm_ms"] > 0
        assert 0 <= n["overlapped_ms"] <= n["comm_ms"] and n["exposed_ms"] == pytest.approx(n["comm_ms"] - n["overlapped_ms"])
    assert "overlapped ms" in run.stdout

    # --render-only redraws from the traces alone (e.g. on a laptop, from a GPU machine's OUT folder)
    for old in [*tmp_path.glob("*.png"), *tmp_path.glob("trace_[dno]*.json")]:  # keep the traces of "small"
        old.unlink()
    monkeypatch.setattr(sys, "argv", ["ddp_overlap.py", "--render-only", "--out", str(tmp_path)])
    main()
    assert (tmp_path / "overlap_small.png").stat().st_size > 1024 and (tmp_path / "overlap_all.png").exists()
    redrawn = json.loads((tmp_path / "overlap.json").read_text())["variants"]
    assert list(redrawn) == ["small"] and redrawn["small"]["buckets"] == numbers["small"]["buckets"]


def test_ddp_overlap_reads_kernels_and_backward_from_a_cuda_trace(tmp_path, monkeypatch):
    """The format torch.profiler writes with CUDA: kernels (cat "kernel") linked to their CPU launches by args.correlation."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.ddp_overlap import lanes, overlap_numbers

    def x(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1, "args": args}

    events = [x("user_annotation", "step", 1000, 500), x("user_annotation", "forward 0", 1000, 100),
              x("user_annotation", "backward 0", 1100, 300),
              x("kernel", "ncclDevKernel_AllReduce_Sum_f32 (the barrier, before the step)", 900, 50),
              x("cuda_runtime", "cudaLaunchKernel", 1010, 5, correlation=1),  # forward
              x("kernel", "sm90_xmma_fprop", 1050, 100, correlation=1),
              x("cuda_runtime", "cudaLaunchKernel", 1120, 5, correlation=2),  # backward
              x("kernel", "wgrad_kernel", 1200, 200, correlation=2),
              x("cuda_driver", "cuLaunchKernelEx", 1150, 5, correlation=3),  # DDP's bucket all_reduce
              x("kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1300, 150, correlation=3)]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    info = lanes(str(trace))
    compute, comm = info["lanes"]["compute kernels"], info["lanes"]["NCCL kernels"]
    assert compute == [(0.05, 0.15), (0.2, 0.4)] and comm == [(0.3, 0.45)]  # ms from the step start
    assert info["backward"] == [(0.2, 0.4)]  # the GPU span of backward's compute kernels
    n = overlap_numbers(info)
    assert n["comm_kernels"] == 1 and n["comm_ms"] == pytest.approx(0.15)
    assert n["overlapped_ms"] == pytest.approx(0.1) and n["exposed_ms"] == pytest.approx(0.05)
