"""04_ddp_training/predict.py: predictions gathered on rank 0 equal a single process's, in dataset order.

101 test images do not divide by 2 or 3 ranks, so DistributedSampler pads (to 102 and 102) and
rank 0 must drop the duplicates. Real processes: torchrun on CPU with gloo.
"""
import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.errors import CourseError
from common.model import Net

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "04_ddp_training" / "predict.py"
N = 101


def predict(ckpt, data_dir, out, nproc=None, *extra):
    """Run predict.py under torchrun with `nproc` ranks, or as a plain `python` process if nproc is None."""
    launcher = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [sys.executable, *launcher, str(SCRIPT), "--checkpoint", str(ckpt), "--data", "synthetic",
           "--data-dir", data_dir, "--test-samples", str(N), "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error::DeprecationWarning,error::FutureWarning"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    torch.manual_seed(0)
    torch.save({"model": Net().state_dict()}, path)  # untrained: equality needs no accuracy
    return path


@pytest.fixture(scope="module")
def script():
    """predict.py imported into this process (the lesson folder is not a package)."""
    spec = importlib.util.spec_from_file_location("predict", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference(script, checkpoint, synthetic_dir, tmp_path_factory):
    """One process, no launcher (so no process group, no padding, no gather); in this process, to save a start-up."""
    out = tmp_path_factory.mktemp("single")
    script.main(["--checkpoint", str(checkpoint), "--data", "synthetic", "--data-dir", synthetic_dir,
                 "--test-samples", str(N), "--out", str(out)])
    return torch.load(out / "predictions.pt", weights_only=True)


# Both gathers and both splits (3 ranks: uneven shards); the walk of lesson 04's reference page runs 2 x tensor and
# 3 x object as a learner would.
@pytest.mark.parametrize("nproc,gather", [(2, "object"), (3, "tensor")])
def test_gathered_predictions_equal_one_process(checkpoint, synthetic_dir, reference, tmp_path, nproc, gather):
    result = predict(checkpoint, synthetic_dir, tmp_path, nproc, "--gather", gather)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]
    padded = -N % nproc  # 101 on 2 ranks: 51 + 51 = 102; on 3 ranks: 34 x 3 = 102
    assert f"{N} test images -> {-(-N // nproc)} per rank, {N + padded} in all (padding {padded})" in result.stdout
    assert f"removed {padded} padded duplicate(s): {N} predictions in dataset order" in result.stdout
    got = torch.load(tmp_path / "predictions.pt", weights_only=True)
    assert torch.equal(got["index"], reference["index"])  # same images, same order
    assert torch.equal(got["label"], reference["label"])
    assert torch.equal(got["predicted"], reference["predicted"])
    torch.testing.assert_close(got["probs"], reference["probs"], rtol=0, atol=1e-6)

    with open(tmp_path / "predictions.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["index", "label", "predicted"] + [f"p{k}" for k in range(10)]
    assert [int(r[0]) for r in rows[1:]] == list(range(N))  # exactly 101 rows, no padding copies
    assert [int(r[2]) for r in rows[1:]] == reference["predicted"].tolist()
    for name in ("confusion_matrix.png", "misclassified.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_checkpoint_path_is_one_error_line(synthetic_dir, tmp_path):
    result = predict(tmp_path / "missing.pt", synthetic_dir, tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --checkpoint") and result.stderr.count("\n") == 1, result.stderr


def test_checkpoint_formats_and_width(script, tmp_path):
    torch.manual_seed(0)
    wide = Net(width=2, blocks=1)
    torch.save(wide.state_dict(), tmp_path / "model_full.pt")  # the trainer's export: the bare state_dict
    model = script.load_model(tmp_path / "model_full.pt", None, torch.device("cpu"))  # width read from the shapes
    assert not model.training  # eval(): dropout off
    assert wide.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(wide.state_dict().values(), model.state_dict().values()))
    compiled = {"model": {f"_orig_mod.{k}": v for k, v in wide.state_dict().items()}}  # saved under torch.compile
    torch.save(compiled, tmp_path / "compiled.pt")
    script.load_model(tmp_path / "compiled.pt", 2, torch.device("cpu"))
    with pytest.raises(CourseError, match="is a Net of width 2, not --width 1: pass --width 2"):
        script.load_model(tmp_path / "model_full.pt", 1, torch.device("cpu"))
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CourseError, match="is not a checkpoint of torch.save"):
        script.load_model(tmp_path / "notes.txt", None, torch.device("cpu"))
    torch.save({"weights": [1, 2]}, tmp_path / "other.pt")
    with pytest.raises(CourseError, match="holds no weights of common.model.Net"):
        script.load_model(tmp_path / "other.pt", None, torch.device("cpu"))
