"""The training recipe flags: the learning rate each step really uses, on 1 and 3 ranks, and --target-accuracy."""
import pytest

import workers
from common.launcher import launch
from lessons import assert_clean, metrics, run_trainer

RECIPE = dict(optimizer="sgd", lr=0.1, lr_scaling="linear", schedule="step", gamma=0.5, warmup_steps=4,
              epochs=2, grad_accum=1)


def lrs(nprocs, steps_per_epoch=6, **changes):
    return launch(workers.lr_per_step, nprocs=nprocs, args=({**RECIPE, **changes}, steps_per_epoch), timeout_s=120)


def test_linear_scaling_with_warmup_and_step_decay_on_1_and_3_ranks():
    one, = lrs(1)
    three = lrs(3)
    assert three[0] == three[1] == three[2]  # every rank uses the same schedule
    ramp = [0.1 * k / 4 for k in (1, 2, 3, 4)]
    assert one == pytest.approx(ramp + [0.1, 0.1] + [0.05] * 6)  # warm-up, then x gamma after epoch 1
    assert three[0] == pytest.approx([3 * lr for lr in one])  # linear rule: lr x world size


def test_sqrt_scaling_counts_accumulation_steps_too():
    two, _ = lrs(2, lr_scaling="sqrt", grad_accum=2, warmup_steps=0)
    assert two[0] == pytest.approx(0.1 * 2)  # sqrt(2 ranks x 2 micro-batches)


def test_onecycle_rises_then_anneals():
    used, = lrs(1, optimizer="adamw", lr=6e-3, lr_scaling="none", schedule="onecycle", warmup_steps=3)
    peak = used.index(max(used))
    assert peak == 2 and max(used) == pytest.approx(6e-3)  # the 3rd step is the first at full lr, as with "step"
    assert used[0] < 1e-3 and used[-1] < 1e-5  # starts low, ends near zero


def test_target_accuracy_ends_the_run_and_records_the_time(synthetic_dir, tmp_path):
    proc = run_trainer("single", "--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", 0,
                      "--train-samples", 2000, "--test-samples", 500, "--epochs", 5, "--optimizer", "adamw",
                      "--lr", "3e-3", "--target-accuracy", 0.8, "--output-dir", tmp_path)
    assert_clean(proc)
    m = metrics(tmp_path)
    rows = m["epochs"]
    assert rows[-1]["test_accuracy"] >= 0.8 and all(r["test_accuracy"] < 0.8 for r in rows[:-1])
    assert len(rows) < 5  # stopped early
    assert m["time_to_target_seconds"] == pytest.approx(sum(r["epoch_seconds"] for r in rows))
    assert m["warmup_seconds"] > 0
    assert "target accuracy 0.8 reached after" in proc.stdout
