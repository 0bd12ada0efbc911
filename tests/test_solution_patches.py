"""Every solution patch applies to the lesson script as it is now: no fuzz, no offset.

Fast (`patch` on copies, no training). A patch made against an older script still applies with fuzz or at
another line, and `patch` then prints a `Hunk #1 succeeded at ... (offset -4 lines)` line that the pages do
not show, or it fails. Each `NN_name/solutions/*.patch` names its file: `--- a/PATH` (from the course
folder, for `patch -p1`) or `--- NAME` (the lesson's script, patched as a copy); a patch whose text says
`Apply on top of OTHER.patch` is applied after that one, as its page does.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lessons import ROOT

PATCHES = sorted(ROOT.glob("0*/solutions/*.patch"))


def target(patch: Path) -> Path:
    name = re.search(r"^--- (\S+)", patch.read_text(encoding="utf-8"), re.M).group(1)
    return ROOT / name[2:] if name.startswith("a/") else patch.parent.parent / name


def chain(patch: Path) -> list[Path]:
    """The patches to apply, in order: those it must be applied on top of, then itself."""
    before = re.search(r"Apply on top of (\S+\.patch)", patch.read_text(encoding="utf-8"))
    return (chain(patch.parent / before.group(1)) if before else []) + [patch]


def apply_exactly(script: Path, patches: list[Path], folder: Path) -> list[str]:
    """`patch --fuzz=0` on a copy of the script, patch after patch: what went wrong, or nothing."""
    copy = folder / script.name
    shutil.copy(script, copy)
    problems = []
    for patch in patches:
        done = subprocess.run(["patch", "--fuzz=0", "--batch", str(copy), str(patch)],
                              capture_output=True, text=True, timeout=30)
        extra = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("patching file")]
        if done.returncode or extra:
            problems.append(f"{patch.name} (exit {done.returncode}): " + " / ".join(extra))
    return problems


def test_the_patches_are_found():
    """The lessons whose exercises are patches: an empty glob would check nothing."""
    assert {p.parts[-3] for p in PATCHES} == {"01_setup", "02_singlegpu_training", "03_dp_training",
                                              "04_ddp_training"}


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: f"{p.parts[-3]}/{p.name}")
def test_patch_applies_to_the_current_script(patch, tmp_path):
    problems = apply_exactly(target(patch), chain(patch), tmp_path)
    assert not problems, f"regenerate it from {target(patch).relative_to(ROOT)} (diff -u):\n  " + "\n  ".join(problems)


def test_the_check_fails_on_a_stale_patch(tmp_path):
    script = tmp_path / "lesson" / "script.py"
    script.parent.mkdir()
    script.write_text("".join(f"line {i}\n" for i in range(1, 21)))
    fresh = tmp_path / "fresh.patch"
    fresh.write_text("--- script.py\n+++ script.py\n@@ -9,3 +9,3 @@\n line 9\n-line 10\n+LINE 10\n line 11\n")
    assert apply_exactly(script, [fresh], tmp_path) == []
    shifted = tmp_path / "shifted.patch"  # made when the script had four lines more on top
    shifted.write_text(fresh.read_text().replace("@@ -9,3 +9,3 @@", "@@ -13,3 +13,3 @@"))
    assert "offset -4 lines" in apply_exactly(script, [shifted], tmp_path)[0]
    fuzzy = tmp_path / "fuzzy.patch"  # its context line has changed since
    fuzzy.write_text(fresh.read_text().replace(" line 11\n", " line eleven\n"))
    assert "FAILED" in apply_exactly(script, [fuzzy], tmp_path)[0]
