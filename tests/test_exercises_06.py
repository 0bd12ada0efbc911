"""Lesson 06's exercises: each solution runs as the README says (python, two gloo ranks through common.launcher)
and prints the answer the exercise asks for."""
import os
import re
import subprocess
import sys

from lessons import ROOT


def solution(name: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "06_tensor_parallel" / "solutions" / name)], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Warning" not in out, out[-3000:]
    return proc.stdout


def test_1_collectives_predicted_equal_counted():
    out = solution("count_collectives.py")
    assert "mesh 1 x 2, --blocks 3: predicted {'all_reduce': 6}, counted {'all_reduce': 6}: equal" in out, out
    assert ("mesh 2 x 1, --blocks 3: predicted {'all_gather': 12, 'reduce_scatter': 6}, "
            "counted {'all_gather': 12, 'reduce_scatter': 6}: equal") in out, out


def test_2_peers_must_share_the_batch_and_the_norm_counts_pieces_once():
    out = solution("peers_must_agree.py")
    wrong = [float(x) for x in re.search(r"differs from the plain model's by ([\d.]+) \(batch 0\) and ([\d.]+)",
                                         out).groups()]
    assert min(wrong) > 1e-2 and float(re.search(r"the same batch: (\S+)", out).group(1)) < 1e-5, out
    plain, trainer, naive = map(float, re.search(r"plain model ([\d.]+), trainer's clip_grad_norm ([\d.]+), "
                                                 r"local squares summed over ranks ([\d.]+)", out).groups())
    assert trainer == plain and naive > 1.2 * plain, out
    twice = out.split("counted twice: ")[1].split(", ")
    assert "blocks.0.down.bias" in twice and "fc1.weight" in twice and "blocks.0.up.weight" not in twice, out
