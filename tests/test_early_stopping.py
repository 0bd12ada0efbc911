"""Validation, early stopping and the best model, for real under torchrun with 2 ranks.

The validation set is held out of the training images by --seed, the same on every rank; its
accuracy is summed over ranks, so every rank takes the same stop decision without a broadcast.
"""
import pytest
import torch

from lessons import assert_clean, metrics, run_trainer

FLAGS = ["--train-samples", 600, "--val-samples", 203, "--test-samples", 101, "--batch-size", 32,
         "--optimizer", "adamw", "--lr", 3e-3, "--patience", 1, "--keep-checkpoints", 10]


@pytest.fixture(scope="module")
def small(synthetic_dir):
    return ["--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", "0", *FLAGS]


def rows(out_dir):
    keep = ("epoch", "train_loss", "val_accuracy", "val_samples", "test_accuracy", "test_samples")
    return [{k: r[k] for k in keep} for r in metrics(out_dir)["epochs"]]


def check_stopped_early(proc, out_dir, epochs):
    """It stopped before --epochs, one epoch after its best; best.pt holds that epoch's weights."""
    assert_clean(proc)
    m = metrics(out_dir)
    last, best = m["epochs"][-1]["epoch"], m["best_epoch"]
    assert last < epochs and last - best == 1, rows(out_dir)  # --patience 1
    assert "early stopping: no better val_accuracy for 1 epoch" in proc.stdout
    assert max(r["val_accuracy"] for r in m["epochs"]) == m["epochs"][best - 1]["val_accuracy"]
    assert all(r["val_samples"] == 203 and r["test_samples"] == 101 for r in m["epochs"])  # every image once
    best_file = torch.load(out_dir / "best.pt", weights_only=True)
    same_epoch = torch.load(out_dir / "checkpoints" / f"ckpt-e{best:04d}-s0000000.pt", weights_only=True)
    assert best_file["position"]["epoch"] == best + 1
    assert all(torch.equal(v, same_epoch["model"][k]) for k, v in best_file["model"].items())
    row = m["epochs"][best - 1]
    assert f"best epoch {best} (val_accuracy {row['val_accuracy']:.4f}): test_accuracy " \
           f"{row['test_accuracy']:.4f}" in proc.stdout  # the final line reports the best model's test accuracy
    return last


@pytest.fixture(scope="module")
def stopped_on_2_ranks(small, tmp_path_factory):
    """One run of 2 ranks that stops early: checked on its own, and the reference a resumed run must equal."""
    out = tmp_path_factory.mktemp("whole")
    return run_trainer("ddp", *small, "--epochs", 8, "--output-dir", out, nproc=2), out


def test_every_rank_stops_at_the_same_epoch(stopped_on_2_ranks):
    """All ranks leave the loop together (one that did not would hang in the next collective)."""
    check_stopped_early(*stopped_on_2_ranks, 8)



def test_a_resumed_run_stops_at_the_same_epoch_as_an_uninterrupted_one(small, stopped_on_2_ranks, tmp_path):
    proc, whole = stopped_on_2_ranks
    stop = check_stopped_early(proc, whole, 8)
    split = tmp_path / "split"
    assert_clean(run_trainer("ddp", *small, "--epochs", 2, "--output-dir", split, nproc=2))
    proc = run_trainer("ddp", *small, "--epochs", 8, "--resume", "auto", "--output-dir", split, nproc=2)
    assert check_stopped_early(proc, split, 8) == stop
    assert rows(split) == rows(whole)  # the same epochs, losses and accuracies: the early-stopping state survived
