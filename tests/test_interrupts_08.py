"""Lesson 08's digits_lm.py stopped from outside, as lessons 04-07: Ctrl-C (SIGINT to the whole foreground group, as
a terminal sends it) and Slurm's SIGUSR1 (to one rank). Every rank stops at the same step, the checkpoint is saved,
and --resume auto finishes with the numbers of a run that was never interrupted."""
import os
import subprocess
import sys

import pytest

from lessons import INJECT, ROOT, assert_clean, metrics
from test_interrupts import DEADLINE_S, Terminal, checkpoints

pytestmark = pytest.mark.timeout(600)
SCRIPT = ROOT / "08_your_model" / "digits_lm.py"
CONTINUE = "continue with the same command and --resume auto"


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
            *map(str, args)]


def run(*args, env=None):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(torchrun(*args), capture_output=True, text=True, timeout=DEADLINE_S, env=full_env, cwd=ROOT)


@pytest.fixture(scope="module")
def small(synthetic_dir):
    """25 steps per rank and epoch (800 images, 2 ranks, 16 a step), 2 epochs, float32."""
    return ["--data", "synthetic", "--data-dir", synthetic_dir, "--train-samples", 800, "--test-samples", 50,
            "--batch-size", 16, "--test-batch-size", 25, "--epochs", 2, "--dtype", "float32"]


@pytest.fixture(scope="module")
def uninterrupted(small, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    assert_clean(run(*small, "--output-dir", out))
    return metrics(out)["epochs"]


def same_numbers(resumed, uninterrupted):
    assert [r["epoch"] for r in resumed] == [1, 2]
    for got, want in zip(resumed, uninterrupted):
        for key in ("train_loss", "test_loss", "test_accuracy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (key, got, want)


def test_ctrl_c_stops_every_rank_at_one_step_and_resumes_exactly(small, uninterrupted, tmp_path):
    """Ctrl-C at step 3: the vote of step 10, read at step 20, stops both ranks there; one `stopped by` line, one
    checkpoint of both ranks' shards; the same command with --resume auto ends as the uninterrupted run."""
    job = Terminal(torchrun(*small, "--output-dir", tmp_path),
                   env={**INJECT, "HF_HUB_OFFLINE": "1", "FAIL_AT_STEP": "0:3:WAIT"})
    assert job.wait_for("inject: rank 0 waits") == "inject: rank 0 waits at epoch 1 step 3"
    job.ctrl_c()
    assert job.finish() == 1, job.lines[-30:]  # torchrun itself reports the SIGINT it got
    said = [line for line in job.lines if line.startswith("stopped by")]
    assert said == [f"stopped by Ctrl-C (SIGINT) at epoch 1 step 20, checkpoint saved: {CONTINUE}"], job.lines
    assert not [line for line in job.lines if line.startswith(("error:", "interrupted", "rank 1: stopping"))]
    assert checkpoints(tmp_path) == ["ckpt-e0000-s0000020"]
    saved = tmp_path / "checkpoints" / "ckpt-e0000-s0000020"
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    resumed = run(*small, "--output-dir", tmp_path, "--resume", "auto")
    assert_clean(resumed)
    assert "continuing at epoch 1 step 20" in resumed.stdout, resumed.stdout
    same_numbers(metrics(tmp_path)["epochs"], uninterrupted)


def test_sigusr1_on_one_rank_stops_both_and_resumes_exactly(small, uninterrupted, tmp_path):
    """Slurm's warning reaches rank 1 at step 5: both ranks stop at step 20 and save; outside Slurm the script says
    to restart it. On 1 rank the rest of that epoch would not be the batches the 2 ranks left: refused, one line.
    The resumed run on 2 ranks ends as the uninterrupted one, and an --export is left for the finished run."""
    stopped = run(*small, "--output-dir", tmp_path, "--export", tmp_path / "hf",
                  env={**INJECT, "FAIL_AT_STEP": "1:5:USR1"})
    assert_clean(stopped)
    assert ("stopped by SIGUSR1 at epoch 1 step 20, checkpoint saved: not a Slurm job: restart it yourself with "
            "--resume auto") in stopped.stdout, stopped.stdout
    assert not (tmp_path / "hf").exists()  # a stopped run exports nothing
    assert checkpoints(tmp_path) == ["ckpt-e0000-s0000020"]
    again = [*small, "--output-dir", tmp_path, "--export", tmp_path / "hf", "--resume", "auto"]
    one_rank = subprocess.run([sys.executable, str(SCRIPT), *map(str, again)], capture_output=True, text=True,
                              timeout=DEADLINE_S, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                              cwd=ROOT)
    assert one_rank.returncode == 2 and one_rank.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'checkpoints' / 'ckpt-e0000-s0000020'} stopped at step 20 of epoch 1 on 2 ranks: finish "
        f"that epoch on 2 (torchrun --nproc_per_node=2); a checkpoint between epochs (step 0) resumes on any number"], \
        one_rank.stdout + one_rank.stderr
    resumed = run(*again)
    assert_clean(resumed)
    assert "continuing at epoch 1 step 20" in resumed.stdout, resumed.stdout
    same_numbers(metrics(tmp_path)["epochs"], uninterrupted)
    assert (tmp_path / "hf" / "config.json").is_file()
