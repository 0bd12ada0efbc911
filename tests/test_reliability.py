"""Exact resume, preemption signals, no hangs, and one-line errors, for real (elastic restarts: the walk of
lesson 04's reference page).

A stopped run is judged against an uninterrupted run of the same flags.
"""
import socket
import time

import pytest
import torch

from common.launcher import WorkerError, launch
from lessons import INJECT, PARALLEL, ROOT, assert_clean, metrics, run_trainer


@pytest.fixture(scope="module")
def small(synthetic_dir):
    return ["--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", "0",
            "--train-samples", "640", "--test-samples", "200", "--batch-size", "32"]


# 1001 test images in batches of 500 on 2 ranks are shards of 501 and 500: 2 batches on one rank, 1 on the other.
# 1600 training images on 2 ranks in batches of 32: 25 steps an epoch, so a stop can be agreed at step 20.
# --clip-grad: an epoch resumed at its very end (no step left) must not clip (unscale) gradients it never made.
EXACT = ["--train-samples", 1600, "--test-samples", 1001, "--test-batch-size", 500, "--clip-grad", 0.5]


def newest(out_dir):
    return max((out_dir / "checkpoints").iterdir(), key=lambda p: p.name)


def final_weights(out_dir, lesson):
    """The trained weights as a plain state dict (lesson 05 exports them gathered into model_full.pt)."""
    if lesson == "05":
        return torch.load(out_dir / "model_full.pt", weights_only=True)
    return torch.load(newest(out_dir), weights_only=True)["model"]


def same_numbers(a, b):
    keep = ("epoch", "train_loss", "test_loss", "test_accuracy", "test_samples")
    return [{k: e[k] for k in keep} for e in a["epochs"]] == [{k: e[k] for k in keep} for e in b["epochs"]]


# Lesson 02 resumes exactly mid-epoch in tests/test_exercises_02.py; lesson 04 after an epoch in
# tests/test_early_stopping.py, and after an elastic restart in the walk of its reference page.
@pytest.mark.parametrize("lesson", ["04", "05"])
def test_sigusr1_mid_epoch_stops_all_ranks_saves_and_resumes_exactly(lesson, small, tmp_path):
    """Then the resumed run is stopped again, at the epoch's end, by a signal that came after its last check, and
    the last resume ends where the uninterrupted run did."""
    whole, hit = tmp_path / "whole", tmp_path / "hit"
    args = [*small, *EXACT, "--epochs", 3]
    assert_clean(run_trainer(PARALLEL[lesson], *args, "--output-dir", whole, nproc=2))  # the uninterrupted reference
    saved = f"ckpt-e0000-s0000020{'' if lesson == '05' else '.pt'}"  # lesson 05: a DCP folder
    # Rank 1 alone gets SIGUSR1 at step 5 of epoch 1; the vote of step 10 carries it, every rank reads it at the
    # next check (step 20) and stops there.
    proc = run_trainer(PARALLEL[lesson], *args, "--output-dir", hit, nproc=2, env={**INJECT, "FAIL_AT_STEP": "1:5:USR1"})
    assert_clean(proc)
    assert "stopped by SIGUSR1 at epoch 1 step 20, checkpoint saved: not a Slurm job" in proc.stdout, proc.stdout
    assert [p.name for p in (hit / "checkpoints").iterdir()] == [saved]
    # The resumed run: rank 1 alone gets SIGTERM at step 23, after the epoch's last check (20): the vote at the
    # epoch's end stops every rank there, before the test (on its own, rank 1 would have saved while rank 0 waited
    # in the test's all_reduce).
    proc = run_trainer(PARALLEL[lesson], *args, "--output-dir", hit, "--resume", "auto", nproc=2,
                      env={**INJECT, "FAIL_AT_STEP": "1:23:TERM", "DIST_TIMEOUT_SECONDS": "60"})
    assert_clean(proc)
    assert "resume: from" in proc.stdout and "stopped by SIGTERM at epoch 1 step 25, checkpoint saved" in proc.stdout
    assert newest(hit).name == saved.replace("s0000020", "s0000025")
    proc = run_trainer(PARALLEL[lesson], *args, "--output-dir", hit, "--resume", "auto", nproc=2)
    assert_clean(proc)
    assert [e["epoch"] for e in metrics(hit)["epochs"]] == [1, 2, 3]  # every epoch exactly once
    # the same losses too: each rank resumed the interrupted epoch with its OWN loss sums
    assert same_numbers(metrics(whole), metrics(hit))
    assert metrics(hit)["epochs"][-1]["test_samples"] == 1001  # uneven test shards, each image counted once
    for name, value in final_weights(whole, lesson).items():  # the same weights, as if uninterrupted
        assert torch.equal(value, final_weights(hit, lesson)[name]), name



def test_a_failing_rank_ends_the_torchrun_job_quickly(small, tmp_path):
    start = time.monotonic()
    proc = run_trainer("ddp", *small, "--epochs", 1, "--output-dir", tmp_path, nproc=2, timeout=120,
                      env={**INJECT, "FAIL_AT_STEP": "1:3", "DIST_TIMEOUT_SECONDS": "20"})
    assert proc.returncode != 0 and time.monotonic() - start < 60
    assert "rank 1 fails at step 3" in proc.stdout + proc.stderr


def test_a_failing_rank_ends_the_notebook_launcher_quickly(small, tmp_path, monkeypatch):
    import importlib
    monkeypatch.syspath_prepend(str(ROOT))  # the workers import the trainer's module by name
    module = importlib.import_module("trainer.ddp")
    monkeypatch.setenv("FAIL_AT_STEP", "1:2")
    monkeypatch.setenv("PYTHONPATH", INJECT["PYTHONPATH"])  # the spawned workers load tests/inject/sitecustomize
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed: RuntimeError: FAIL_AT_STEP"):
        launch(module.main, nprocs=2, args=([*small, "--epochs", "1", "--output-dir", str(tmp_path)],), timeout_s=120)
    assert time.monotonic() - start < 60


def one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stdout[-1000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, last
    return last


def test_master_port_in_use_is_one_line(small, tmp_path):
    """The other one-line errors are in the bad-input matrix (tests/bad_inputs.py); a busy port needs a listener."""
    with socket.socket() as busy:  # MASTER_PORT taken by someone else
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        one_line_error(run_trainer("ddp", *small, "--output-dir", tmp_path / "y", env=env), f"MASTER_PORT {port}", "in use")
