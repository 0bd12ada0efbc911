"""Lesson 02's exercises (02_singlegpu_training/README.md#exercises): each solution run on CPU as the README
says, the outcome the exercise asks the learner to see asserted, and nothing left in the lesson folder."""
import re
import subprocess
import sys

import pytest

from lessons import ROOT, SCRIPTS, assert_clean

LESSON = ROOT / "02_singlegpu_training"
SOLUTIONS = LESSON / "solutions"


@pytest.fixture
def lesson_folder_untouched():
    """Fails the test if a run created or removed anything in the lesson folder (bytecode caches aside: other
    tests import the lesson script, at the same time under `make test`)."""
    def listing():
        return sorted(p for p in LESSON.rglob("*") if "__pycache__" not in p.parts)
    before = listing()
    yield
    assert listing() == before


def solution(name, *args, timeout=600):  # resume_check.py: 3 runs of the lesson, slow on a busy machine
    proc = subprocess.run([sys.executable, str(SOLUTIONS / name), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert_clean(proc)
    return proc.stdout


def verdicts(out):
    """{epoch: "same" or "DIFFERENT"} from resume_check.py's report."""
    return {int(epoch): verdict for epoch, verdict in re.findall(r"^epoch (\d+): (same|DIFFERENT)$", out, re.M)}


def test_exercise_1_grad_accum_4_of_16_is_one_batch_of_64(lesson_folder_untouched):
    out = solution("grad_accum.py")
    off, on = (float(x) for x in re.findall(r"largest weight difference after one step (\S+)", out))
    step = float(re.search(r"moved weights by up to (\S+)\)", out).group(1))
    assert off < 1e-6 < step, out  # the same step, up to float rounding
    assert on > 1e-4, out  # dropout draws its masks per micro-batch: then they differ


def test_exercise_2_a_resumed_run_draws_another_epoch_2(tmp_path, synthetic_dir, lesson_folder_untouched):
    out = solution("resume_check.py", tmp_path / "ex2", "--data-dir", synthetic_dir)
    assert re.search(r"^resumed from .*/checkpoints/02-epoch-001\.pt$", out, re.M), out
    assert verdicts(out) == {1: "same", 2: "DIFFERENT"}, out


def test_exercise_3_with_the_generator_in_the_checkpoint_the_resumed_run_is_exact(tmp_path, synthetic_dir,
                                                                                  lesson_folder_untouched):
    copy = tmp_path / "keep_rng.py"  # the patched script goes to a copy (patch -o), as the README does it
    subprocess.run(["patch", "--quiet", "-o", str(copy), str(SCRIPTS["02"]), str(SOLUTIONS / "keep_rng.patch")],
                   check=True)
    assert '"rng": torch.get_rng_state()' in copy.read_text()
    out = solution("resume_check.py", tmp_path / "ex3", "--script", copy, "--data-dir", synthetic_dir)
    assert verdicts(out) == {1: "same", 2: "same"}, out
