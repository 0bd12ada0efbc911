"""Lesson 08's --async-checkpoint (08_your_model/digits_lm.py), for real on 2 gloo ranks: dcp.async_save returns while
a thread writes; a resume from a checkpoint written while the next epoch trained is exact; a crash while a save is
pending leaves the previous checkpoint, which --resume auto continues from, exactly. The writes are made slow, or made
to hang, by tests/slow_save/sitecustomize.py (outside the course's code)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lessons import assert_clean, metrics

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "08_your_model" / "digits_lm.py"
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SAME = ("epoch", "train_loss", "test_loss", "test_accuracy", "test_samples")  # all but the times


def command(synthetic_dir, out, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
            "--data", "synthetic", "--data-dir", synthetic_dir, "--train-samples", "128", "--test-samples", "40",
            "--batch-size", "16", "--test-batch-size", "20", "--dtype", "float32", "--lr", "0.01",
            "--async-checkpoint", "--output-dir", str(out), *map(str, extra)]


def slow(spec: str) -> dict:
    return {**os.environ, **ENV, "PYTHONPATH": str(ROOT / "tests" / "slow_save"), "SLOW_CHECKPOINT": spec}


def rows(out) -> list[dict]:
    return [{k: r[k] for k in SAME} for r in metrics(out)["epochs"]]


@pytest.fixture(scope="module")
def uninterrupted(synthetic_dir, tmp_path_factory):
    """3 epochs; each checkpoint's write takes 2 s more, so epoch e + 1 trains while checkpoint e is written."""
    out = tmp_path_factory.mktemp("async") / "whole"
    proc = subprocess.run(command(synthetic_dir, out, "--epochs", 3), capture_output=True, text=True, timeout=300,
                          env=slow("delay:2"), cwd=ROOT)
    assert_clean(proc)
    return proc, out


def test_async_save_returns_before_the_files_are_written(uninterrupted):
    proc, out = uninterrupted
    waited = [float(line.split("waited ")[1].split(" s")[0]) for line in proc.stdout.splitlines()
              if line.startswith("checkpoint ckpt-e")]
    assert len(waited) == 3 and max(waited) < 2.0, proc.stdout  # each write takes over 2 s; training waited less
    assert "(dcp.async_save: written in the background)" in proc.stdout
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["ckpt-e0002-s0000000", "ckpt-e0003-s0000000"], names  # renamed once written, pruned to 2


def test_a_save_that_waits_for_the_previous_write_counts_that_wait(synthetic_dir, tmp_path):
    """Each write takes 6 s more, an epoch of 1 step far less: the second save must wait for the first write to end,
    and training's printed wait counts that (at least half the 6 s) and says so; the first save found nothing."""
    proc = subprocess.run(command(synthetic_dir, tmp_path, "--epochs", 2, "--max-steps", 1), capture_output=True,
                          text=True, timeout=300, env=slow("delay:6"), cwd=ROOT)
    assert_clean(proc)
    saves = [line for line in proc.stdout.splitlines() if line.startswith("checkpoint ckpt-e")]
    waited = [float(line.split("waited ")[1].split(" s")[0]) for line in saves]
    assert len(saves) == 2 and waited[0] < 3.0 and "previous" not in saves[0], saves
    assert waited[1] >= 3.0 and "s of it for the previous checkpoint, still being written)" in saves[1], saves


def test_resume_from_an_async_checkpoint_is_exact(uninterrupted, synthetic_dir, tmp_path):
    """Checkpoint 2 was written while epoch 3 trained: its copy was staged first, so it holds epoch 2's weights."""
    _, out = uninterrupted
    proc = subprocess.run(command(synthetic_dir, tmp_path / "resumed", "--epochs", 3, "--resume",
                                  out / "checkpoints" / "ckpt-e0002-s0000000"),
                          capture_output=True, text=True, timeout=300, env={**os.environ, **ENV}, cwd=ROOT)
    assert_clean(proc)
    assert rows(tmp_path / "resumed") == rows(out), proc.stdout  # epoch 3 again, bit for bit


def wait_for(path: Path, text: str, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while text not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"no {text!r} within {deadline_s} s:\n{path.read_text()}"
        time.sleep(0.2)


def test_a_crash_during_an_async_save_leaves_the_previous_checkpoint(uninterrupted, synthetic_dir, tmp_path):
    _, whole = uninterrupted
    out, log = tmp_path / "crashed", tmp_path / "crashed.log"
    with open(log, "w") as f:  # the 2nd write of each rank hangs: checkpoint 2 is pending when the job is killed
        job = subprocess.Popen(command(synthetic_dir, out, "--epochs", 3), stdout=f, stderr=subprocess.STDOUT,
                               env=slow("hang:2"), cwd=ROOT, start_new_session=True)
    try:
        wait_for(log, "inject: rank 0 write 2 pending", 240)
        wait_for(log, "checkpoint ckpt-e0002-s0000000: training waited", 60)  # async_save had returned
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # torchrun and both ranks, as the OOM killer or a node failure would
        job.wait(timeout=60)
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["ckpt-e0001-s0000000", "ckpt-e0002-s0000000.tmp"], names  # the pending one never got its name
    proc = subprocess.run(command(synthetic_dir, out, "--epochs", 3, "--resume", "auto"), capture_output=True,
                          text=True, timeout=300, env={**os.environ, **ENV}, cwd=ROOT)
    assert_clean(proc)
    assert f"resume: from {out / 'checkpoints' / 'ckpt-e0001-s0000000'}, continuing at epoch 2 step 0" in proc.stdout
    assert rows(out) == rows(whole), proc.stdout  # epochs 2 and 3 as if nothing had happened
