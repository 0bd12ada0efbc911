"""Lesson 01's exercises (01_setup/README.md#exercises): each solution run on CPU with gloo, and the outcome the
exercise asks the learner to see asserted. A patch is applied to a COPY of the lesson script in a tmp folder."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from common.distributed import free_port
from lessons import ROOT, SCRIPTS, assert_clean

SOLUTIONS = ROOT / "01_setup" / "solutions"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


def torchrun(script, nproc: int):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           str(script)], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=180)


def test_ex1_exact_mean_against_the_mean_of_means():
    proc = torchrun(SOLUTIONS / "exact_mean.py", 3)
    assert_clean(proc)
    ranks = re.findall(r"^\[rank (\d)\] (\d) values?, local mean (\S+)$", proc.stdout, re.M)
    assert sorted(ranks) == [("0", "1", "1.0000"), ("1", "2", "2.0000"), ("2", "3", "3.0000")]
    assert "exact mean (SUM of sums / SUM of counts): 2.3333 over 6 values\n" in proc.stdout  # 14 / 6
    assert "mean of the per-rank means (their SUM / 3 ranks): 2.0000\n" in proc.stdout  # (1 + 2 + 3) / 3


def test_ex2_broadcast_from_the_last_rank_and_the_check_that_must_follow(tmp_path):
    solved = tmp_path / "hello_solved.py"
    shutil.copy(SCRIPTS["01"], solved)
    subprocess.run(["patch", "--quiet", str(solved), str(SOLUTIONS / "broadcast_from_last_rank.patch")], check=True)
    text = solved.read_text()
    assert text.count('"broadcast": float(src),') == 1
    half = tmp_path / "hello_half.py"  # the source changed, the check still expects 42
    half.write_text(text.replace('"broadcast": float(src),', '"broadcast": 42.0,'))

    proc = torchrun(half, 3)
    assert proc.returncode != 0 and "OK:" not in proc.stdout
    failed = [line for line in proc.stdout.splitlines() if "FAILED" in line]
    assert sorted(failed) == [f"rank {r}: FAILED broadcast" for r in range(3)]  # every rank, each line whole

    proc = torchrun(solved, 3)
    assert_clean(proc)
    assert "OK: all_reduce, broadcast, all_gather and barrier verified on 3 rank(s)" in proc.stdout


def test_ex3_two_nodes_on_one_machine():
    venv_path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # torchrun, as in an activated venv
    proc = subprocess.run(["bash", str(SOLUTIONS / "two_nodes.sh")], capture_output=True, text=True,
                          env={**ENV, "MASTER_PORT": str(free_port()), "PATH": venv_path}, cwd=ROOT, timeout=180)
    assert_clean(proc)
    pairs = re.findall(r"\| rank (\d) of 4 \| local rank (\d) \|", proc.stdout)
    assert sorted(pairs) == [("0", "0"), ("1", "1"), ("2", "0"), ("3", "1")]  # node 1: ranks 2 and 3, local 0 and 1
    assert "OK: all_reduce, broadcast, all_gather and barrier verified on 4 rank(s)" in proc.stdout
