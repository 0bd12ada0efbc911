"""Lesson 06's notebook, executed headless on the CPU (2 gloo ranks per cell): what it showed the learner."""
import re

import nbformat

from lessons import ROOT
from test_notebooks import execute

NOTEBOOK = "06_tensor_parallel/tensor_parallel.ipynb"


def test_committed_without_outputs():
    book = nbformat.read(ROOT / NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in book.cells if c.cell_type == "code")


def test_placements_pair_by_hand_and_the_comm_table(synthetic_dir, tmp_path, monkeypatch):
    nb = execute(NOTEBOOK, synthetic_dir, tmp_path, monkeypatch)
    held = nb.cell("w.show_placements")
    assert "[rank 0] Shard(dim=0)  local (2, 4): [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]" in held, held
    assert "[rank 1] Shard(dim=1)  local (4, 2): [[2.0, 3.0], [6.0, 7.0], [10.0, 11.0], [14.0, 15.0]]" in held, held
    assert held.count("Replicate()   local (4, 4)") == 2 and held.count("full_tensor() (the sum over ranks) [3.0, 3.0]") == 2
    rows, cols = held.split("visualize_sharding, Shard(dim=0)")[1].split("visualize_sharding, Shard(dim=1)")
    assert "Row 0-1  cpu:0" in rows and "Row 2-3  cpu:1" in rows, held  # rows 0-1 on rank 0, 2-3 on rank 1
    assert re.search(r"Row 0-3\s+cpu:0\s+cpu:1", cols), held  # columns 0-1 on rank 0, 2-3 on rank 1
    pair = nb.cell("w.pair_by_hand")
    diffs = [float(x) for x in re.findall(r"= (\S+),", pair)]
    assert len(diffs) == 4 and max(diffs) < 1e-6, pair  # by hand and parallelize_module equal the whole block
    assert pair.count("parallelize_module's collectives {'all_reduce': 1}") == 2, pair  # forward: one per pair
    table = nb.cell("w.comm_table")
    assert table.count("mesh dp 1 x tp 2: {'all_reduce': 4}") == 2, table  # 2 blocks x (forward + backward)
    up = table.index("FSDPTPNet.blocks.0.up")
    assert table[up:].split("\n")[1].strip() == "BACKWARD PASS", table  # up's input gradient
    down = table.index("FSDPTPNet.blocks.0.down")
    assert table[down:].split("\n")[1].strip() == "FORWARD PASS", table  # down's partial sums
