"""Lesson 08's exercises: each solution runs as the README says (python, gloo ranks through common.launcher) and
prints the answer the exercise asks for: the rows each of 3 ranks reads, and what the export dtype keeps."""
import os
import re
import subprocess
import sys

import pytest

from lessons import ROOT

pytestmark = pytest.mark.timeout(400)


def solution(name: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "08_your_model" / "solutions" / name)],
                          capture_output=True, text=True, timeout=360, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Warning" not in out, out[-3000:]
    return proc.stdout


def test_1_three_ranks_read_15_15_and_13_rows_and_give_from_pretrained_logits():
    out = solution("three_ranks.py")
    assert out.startswith("predicted rows per rank on 3 ranks: embedding (43) [15, 15, 13], q_proj (32) [11, 11, 10]")
    shown = re.findall(r"model.embed_tokens.weight: full \[43, 32\], mine \[(\d+), 32\]", out)
    assert shown == ["15", "15", "13"], out
    assert re.findall(r"q_proj.weight: full \[32, 32\], mine \[(\d+), 32\]", out) == ["11", "11", "10"], out
    assert out.count("read 26 tensors from 5 safetensors files") == 3, out
    diffs = [float(x) for x in re.findall(r"max \|sharded - from_pretrained\| = (\S+);", out)]
    assert len(diffs) == 3 and max(diffs) <= 1e-5, out


def test_2_bfloat16_halves_the_files_and_float32_keeps_the_logits():
    out = solution("export_dtype.py")
    rows = dict((d, (int(b.replace(",", "")), float(x))) for d, b, x in re.findall(
        r"--export-dtype (\w+)\s*: ([\d,]+) bytes of safetensors, max \|logits - the sharded model's\| (\S+)", out))
    assert set(rows) == {"float32", "bfloat16"}, out
    assert rows["float32"][1] == 0.0, out  # the master weights, bit for bit
    assert 1e-4 < rows["bfloat16"][1] < 0.05, out  # measured 3.2e-03 here: rounded weights, nearby logits
    assert 0.49 < rows["bfloat16"][0] / rows["float32"][0] < 0.52, out  # 2 bytes a number against 4, headers aside
    assert "bfloat16 / float32 bytes: 0.501" in out, out
