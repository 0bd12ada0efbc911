"""Lesson 03's exercises (03_dp_training/README.md#exercises), on CPU: each solution run, and the outcome the
exercise asks the learner to see asserted. A patch is applied to a COPY of the lesson script in a tmp folder."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from lessons import ROOT, SCRIPTS, assert_clean, run_script

SOLUTIONS = ROOT / "03_dp_training" / "solutions"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture
def small(synthetic_dir):
    return ["--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", "0", "--train-samples", 640,
            "--test-samples", 200, "--epochs", 1]


def python(*args):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=180)


def epoch_lines(out: str) -> list[str]:
    """The epoch lines without what varies from run to run (the seconds)."""
    return [re.sub(r", train [\d.]+ s$", "", line) for line in out.splitlines() if line.startswith("epoch ")]


def test_ex1_module_prefix_and_the_checkpoint_in_a_plain_net(tmp_path, small):
    lesson = run_script("03", *small, "--output-dir", tmp_path / "run")
    assert_clean(lesson)
    proc = python(SOLUTIONS / "load_into_plain_net.py", tmp_path / "run", *small[:4], "--test-samples", 200)
    assert_clean(proc)
    assert "nn.DataParallel(Net()).state_dict(): module.features.0.weight, module.features.0.bias, ..." in proc.stdout
    assert "Net().state_dict():                  features.0.weight, features.0.bias, ..." in proc.stdout
    assert "a plain Net given the wrapper's keys: 8 missing, 8 unexpected (e.g. module.features.0.weight)" in proc.stdout
    mine = re.search(r"^03-epoch-001\.pt in a plain Net: (\d+)/200 test images right", proc.stdout, re.M).group(1)
    theirs = re.search(r"^epoch 1: test loss [\d.]+, accuracy (\d+)/200,", lesson.stdout, re.M).group(1)
    assert mine == theirs and int(mine) > 20  # the same images right, and better than chance


def test_ex2_on_cpu_dataparallel_is_the_plain_module(tmp_path, small):
    proc = python(SOLUTIONS / "cpu_is_plain_module.py")
    assert_clean(proc)
    assert "device_ids asked for: [0, 1]; DataParallel kept: []" in proc.stdout
    assert "a batch of 64: same output True, same gradients True" in proc.stdout
    # ...so lesson 03 on a CPU trains exactly as lesson 02 does with the same flags
    lesson02 = run_script("02", *small, "--output-dir", tmp_path / "02")
    lesson03 = run_script("03", *small, "--output-dir", tmp_path / "03")
    assert_clean(lesson02)
    assert_clean(lesson03)
    assert epoch_lines(lesson02.stdout) == epoch_lines(lesson03.stdout) and len(epoch_lines(lesson03.stdout)) == 1


def test_ex3_two_of_four_gpus_patch_applies_and_runs_on_cpu(tmp_path, small):
    script = tmp_path / "dp.py"
    shutil.copy(SCRIPTS["03"], script)
    subprocess.run(["patch", "--quiet", str(script), str(SOLUTIONS / "two_of_four_gpus.patch")], check=True)
    assert "nn.DataParallel(model, device_ids=[0, 1])" in script.read_text()
    proc = python(script, *small, "--output-dir", tmp_path / "run")
    assert_clean(proc)  # on a CPU DataParallel ignores device_ids (exercise 2): the same one-process run
    assert proc.stdout.startswith("nn.DataParallel over 0 GPU(s)\n"), proc.stdout
