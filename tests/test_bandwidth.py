"""01_setup/allreduce_bandwidth.py: a real 2-rank gloo run prints the nccl-tests-style table and its JSON;
bad flags end in one `error:` line with exit code 2."""
import importlib.util
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "01_setup" / "allreduce_bandwidth.py"
ENV = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}}
ENV["OMP_NUM_THREADS"] = "1"


def load_script():
    spec = importlib.util.spec_from_file_location("allreduce_bandwidth", SCRIPT)  # 01_setup is not a package
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_ranks_print_the_table_and_write_the_json(tmp_path):
    out = tmp_path / "bw.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(SCRIPT), "--device", "cpu", "--min-bytes", "4K", "--max-bytes", "64K",
                          "--iters", "3", "--warmup", "1", "--json", str(out)],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Warning" not in run.stderr and "warn" not in run.stderr.lower(), run.stderr
    rows = [line.split() for line in run.stdout.splitlines() if line.strip() and not line.startswith("#")]
    sizes = [4096 * 2**i for i in range(5)]
    assert [int(r[0]) for r in rows] == sizes, run.stdout
    assert [int(r[1]) for r in rows] == [s // 4 for s in sizes]  # float32 elements
    assert all(r[5] == "0" for r in rows), run.stdout  # every sum was right
    for r in rows:  # printed with 3 decimals: busbw = algbw * 2(n-1)/n, = algbw for n = 2
        assert float(r[4]) == pytest.approx(float(r[3]) * 2 * (2 - 1) / 2, abs=1e-3)
    assert "2 rank(s), backend gloo" in run.stdout

    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo" and data["device"] == "cpu"
    assert [r["bytes"] for r in data["rows"]] == sizes
    for r in data["rows"]:
        assert r["time_us"] > 0 and r["wrong"] == 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] / 1e6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (2 - 1) / 2)


@pytest.mark.parametrize("n, factor", [(1, 0.0), (2, 1.0), (3, 4 / 3), (4, 1.5), (8, 1.75)])
def test_bus_bandwidth_is_what_each_link_carries_in_a_ring(n, factor):
    assert load_script().bus_bandwidth(10.0, n) == pytest.approx(10.0 * factor)


def test_message_sizes_double_from_min_to_max():
    sizes = load_script().message_sizes(4096, 256 * 2**20)
    assert sizes[0] == 4096 and sizes[-1] == 256 * 2**20 and len(sizes) == 17
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))


BAD_FLAGS = {
    "zero size": (["--min-bytes", "0"], "--min-bytes must be a positive multiple of 4"),
    "negative size": (["--max-bytes=-4K"], "--max-bytes must be a positive multiple of 4"),
    "min above max": (["--min-bytes", "1M", "--max-bytes", "4K"], "is larger than --max-bytes"),
    "not float32": (["--max-bytes", "4098"], "multiple of 4 bytes"),
    "not a size": (["--min-bytes", "lots"], "is not a number of bytes"),
    "no iterations": (["--iters", "0"], "--iters must be >= 1"),
    "unknown flag": (["--bogus"], "unrecognized arguments"),
}


@pytest.mark.parametrize("case", BAD_FLAGS)
def test_a_bad_flag_is_one_error_line(case, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    argv, message = BAD_FLAGS[case]
    assert load_script().cli(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_a_bad_flag_exits_with_code_2_from_the_command_line(capsys, monkeypatch):
    """The script's own __main__ (run in this process: no second torch import)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--min-bytes", "8M", "--max-bytes", "4M"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "error: --min-bytes (8388608) is larger than --max-bytes (4194304)\n"
