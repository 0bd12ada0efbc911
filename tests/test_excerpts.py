"""The code pasted into the pages is the code of the scripts: no excerpt drifts from its source.

Fast (text only). The convention, for every ```python block of every course page: the line right above the
fence says where the block comes from,
    <!-- excerpt: 04_ddp_training/mnist_ddpmodel.py -->   (a path from the course folder), or
    <!-- not an excerpt -->                              (an example written for the page, checked by nothing).
An excerpt's lines must appear in that file as they are, one after the other, all shifted by one common
indentation (added or removed); a line `...` (any indentation) elides source lines, so each run of lines
between two `...` is found on its own.
"""
import re
from pathlib import Path

from lessons import ROOT
from test_docs import PAGES

MARKER = re.compile(r"^<!-- (?:excerpt: (\S+)|not an excerpt) -->$")
FENCE = re.compile(r"^```python\s*$")


def python_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(line number of the fence, the line above it, the block's lines) of each ```python block."""
    lines, found = text.splitlines(), []
    for i, line in enumerate(lines):
        if FENCE.match(line):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            found.append((i + 1, lines[i - 1] if i else "", lines[i + 1:end]))
    return found


def runs(block: list[str]) -> list[list[str]]:
    """The block cut at its `...` lines: each run must be contiguous in the source."""
    out = [[]]
    for line in block:
        if line.strip() == "...":
            out.append([])
        else:
            out[-1].append(line)
    return [run for run in out if run]


def same_but_indentation(shown: list[str], source: list[str]) -> bool:
    shifts = set()
    for a, b in zip(shown, source):
        if a.strip() != b.strip():
            return False
        if a.strip():
            shifts.add(len(b) - len(b.lstrip()) - (len(a) - len(a.lstrip())))
    return len(shifts) <= 1


def problems(page: str, text: str, root: Path = ROOT) -> list[str]:
    found = []
    for number, above, block in python_blocks(text):
        marker = MARKER.match(above)
        if not marker:
            found.append(f"{page}:{number}: no `<!-- excerpt: PATH -->` or `<!-- not an excerpt -->` line above")
        elif marker.group(1) and not (root / marker.group(1)).is_file():
            found.append(f"{page}:{number}: {marker.group(1)} is not a file of the course")
        elif marker.group(1):
            source = (root / marker.group(1)).read_text(encoding="utf-8").splitlines()
            for run in runs(block):
                if not any(same_but_indentation(run, source[i:i + len(run)])
                           for i in range(len(source) - len(run) + 1)):
                    found.append(f"{page}:{number}: not in {marker.group(1)} as shown:\n    " + "\n    ".join(run))
    return found


def test_every_excerpt_equals_its_source():
    found = [problem for page in PAGES for problem in problems(page, (ROOT / page).read_text(encoding="utf-8"))]
    assert not found, "excerpts that differ from their scripts (copy the lines again):\n" + "\n".join(found)


def test_the_checker_finds_a_drifted_excerpt(tmp_path):
    (tmp_path / "script.py").write_text("def main(args):\n    env = launch_env()\n    device = pick(args.device)\n"
                                        "    log(device)\n\n    run(device)\n")
    page = ("<!-- excerpt: script.py -->\n```python\nenv = launch_env()\ndevice = pick(args.device)\n...\n"
            "run(device)\n```\n<!-- not an excerpt -->\n```python\nprint('anything')\n```\n")
    assert problems("page.md", page, tmp_path) == []
    drifted = page.replace("pick(args.device)", 'pick("auto")')
    assert problems("page.md", drifted, tmp_path) == ["page.md:2: not in script.py as shown:\n"
                                                      '    env = launch_env()\n    device = pick("auto")']
    assert problems("page.md", page.replace("...\n", ""), tmp_path)[0].startswith("page.md:2: not in script.py")
    assert problems("page.md", page.replace("\ndevice", "\n  device"), tmp_path)  # one line's indentation differs
    unmarked = page.replace("<!-- not an excerpt -->\n", "")
    assert problems("page.md", unmarked, tmp_path) == [
        "page.md:8: no `<!-- excerpt: PATH -->` or `<!-- not an excerpt -->` line above"]
    assert problems("page.md", page.replace("script.py", "gone.py"), tmp_path) == [
        "page.md:2: gone.py is not a file of the course"]
