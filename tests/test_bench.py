"""The benchmark harness, in its CPU smoke mode: every lesson runs, the page and the plots appear."""
import json
import subprocess
import sys

from lessons import ROOT


def test_quick_benchmark_writes_table_and_plots(synthetic_dir, tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/bench.py", "--quick", "--out", str(tmp_path),
                           "--data-dir", synthetic_dir], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    page = (tmp_path / "benchmarks.md").read_text()
    for lesson in ("02 single GPU", "03 DataParallel", "04 DDP", "05 FSDP2"):
        assert f"| {lesson} |" in page
    assert "| 04 DDP | 2 | 32 | dataloader |" in page and "scaling vs 1 GPU" in page
    for png in ("throughput.png", "scaling.png", "memory.png"):
        assert (tmp_path / png).stat().st_size > 5000
    rows = json.loads((tmp_path / "benchmarks.json").read_text())["rows"]
    assert all(r["images_per_second"] > 0 and r["test_accuracy"] >= 0 for r in rows)
    assert {(r["lesson"], r["gpus"]) for r in rows} >= {("02", 1), ("03", 2), ("04", 1), ("04", 2), ("05", 2)}
