"""Lesson 07's notebook, executed headless on the CPU (2 gloo ranks per cell): what it showed the learner."""
import re

import nbformat
import pytest
import torch

from lessons import ROOT
from test_notebooks import execute

NOTEBOOK = "07_pipeline_parallel/pipeline.ipynb"
FLOOR = "lesson 07 needs torch >= 2.10: torch 2.9's pipeline stages fail over gloo (pytorch/pytorch#165539)"
pytestmark = pytest.mark.skipif(torch.__version__ < "2.10", reason=FLOOR)


def test_committed_without_outputs():
    book = nbformat.read(ROOT / NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in book.cells if c.cell_type == "code")
    ids = [c.get("id") for c in book.cells]
    assert None not in ids and len(set(ids)) == len(ids), ids


def by_rank(text: str) -> dict[int, str]:
    """A cell's lines by the rank that printed them (the launcher prints rank 0's, then rank 1's; each starts with
    its stage line)."""
    first = text.index("stage 1 of 2")
    return {0: text[:first], 1: text[first:]}


def check_step(text: str, schedule: str, orders: tuple[str, str]) -> None:
    ranks = by_rank(text)
    assert ranks[0].startswith("stage 0 of 2 (0: Linear, 1: ReLU): 56 parameters"), text
    assert ranks[1].startswith("stage 1 of 2 (2: Linear, 3: ReLU, 4: Linear): 99 parameters"), text
    for rank, order in enumerate(orders):
        assert f"{schedule}, 4 micro-batches of 2; order: {order}\n" in ranks[rank], text
    for mb in range(4):  # what each rank got and passed on, per micro-batch
        assert f"  F{mb}: images (2, 6) of micro-batch {mb} -> sends (2, 8) to rank 1\n" in ranks[0], text
        assert f"  B{mb}: receives the gradient (2, 8) from rank 1 -> the gradients of layer 0\n" in ranks[0], text
        assert f"  F{mb}: receives (2, 8) from rank 0 -> output (2, 3) -> loss\n" in ranks[1], text
        assert f"  B{mb}: sends the gradient (2, 8) of what it received back to rank 0\n" in ranks[1], text
    assert "losses of the" not in ranks[0], text  # the last stage alone computes the loss
    losses = [float(x) for x in re.search(r"losses of the 4 micro-batches: \[(.*)\]", ranks[1]).group(1).split(", ")]
    mean, whole = map(float, re.search(r"their mean (\S+); one process, the whole batch: (\S+)", ranks[1]).groups())
    assert len(losses) == 4 and abs(sum(losses) / 4 - mean) < 1e-3 and abs(mean - whole) < 1e-5, text
    diffs = [float(x) for x in re.findall(r"max \|grad - one process's grad\| over .*: (\S+)", text)]
    assert len(diffs) == 2 and max(diffs) < 1e-6, text
    assert "over 0.weight, 0.bias:" in ranks[0] and "over 2.weight, 2.bias, 4.weight, 4.bias:" in ranks[1], text


def test_stages_schedules_and_the_bubble(synthetic_dir, tmp_path, monkeypatch):
    nb = execute(NOTEBOOK, synthetic_dir, tmp_path, monkeypatch)
    cut = nb.cell("model[:2], model[2:]")
    assert "stage 0: ['0: Linear(in_features=6, out_features=8, bias=True)', '1: ReLU()'], 56 parameters" in cut, cut
    assert "stage 1: ['2: Linear(in_features=8, out_features=8, bias=True)', '3: ReLU()', " in cut, cut
    assert cut.rstrip().endswith("99 parameters"), cut
    gpipe, one_f_one_b = nb.cell('args=("gpipe",)'), nb.cell('args=("1f1b",)')
    check_step(gpipe, "gpipe", ("F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3"))
    check_step(one_f_one_b, "1f1b", ("F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"))
    losses = [re.search(r"losses of the .*", text).group(0) for text in (gpipe, one_f_one_b)]
    assert losses[0] == losses[1], losses  # another order, the same micro-batches

    assert nb.lines("bubble.predict_idle") == [
        f"p 2, m {m}: predicted idle (p - 1) / (m + p - 1) = {x}" for m, x in
        ((1, "0.500"), (2, "0.333"), (4, "0.200"), (8, "0.111"))]
    table = nb.lines("bubble.table(rows)")
    assert table[0].split()[:4] == ["schedule", "m", "balanced", "per"], table
    rows = [line.split() for line in table[1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("gpipe", "1", "0.500"), ("gpipe", "2", "0.333"),
                                                  ("gpipe", "4", "0.200"), ("gpipe", "8", "0.111")], table
    # Timings, so ranges (tests/test_exercises_07.py says what they were here): rank by rank, measured idle 0..1,
    # the step's time positive, and the bubble with 1 micro-batch (a rank waits for the other's whole step) near 1/2.
    measured = [(float(r[5]), float(r[6])) for r in rows]
    assert all(0 <= x < 1 for pair in measured for x in pair) and all(float(r[7]) > 0 for r in rows), table
    assert 0.3 < sum(measured[0]) / 2 < 0.7, table
    assert re.search(r"timelines: \S+/bubble\.png", nb.cell("bubble.plot")), nb.cell("bubble.plot")
    assert (tmp_path / "run" / "bubble.png").stat().st_size > 10_000
