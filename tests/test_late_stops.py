"""A stop requested after the last vote, for real under torchrun (the trainer's fsdp2, 2d and pp; lesson 08; 2 gloo
ranks, 2 epochs).

Slurm's SIGUSR1 reaches rank 1 alone during the last epoch's test (tests/inject/sitecustomize.py's
SIGNAL_AT_EVAL=1:2: its second pass over the test set): after that epoch's stop vote, before its checkpoint. After
the loop the scripts run collectives (the trainer's fsdp2, 2d and pp gather the full weights into model_full.pt, 08
exports): one more vote makes every rank skip them, or none. Without it rank 1 alone skipped them and left rank 0
alone in an all-gather (on gloo: the job failed, exit 1; a collective whose peer never comes waits for the process
group's timeout, 600 s). Every rank exits in time, one `stopped by` line names the checkpoint already saved (the
last epoch's), and --resume auto, with nothing left to train, writes what the stopped run did not.
"""
import os
import subprocess
import sys

import pytest

from lessons import INJECT, PARALLEL, ROOT, assert_clean, metrics, trainer
from test_interrupts import DEADLINE_S, Terminal, checkpoints

pytestmark = pytest.mark.timeout(400)
ENV = {"HF_HUB_OFFLINE": "1"}  # lesson 08: nothing from the Hub
STOPPED = ("stopped by SIGUSR1 after epoch 2, checkpoint saved: not a Slurm job: restart it yourself with "
           "--resume auto")


def torchrun(lesson: str, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            *([str(ROOT / "08_your_model" / "digits_lm.py")] if lesson == "08" else trainer(PARALLEL[lesson])),
            *map(str, args)]


def flags(lesson: str, data_dir: str, out) -> list:
    """A small run: 4 steps per rank and epoch, 40 test images; lesson 08 exports what the trainer gathers."""
    common = ["--data", "synthetic", "--data-dir", data_dir, "--train-samples", 128, "--test-samples", 40,
              "--batch-size", 16, "--epochs", 2, "--output-dir", out]
    if lesson == "08":
        return [*common, "--test-batch-size", 20, "--dtype", "float32", "--export", out / "hf"]
    return [*common, "--num-workers", 0]


def written(lesson: str, out):
    """What the finished run leaves after training: the gathered weights, or the export's config.json."""
    return out / "hf" / "config.json" if lesson == "08" else out / "model_full.pt"


@pytest.mark.parametrize("lesson", ["05", "06", "07", "08"])
def test_a_signal_after_the_last_vote_stops_every_rank_and_resume_finishes(lesson, synthetic_dir, tmp_path):
    out = tmp_path / "run"
    argv = flags(lesson, synthetic_dir, out)
    job = Terminal(torchrun(lesson, *argv), env={**INJECT, **ENV, "SIGNAL_AT_EVAL": "1:2"})
    assert job.wait_for("inject: rank 1 sends") == "inject: rank 1 sends itself SIGUSR1 in evaluation pass 2"
    assert job.finish() == 0, job.lines[-30:]  # within Terminal's 150 s deadline: nobody waits for the timeout
    assert not [line for line in job.lines if "Warning" in line or "Traceback" in line], job.lines[-30:]
    assert [line for line in job.lines if line.startswith("stopped by")] == [STOPPED], job.lines[-30:]
    assert any(line.startswith("epoch 2 |") for line in job.lines), job.lines[-30:]  # epoch 2 was trained and tested
    assert "ckpt-e0002-s0000000" in checkpoints(out)  # its checkpoint: what the stop line says was saved
    assert not written(lesson, out).exists()
    resumed = subprocess.run(torchrun(lesson, *argv, "--resume", "auto"), capture_output=True, text=True, cwd=ROOT,
                             timeout=DEADLINE_S, env={**os.environ, **ENV, "OMP_NUM_THREADS": "1"})
    assert_clean(resumed)
    assert "nothing to train" in resumed.stdout and "stopped by" not in resumed.stdout, resumed.stdout
    assert written(lesson, out).is_file()
    assert [r["epoch"] for r in metrics(out)["epochs"]] == [1, 2]
