"""The lesson scripts stay teaching scripts: short, each a small diff from the one before, the taught call early."""
import ast
import subprocess

import pytest

from lessons import SCRIPTS

# lesson: (most lines, most changed lines from the lesson before, the lesson's first taught call)
TARGETS = {"02": (120, None, None), "03": (120, 40, "nn.DataParallel("), "04": (140, 60, "init_process_group("),
           "05": (160, 60, "fully_shard("), "06": (200, 120, "parallelize_module("),
           "07": (200, 120, "PipelineStage(")}
MOST_COMMON_NAMES = 8


def changed_lines(before, after) -> int:
    """Added plus removed lines, as `git diff --no-index --numstat` counts them."""
    out = subprocess.run(["git", "diff", "--no-index", "--numstat", str(before), str(after)],
                         capture_output=True, text=True).stdout
    added, removed, _ = out.split("\t", 2)
    return int(added) + int(removed)


@pytest.mark.parametrize("lesson", TARGETS)
def test_lesson_script_is_short_and_a_small_step(lesson):
    most_lines, most_changed, taught = TARGETS[lesson]
    path = SCRIPTS[lesson]
    lines = path.read_text().splitlines()
    assert len(lines) <= most_lines, f"{path.name}: {len(lines)} lines, target {most_lines}"
    if most_changed:
        before = SCRIPTS[f"{int(lesson) - 1:02d}"]
        assert changed_lines(before, path) <= most_changed
    if taught:
        first = next(i for i, line in enumerate(lines, 1) if taught in line)
        assert first <= len(lines) / 2, f"{path.name}: {taught} at line {first} of {len(lines)}"


@pytest.mark.parametrize("lesson", TARGETS)
def test_lesson_script_takes_little_from_common(lesson):
    """common/ gives the plumbing (setup, samplers, data, the CNN, flags, checkpoint folder); the lesson is in the file."""
    tree = ast.parse(SCRIPTS[lesson].read_text())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and (node.module or "").split(".")[0] == "common" for alias in node.names]
    assert len(names) <= MOST_COMMON_NAMES, names
