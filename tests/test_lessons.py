"""Every lesson script, run for real on CPU with gloo, on the synthetic MNIST files: what each prints and saves."""
import re

import pytest

import torch

from common.model import Net
from lessons import assert_clean, run_script

EPOCH = re.compile(r"^epoch (\d+): test loss ([\d.]+), accuracy (\d+)/(\d+), train [\d.]+ s$", re.M)


@pytest.fixture(scope="module")
def small(synthetic_dir):
    """Flags for a small, quick run on the shared synthetic data."""
    return ["--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", "0"]


def epochs(proc) -> list[tuple]:
    """(epoch, test loss, correct, count) of each epoch line."""
    return [(int(e), float(loss), int(c), int(n)) for e, loss, c, n in EPOCH.findall(proc.stdout)]


def test_hello_distributed_under_torchrun():
    proc = run_script("01", nproc=3)
    assert_clean(proc)
    assert "OK: all_reduce, broadcast, all_gather and barrier verified on 3 rank(s)" in proc.stdout
    assert sorted(re.findall(r"rank \d of 3", proc.stdout)) == ["rank 0 of 3", "rank 1 of 3", "rank 2 of 3"]


def test_02_trains_saves_each_epoch_and_resumes(small, tmp_path):
    proc = run_script("02", *small, "--train-samples", 1000, "--test-samples", 333, "--epochs", 2,
                      "--output-dir", tmp_path)
    assert_clean(proc)
    rows = epochs(proc)
    assert [(e, n) for e, _, _, n in rows] == [(1, 333), (2, 333)] and rows[-1][2] / 333 > 0.2  # above chance (0.1)
    ckpt = torch.load(tmp_path / "checkpoints" / "02-epoch-002.pt", weights_only=True)
    Net().load_state_dict(ckpt["model"])  # plain keys: loads into a plain Net
    assert ckpt["epoch"] == 2 and ckpt["optimizer"]["state"] and ckpt["scheduler"]["last_epoch"] == 2
    again = run_script("02", *small, "--train-samples", 1000, "--test-samples", 333, "--epochs", 2,
                       "--output-dir", tmp_path)  # the same folder without --resume: refused, nothing touched
    assert again.returncode == 2 and "holds checkpoints of an earlier run: continue it with --resume auto" in again.stderr
    more = run_script("02", *small, "--train-samples", 1000, "--test-samples", 333, "--epochs", 3,
                      "--output-dir", tmp_path, "--resume", "auto")
    assert_clean(more)
    assert "resumed from" in more.stdout and [e for e, *_ in epochs(more)] == [3]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["02-epoch-002.pt", "02-epoch-003.pt", "run.json"]


def test_03_dataparallel_on_cpu(small, tmp_path):
    proc = run_script("03", *small, "--train-samples", 640, "--test-samples", 200, "--epochs", 1,
                      "--output-dir", tmp_path)
    assert_clean(proc)
    assert "nn.DataParallel over 0 GPU(s)" in proc.stdout and [n for *_, n in epochs(proc)] == [200]
    Net().load_state_dict(torch.load(tmp_path / "checkpoints" / "03-epoch-001.pt", weights_only=True)["model"])


# 3 ranks, 7 test images in batches of 2: shards of 3, 2 and 2 images, so 2, 1 and 1 batches.
def test_04_ddp_under_torchrun(small, tmp_path):
    proc = run_script("04", *small, "--train-samples", 1200, "--test-samples", 7, "--test-batch-size", 2,
                      "--epochs", 1, "--output-dir", tmp_path, nproc=3)
    assert_clean(proc)
    assert sorted(re.findall(r"rank (\d) of 3 on cpu, 400 of 1200", proc.stdout)) == ["0", "1", "2"]
    assert [(e, n) for e, _, _, n in epochs(proc)] == [(1, 7)]  # every test image once; only rank 0 prints
    Net().load_state_dict(torch.load(tmp_path / "checkpoints" / "04-epoch-001.pt", weights_only=True)["model"])


def test_05_fsdp_joins_uneven_test_shards_writes_dcp_and_resumes(small, tmp_path):
    """FSDP all-gathers inside forward: the ranks with one test batch fewer must still join the last one (no hang)."""
    flags = [*small, "--train-samples", 1200, "--test-samples", 7, "--test-batch-size", 2, "--output-dir", tmp_path]
    proc = run_script("05", *flags, "--epochs", 1, nproc=3, env={"DIST_TIMEOUT_SECONDS": "60"})
    assert_clean(proc)
    assert [(e, n) for e, _, _, n in epochs(proc)] == [(1, 7)]
    folder = tmp_path / "checkpoints" / "05-epoch-001"
    assert (folder / ".metadata").is_file() and len(list(folder.glob("*.distcp"))) == 3  # each rank its shards
    more = run_script("05", *flags, "--epochs", 2, "--resume", "auto", nproc=2, env={"DIST_TIMEOUT_SECONDS": "60"})
    assert_clean(more)  # resharded: 3 ranks' shards read by 2
    assert [e for e, *_ in epochs(more)] == [2] and (tmp_path / "checkpoints" / "05-epoch-002" / ".metadata").is_file()


def test_05_trains_the_same_model_as_04(small, tmp_path):
    """FSDP2 shards what DDP replicates; the arithmetic is the same up to float rounding (2 ranks, measured equal
    to 4 digits on this machine's CPU: the tolerance is 1e-3 on the loss, 1 image on the count)."""
    flags = [*small, "--train-samples", 1000, "--test-samples", 500, "--epochs", 1]
    rows = [epochs(run_script(lesson, *flags, "--output-dir", tmp_path / lesson, nproc=2))[0] for lesson in ("04", "05")]
    (_, loss04, right04, _), (_, loss05, right05, _) = rows
    assert abs(loss04 - loss05) < 1e-3 and abs(right04 - right05) <= 1, rows


def test_06_tp_inside_fsdp_on_a_2x2_mesh_resumes_on_another(small, tmp_path):
    """4 ranks as 2 TP groups of 2: a group reads one batch, its 2 ranks each compute half of every block."""
    flags = [*small, "--train-samples", 800, "--test-samples", 101, "--output-dir", tmp_path]
    proc = run_script("06", *flags, "--epochs", 1, nproc=4)
    assert_clean(proc)
    assert len(re.findall(r"mesh \(dp \d, tp \d\) of \(2, 2\), 400 of 800 training images", proc.stdout)) == 4
    assert [(e, n) for e, _, _, n in epochs(proc)] == [(1, 101)]
    more = run_script("06", *flags, "--epochs", 2, "--resume", "auto", "--tp", 1, nproc=2)  # DCP reshards: 2 x 1
    assert_clean(more)
    assert [e for e, *_ in epochs(more)] == [2]


@pytest.mark.skipif(torch.__version__ < "2.10", reason="lesson 07 needs torch >= 2.10 (its one line on 2.9: "
                    "tests/test_pipeline_floor.py)")
def test_07_pipelines_join_uneven_test_shards(small, tmp_path):
    """2 pipelines of 2 stages; 9 test images in batches of 4: 5 and 4, so 2 and 1 batches, and FSDP2 all-gathers
    across the pipelines: the one with fewer batches must join the other's last one (it hung without)."""
    proc = run_script("07", *small, "--train-samples", 600, "--test-samples", 9, "--test-batch-size", 4,
                      "--microbatches", 2, "--dp", 2, "--epochs", 1, "--output-dir", tmp_path, nproc=4)
    assert_clean(proc)
    assert [(e, n) for e, _, _, n in epochs(proc)] == [(1, 9)]
    assert (tmp_path / "checkpoints" / "07-epoch-001" / ".metadata").is_file()
