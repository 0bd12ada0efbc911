"""Lesson 07, for real on CPU with gloo: every schedule's step against one process (gradients, loss, the division
by the micro-batches), the stages on the ranks the mesh says, pipeline x FSDP2 on a 2 x 2 mesh, the bubble's
formulas and a measured timeline, and the script itself: stopped by SIGUSR1 mid-epoch, resumed with --resume auto.

Starting ranks is what costs (each imports torch): two launches of in-process ranks and two torchrun runs."""
import sys

import pytest
import torch
from torch.torch_version import TorchVersion

from common.exits import run
from common.launcher import launch
from common.model import Net
from lessons import INJECT, ROOT, assert_clean, metrics, run_script

sys.path.insert(0, str(ROOT / "07_pipeline_parallel"))
import bubble  # noqa: E402
import pp_workers  # noqa: E402

FLOOR = "lesson 07 needs torch >= 2.10: torch 2.9's pipeline stages fail over gloo (pytorch/pytorch#165539)"
pytestmark = pytest.mark.skipif(torch.__version__ < "2.10", reason=FLOOR)
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb"]
M = 4  # micro-batches (pp_workers' default)


def check_equal(results: list[dict], name: str, pp: int) -> None:
    """Each rank's gradients equal one process's on the global batch; with scale_grads=False, M times them."""
    per_rank = [r[name] for r in results]
    for r in per_rank:
        assert r["initial_diff"] == 0.0  # init_weights draws what Net() draws after the same seed
        assert r["grad_diff_True"] < 1e-5 and r["grad_diff_False"] < 1e-5 * M, r  # default: divided by M
        # the stages on the ranks the mesh says: stage i on pp-rank i; interleaved stages i and i + pp
        assert (r["pp_rank"], r["dp_rank"]) == divmod(r["rank"], len(results) // pp)
        per = 2 if name in ("interleaved", "zb") else 1
        assert r["ids"] == [r["pp_rank"] + k * pp for k in range(per)] and r["count"] == per * pp
    lasts = [r for r in per_rank if r["count"] - 1 in r["ids"]]
    assert len(lasts) == len(results) // pp  # one last stage per pipeline: it alone has the losses
    for r in lasts:
        assert r["losses"] == M and r["loss_diff_True"] < 1e-5 and r["loss_diff_False"] < 1e-5


def check_roundtrip(results: list[dict]) -> None:
    """The lesson's DCP checkpoint, read back into a fresh model and optimizer: every stage gets ITS state back."""
    for r in results:
        trip = r["roundtrip"]
        assert trip["weights"] == 0.0 and trip["state"] == 0.0, trip
        assert trip["lr"] == [pytest.approx(0.35)], trip  # the param groups too (one rank's names would not do)


def test_every_schedule_equals_one_process_on_2_ranks(tmp_path):
    results = launch(pp_workers.checks, nprocs=2, args=(1, SCHEDULES, str(tmp_path / "ckpt")), timeout_s=240)
    for name in SCHEDULES:
        check_equal(results, name, pp=2)
    check_roundtrip(results)
    head = ["features.0.bias", "features.0.weight", "features.3.bias", "features.3.weight", "fc1.bias", "fc1.weight"]
    block = lambda i: [f"blocks.{i}.fc.bias", f"blocks.{i}.fc.weight"]  # noqa: E731
    assert results[0]["1f1b"]["names"] == sorted(head + block(0) + block(1))  # Net's names: DCP keys unique
    assert results[1]["1f1b"]["names"] == sorted(block(2) + block(3) + ["fc2.bias", "fc2.weight"])
    assert results[0]["interleaved"]["names"] == sorted(head + block(0) + block(2))  # stages 0 and 2
    assert results[1]["interleaved"]["names"] == sorted(block(1) + block(3) + ["fc2.bias", "fc2.weight"])
    row = results[0]["bubble"]
    assert row == results[1]["bubble"]  # every rank gets the same row
    assert row["idle_predicted"] == pytest.approx(1 / 5) and row["pp"] == 2 and row["s_per_step"] > 0
    assert all(0 <= x < 1 for x in row["idle_per_rank"] + row["idle_predicted_per_rank"]), row
    assert row["held_microbatches"] == [4, 4] and row["peak_memory_bytes"] == [None, None]  # CPU: no peak
    kinds = [[kind for kind, *_ in t] for t in row["timelines"]]
    assert all(k.count("F") == k.count("B") == M for k in kinds), kinds  # gpipe: m forwards, then m backwards
    assert all(k == ["F"] * M + ["B"] * M for k in kinds), kinds


def test_pipeline_x_fsdp2_on_a_2x2_mesh_equals_one_process(tmp_path):
    results = launch(pp_workers.checks, nprocs=4, args=(2, ["1f1b", "interleaved"], str(tmp_path / "ckpt")),
                     timeout_s=240)
    for name in ("1f1b", "interleaved"):
        check_equal(results, name, pp=2)
    check_roundtrip(results)


def test_the_bubble_formulas():
    assert [bubble.predict_idle("gpipe", 4, m) for m in (1, 4, 13)] == [3 / 4, 3 / 7, 3 / 16]
    assert bubble.predict_idle("1f1b", 2, 4) == bubble.predict_idle("gpipe", 2, 4) == 1 / 5  # the same bubble
    assert bubble.predict_idle("interleaved", 2, 4) == 1 / 9  # 2 stages per rank: (p - 1) / (2 m + p - 1)
    assert [bubble.held_microbatches("gpipe", 4, 8, r) for r in range(4)] == [8] * 4
    assert [bubble.held_microbatches("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert bubble.predict_idle_stages([2.0, 2.0], 4) == pytest.approx([1 / 5, 1 / 5])  # equal stages: the formula
    assert bubble.predict_idle_stages([4.0, 1.0], 4) == pytest.approx([1 - 4 / 4.25, 1 - 1 / 4.25])


@pytest.mark.parametrize("argv, message", [
    (["--microbatches", "3"], "error: argument --microbatches: 3 does not divide --batch-size 64: pick a divisor"),
    (["--grad-accum", "2"], "error: argument --grad-accum: a pipeline accumulates its micro-batches already"),
    ([], "error: lesson 07 needs torch >= 2.10 (torch 2.9.1's pipeline stages fail over gloo"),
])
def test_one_line_errors(argv, message, tmp_path, capsys, monkeypatch):
    if not argv:  # the floor, as torch 2.9.1 would report it
        monkeypatch.setattr(torch, "__version__", TorchVersion("2.9.1"))
    with pytest.raises(SystemExit) as exit_:
        run(pp_workers.lesson().main, [*argv, "--output-dir", tmp_path / "r"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err and err.startswith(message), err


def test_the_script_stops_on_sigusr1_saves_and_resumes(synthetic_dir, tmp_path):
    """2 ranks, 1F1B: 25 steps an epoch; rank 1 gets SIGUSR1 at step 5, every rank stops at step 20 (the vote of
    step 10, read at step 20) and saves its stage; --resume auto finishes the epoch and a second one."""
    out = tmp_path / "run"
    args = ["--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", 0, "--train-samples", 207,
            "--test-samples", 101, "--batch-size", 8, "--test-batch-size", 40, "--epochs", 2, "--output-dir", out]
    proc = run_script("07", *args, nproc=2, env={**INJECT, "FAIL_AT_STEP": "1:5:USR1"})
    assert_clean(proc)
    assert "lesson 07: 2 processes, mesh pp 2 x dp 1, 1f1b: 2 stages" in proc.stdout, proc.stdout
    assert "stopped by SIGUSR1 at epoch 1 step 20, checkpoint saved" in proc.stdout, proc.stdout
    saved = out / "checkpoints" / "ckpt-e0000-s0000020"
    assert (saved / ".metadata").is_file() and len(list(saved.glob("*.distcp"))) == 2  # each rank its own stage
    proc = run_script("07", *args, "--resume", "auto", nproc=2)
    assert_clean(proc)
    assert "continuing at epoch 1 step 20" in proc.stdout, proc.stdout
    rows = metrics(out)["epochs"]
    assert [r["epoch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["test_samples"] == 101  # every test image once: the last stage's counts, the padding not counted
        assert 0 < r["train_loss"] < 2.5 and 0.0 <= r["test_accuracy"] <= 1.0
    plain = Net(blocks=4)  # the lesson's default --blocks
    plain.load_state_dict(torch.load(out / "model_full.pt", weights_only=True))  # every stage's weights, gathered
