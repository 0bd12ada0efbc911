"""Lesson 07, for real on CPU with gloo: every schedule's step against one process (gradients, loss, the division
by the micro-batches), the stages on the ranks the mesh says, pipeline x FSDP2 on a 2 x 2 mesh (its all-gathers per
step, checkpoints resumed by other layouts), the bubble's formulas and a measured timeline, the smallest example
(pp_minimal.py) and the script itself: stopped by SIGUSR1 mid-epoch, resumed with --resume auto.

Starting ranks is what costs (each imports torch): two launches of in-process ranks and four torchrun runs."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from common.exits import run
from common.launcher import launch
from common.model import Net
from lessons import INJECT, ROOT, assert_clean, metrics, run_trainer
from test_notebook_07 import check_step

import pp_workers  # tests/pp_workers.py: it puts lesson 07's folder on sys.path

import bubble  # noqa: E402  (07_pipeline_parallel/bubble.py)

def load_script(path):
    """A lesson script as a module (its folder starts with a digit: not importable by name); main() not run."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    check_gathers(results)
    check_relayout(results)


STAGE_BYTES = [4_926_464, 137_256]  # the lesson's stages (--blocks 4 --hidden 128) gathered: 1,231,616 and 34,314 x 4 B


def check_gathers(results: list[dict]) -> None:
    """FSDP2 on the pp x dp mesh, 1F1B: reshard_after_forward=True all-gathers each unit m + 1 times a step (each
    forward, and once for the backwards); the lesson's (False) once. The price: the stage's gathered weights are held
    from the first forward on; with True the backwards gather them all anyway (the same peak), but not the warm-up
    forwards."""
    for rank, r in enumerate(results):
        stage = rank // 2  # pp-rank: ranks 0, 1 hold stage 0, ranks 2, 3 stage 1
        for m in (2, 4):
            lazy, lesson = r["gathers"][(m, True)], r["gathers"][(m, None)]  # FSDP2's default, the lesson's
            assert lazy["all_gather"] == m + 1 and lesson["all_gather"] == 1, (m, lazy, lesson)
            assert lazy["reduce_scatter"] == lesson["reduce_scatter"] == 1, (m, lazy, lesson)
            assert lazy["full_bytes"] == lesson["full_bytes"] == STAGE_BYTES[stage], lesson
            assert lazy["units"] == lesson["units"] == [4, 3][stage]  # features, fc1, 2 blocks | 2 blocks, fc2
            assert max(b for _, b in lazy["held"]) == max(b for _, b in lesson["held"]) == STAGE_BYTES[stage]
            assert [b for _, b in lesson["held"][1:]] == [STAGE_BYTES[stage]] * (2 * m - 1), lesson["held"]
            warm_up = lazy["held"][:[k for k, _ in lazy["held"]].index("B")]  # 1F1B: 2 - stage forwards first
            assert warm_up == [("F", 0)] * (2 - stage), lazy["held"]
            assert lazy["after_step"] == lesson["after_step"] == 0  # step() ends with the shards alone


def check_relayout(results: list[dict]) -> None:
    """A pp 2 x dp 2 checkpoint resumed by 4 x 1 (1F1B, GPipe) and 2 x 2 interleaved (4 stages): every weight and
    optimizer value equal, by name. Mid-epoch, another --dp is refused in one line (its batches were cut for 2)."""
    refused = ("PATH/mid stopped at step 3 of epoch 1 with --dp 2: finish that epoch with --dp 2 (another "
               "--pp-schedule or number of stages may change; --dp after an epoch)")
    for r in results:
        trip = r["relayout"]
        assert len(trip["saved"]) > 100, trip["saved"]  # weights, and per parameter its optimizer state
        for key in ("4x1 1f1b end", "2x2 interleaved end", "4x1 gpipe end", "2x2 interleaved mid"):
            assert trip[key]["names"] == trip["saved"] and trip[key]["diff"] == 0.0, (key, trip[key])
            assert trip[key]["lr"] == pytest.approx(0.35), (key, trip[key])
        assert trip["4x1 1f1b mid"] == trip["4x1 gpipe mid"] == refused, trip


def test_the_bubble_formulas():
    assert [bubble.predict_idle("gpipe", 4, m) for m in (1, 4, 13)] == [3 / 4, 3 / 7, 3 / 16]
    assert bubble.predict_idle("1f1b", 2, 4) == bubble.predict_idle("gpipe", 2, 4) == 1 / 5  # the same bubble
    assert bubble.predict_idle("interleaved", 2, 4) == 1 / 9  # 2 stages per rank: (p - 1) / (2 m + p - 1)
    assert [bubble.held_microbatches("gpipe", 4, 8, r) for r in range(4)] == [8] * 4
    assert [bubble.held_microbatches("1f1b", 4, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert bubble.predict_idle_stages([2.0, 2.0], 4) == pytest.approx([1 / 5, 1 / 5])  # equal stages: the formula
    assert bubble.predict_idle_stages([4.0, 1.0], 4) == pytest.approx([1 - 4 / 4.25, 1 - 1 / 4.25])


def test_the_timelines_have_a_legend(tmp_path, monkeypatch):
    """bubble.png says which colour is a forward, a backward (and a weight backward, zb) and which is idle."""
    import matplotlib.pyplot as plt

    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)
    timelines = [[("F", 0, 0.0, 0.01), ("B", 0, 0.02, 0.04)], [("F", 0, 0.01, 0.02), ("B", 0, 0.02, 0.03)]]
    bubble.plot([{"schedule": "gpipe", "microbatches": 1, "pp": 2, "timelines": timelines, "idle_measured": 0.5,
                  "idle_predicted": 0.5}], tmp_path / "bubble.png")
    [legend] = drawn[0].legends
    assert [t.get_text() for t in legend.get_texts()] == ["forward of micro-batch n", "backward of micro-batch n",
                                                          "idle: the bubble"]
    assert (tmp_path / "bubble.png").stat().st_size > 5_000


def test_microbatches_not_dividing_the_batch_is_one_line(tmp_path, capsys):
    """The teaching script's own check (the trainer's rows, --grad-accum among them: tests/bad_inputs.py); below the
    torch floor: test_pipeline_floor.py."""
    lesson = load_script(ROOT / "07_pipeline_parallel" / "mnist_ppmodel.py")
    with pytest.raises(SystemExit) as exit_:
        run(lesson.main, ["--microbatches", "3", "--output-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err, err
    assert err.startswith("error: --microbatches 3 must divide --batch-size and --test-batch-size"), err


def test_the_smallest_example_under_torchrun():
    """pp_minimal.py, as the README starts it: 2 gloo ranks, what each one ran, got and sent, in rank order."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "07_pipeline_parallel" / "pp_minimal.py"), "--schedule", "1f1b"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert_clean(proc)
    check_step(proc.stdout, "1f1b", ("F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"))


def test_the_smallest_example_under_plain_python(capsys, monkeypatch):
    import pp_minimal

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        run(pp_minimal.main, [])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err == ("error: pp_minimal.py cuts its model in two, a stage per process: start "
                                             "it with torchrun --standalone --nproc_per_node=2"), err


def test_the_trainers_pp_stops_on_sigusr1_saves_and_resumes(synthetic_dir, tmp_path):
    """trainer --parallel pp, 2 ranks, 1F1B: 25 steps an epoch; rank 1 gets SIGUSR1 at step 5, every rank stops at step 20 (the vote of
    step 10, read at step 20) and saves its stage; --resume auto finishes the epoch and a second one."""
    out = tmp_path / "run"
    args = ["--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", 0, "--train-samples", 207,
            "--test-samples", 101, "--batch-size", 8, "--test-batch-size", 40, "--epochs", 2, "--output-dir", out]
    proc = run_trainer("pp", *args, nproc=2, env={**INJECT, "FAIL_AT_STEP": "1:5:USR1"})
    assert_clean(proc)
    assert "lesson 07: 2 processes, mesh pp 2 x dp 1, 1f1b: 2 stages" in proc.stdout, proc.stdout
    assert "stopped by SIGUSR1 at epoch 1 step 20, checkpoint saved" in proc.stdout, proc.stdout
    saved = out / "checkpoints" / "ckpt-e0000-s0000020"
    assert (saved / ".metadata").is_file() and len(list(saved.glob("*.distcp"))) == 2  # each rank its own stage
    proc = run_trainer("pp", *args, "--resume", "auto", nproc=2)
    assert_clean(proc)
    assert "continuing at epoch 1 step 20" in proc.stdout, proc.stdout
    rows = metrics(out)["epochs"]
    assert [r["epoch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["test_samples"] == 101  # every test image once: the last stage's counts, the padding not counted
        assert 0 < r["train_loss"] < 2.5 and 0.0 <= r["test_accuracy"] <= 1.0
    plain = Net(blocks=4)  # the lesson's default --blocks
    plain.load_state_dict(torch.load(out / "model_full.pt", weights_only=True))  # every stage's weights, gathered
