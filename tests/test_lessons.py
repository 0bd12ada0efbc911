"""Every lesson script, run for real on CPU with gloo, on the synthetic MNIST files."""
import re

import pytest

import torch

from common.model import Net
from lessons import assert_clean, metrics, run_script

FIELDS = {"lesson", "world_size", "backend", "device", "torch_version", "args", "epochs", "peak_memory_bytes",
          "warmup_seconds", "time_to_target_seconds"}
EPOCH_FIELDS = {"epoch", "train_loss", "test_loss", "test_accuracy", "test_samples", "epoch_seconds",
                "train_images_per_second"}


@pytest.fixture(scope="module")
def small(synthetic_dir):
    """Flags for a small, quick run on the shared synthetic data."""
    return ["--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", "0"]


def check_metrics(out_dir, lesson, world_size, test_samples, min_accuracy=0.2):
    m = metrics(out_dir)
    assert FIELDS <= m.keys() and m["lesson"] == lesson and m["world_size"] == world_size
    assert m["device"] == "cpu" and m["peak_memory_bytes"] is None
    for row in m["epochs"]:
        assert EPOCH_FIELDS <= row.keys()
        assert row["test_samples"] == test_samples  # every test example counted exactly once
        assert row["train_images_per_second"] > 0
    assert m["epochs"][-1]["test_accuracy"] > min_accuracy  # above chance (0.1) after training
    assert (out_dir / "curves.png").stat().st_size > 1000
    return m


def test_hello_distributed_under_torchrun():
    proc = run_script("01", nproc=3)
    assert_clean(proc)
    assert "OK: all_reduce, broadcast, all_gather and barrier verified on 3 rank(s)" in proc.stdout
    assert sorted(re.findall(r"rank \d of 3", proc.stdout)) == ["rank 0 of 3", "rank 1 of 3", "rank 2 of 3"]


def test_02_single_process(small, tmp_path):
    proc = run_script("02", *small, "--train-samples", 1000, "--test-samples", 333, "--epochs", 2,
                      "--output-dir", tmp_path)
    assert_clean(proc)
    m = check_metrics(tmp_path, "02_singlegpu_training", 1, 333)
    assert [r["epoch"] for r in m["epochs"]] == [1, 2] and m["backend"] is None
    assert proc.stdout.count("epoch ") >= 2 and "test_accuracy" in proc.stdout
    ckpt = torch.load(tmp_path / "checkpoints" / "ckpt-e0002-s0000000.pt", weights_only=True)
    Net().load_state_dict(ckpt["model"])  # plain keys: loads into a plain Net
    assert ckpt["position"]["epoch"] == 3 and ckpt["optimizer"]["state"] and ckpt["scheduler"]



def test_03_dataparallel_on_cpu_says_it_does_nothing(small, tmp_path):
    proc = run_script("03", *small, "--train-samples", 640, "--test-samples", 200, "--epochs", 1,
                      "--output-dir", tmp_path)
    assert_clean(proc)
    assert "DataParallel needs 2+ GPUs and does nothing on cpu" in proc.stdout
    check_metrics(tmp_path, "03_dp_training", 1, 200, min_accuracy=0.1)


# 3 ranks, 7 test images in batches of 2: shards of 3, 2 and 2 images, so 2, 1 and 1 batches (2 ranks: test_reliability)
@pytest.mark.parametrize("nproc", [3])
def test_04_ddp_under_torchrun(small, tmp_path, nproc):
    proc = run_script("04", *small, "--train-samples", 1200, "--test-samples", 7, "--test-batch-size", 2,
                      "--epochs", 1, "--output-dir", tmp_path, nproc=nproc)
    assert_clean(proc)
    m = check_metrics(tmp_path, "04_ddp_training", nproc, 7)
    assert m["backend"] == "gloo"
    assert all(f"rank {r}/{nproc}" in proc.stdout for r in range(nproc))
    ckpt = torch.load(tmp_path / "checkpoints" / "ckpt-e0001-s0000000.pt", weights_only=True)
    Net().load_state_dict(ckpt["model"])  # saved from model.module: no "module." prefixes
    assert proc.stdout.count("epoch 1 |") == 1  # only rank 0 prints the epoch line



@pytest.mark.parametrize("nproc", [3])
def test_05_fsdp_under_torchrun(small, tmp_path, nproc):
    """FSDP all-gathers inside forward: the ranks with one test batch fewer must still join the last one (no hang)."""
    proc = run_script("05", *small, "--train-samples", 1200, "--test-samples", 7, "--test-batch-size", 2,
                      "--val-samples", 100, "--epochs", 1, "--output-dir", tmp_path, nproc=nproc,
                      env={"DIST_TIMEOUT_SECONDS": "60"})
    assert_clean(proc)
    check_metrics(tmp_path, "05_multigpu_fsdp_training", nproc, 7)
    assert metrics(tmp_path)["epochs"][0]["val_samples"] == 100
    assert (tmp_path / "best" / ".metadata").is_file()  # the best epoch's DCP checkpoint
    folder = tmp_path / "checkpoints" / "ckpt-e0001-s0000000"
    assert (folder / ".metadata").is_file()
    assert len(list(folder.glob("*.distcp"))) == nproc  # each rank wrote its shard
    Net().load_state_dict(torch.load(tmp_path / "model_full.pt", weights_only=True))  # the export is a plain Net
