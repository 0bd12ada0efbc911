"""Follow the READMEs as a learner does: every command block, in the order it appears, on this CPU machine.

README.md, then each lesson's README. A ```bash block runs in a copy of the course (so `runs/` and
`data/` are the walk's own), one block after the other, so a later block sees what an earlier one
left (checkpoints, metrics). Blocks whose first line is a comment naming GPUs, Slurm or the
internet (e.g. `# needs GPUs`) are left to their own tests. To keep the walk to minutes, the data
is the synthetic set placed where `01_setup/download_mnist.py` would put MNIST, and lesson training
scripts get `--train-samples 800 --test-samples 200 --num-workers 0` appended (and `--epochs 2`
when the block gives none). The block must exit 0, unless the output shown after it starts with
`error:`; and each line of that output that starts with a word the scripts print (epoch, resume:,
lesson, error:, ...) must appear in the real output with the same shape (numbers may differ).
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.data import RAW_FILES, dataset_root
from lessons import ROOT

READMES = ["README.md", "01_setup/README.md", "02_singlegpu_training/README.md", "03_dp_training/README.md",
           "04_ddp_training/README.md", "05_multigpu_fsdp_training/README.md"]
LEFT_OUT = re.compile(r"^#.*\b(GPUs?|Slurm|cluster|internet)\b", re.IGNORECASE)
CHECKED = ("epoch ", "resume:", "lesson 0", "error:", "OK:", "preempted:", "target accuracy", "nothing to train")
SHIM = """#!{python}
# Run the real {name}, with small sizes for the course's training scripts (the README walk only).
import os, sys
args = sys.argv[1:]
if any(a.endswith(".py") and os.path.basename(a).startswith("mnist_") for a in args):
    args += ["--train-samples", "800", "--test-samples", "200", "--num-workers", "0"]
    if "--epochs" not in args and "--dry-run" not in args and "--profile" not in args:
        args += ["--epochs", "2"]
cmd = [{real!r}] + (["-m", {module!r}] if {module!r} else []) + args
os.execv(cmd[0], cmd)
"""


def blocks(readme: Path):
    """(commands, shown output or None) for each ```bash block, in order."""
    text = readme.read_text()
    fences = list(re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S))
    for i, fence in enumerate(fences):
        if fence.group(1) != "bash":
            continue
        nxt = fences[i + 1] if i + 1 < len(fences) else None
        shown = nxt.group(2) if nxt and nxt.group(1) in ("", "text") and \
            not text[fence.end():nxt.start()].strip() else None
        yield fence.group(2), shown


def shape(line: str) -> re.Pattern:
    """A printed line as a pattern: numbers, paths in runs/ and timings may differ, the words may not."""
    pattern = re.escape(line.strip().replace("...", "\0"))
    pattern = re.sub(r"\d[\d,]*(\\\.\d+)?", r"[\\d,]+(\\.\\d+)?", pattern)
    return re.compile(pattern.replace("\0", ".*"))


@pytest.fixture(scope="module")
def walk_dir(tmp_path_factory, synthetic_dir):
    """A copy of the course with the synthetic files where MNIST goes, and the size shims on PATH."""
    copy = tmp_path_factory.mktemp("walk") / "course"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "data", "logs", "__pycache__",
                                                                ".pytest_cache", "*.egg-info", ".gpu", ".mnist"))
    raw = copy / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in RAW_FILES:
        shutil.copy(dataset_root(synthetic_dir, "synthetic") / "MNIST" / "raw" / name, raw / name)
    bin_dir = copy.parent / "bin"
    bin_dir.mkdir()
    for name, module in (("python", ""), ("python3", ""), ("torchrun", "torch.distributed.run")):
        shim = bin_dir / name
        shim.write_text(SHIM.format(python=sys.executable, real=sys.executable, name=name, module=module))
        shim.chmod(0o755)
    (copy / ".venv").symlink_to(Path(sys.executable).parents[1])  # `make` finds the installed course
    os.utime(copy / "pyproject.toml", (0, 0))  # older than the venv's stamp: `make` must not reinstall into it
    return copy


@pytest.mark.parametrize("readme", READMES)
def test_readme_commands_work_in_order(readme, walk_dir):
    env = {**os.environ, "PATH": f"{walk_dir.parent / 'bin'}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(walk_dir), "DEMO_FLAGS": "--epochs 1 --train-samples 1200 --test-samples 400",
           "PYTHONUNBUFFERED": "1"}
    env.pop("WORKSHOP_DATA_DIR", None)
    ran = 0
    for commands, shown in blocks(walk_dir / readme):
        commands = re.sub(r"^make test.*$", "", commands, flags=re.M)  # the walk is part of that suite
        commands = re.sub(r"^(diff .*?)(\s+#.*)?$", r"\1 || true\2", commands, flags=re.M)  # differing is the point
        if LEFT_OUT.match(commands.strip()) or not commands.strip():
            continue
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=walk_dir, env=env,
                              capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        expect_error = bool(shown) and any(l.startswith("error:") for l in shown.splitlines())
        assert (proc.returncode != 0) == expect_error, f"{readme}: block\n{commands}\nexit {proc.returncode}:\n{out[-3000:]}"
        assert "Traceback" not in out, f"{readme}: block\n{commands}\n{out[-3000:]}"
        for line in (shown or "").splitlines():
            if line.startswith(CHECKED) and "<" not in line:
                assert any(shape(line).search(real) for real in out.splitlines()), \
                    f"{readme}: the README shows\n  {line}\nbut the block\n{commands}\nprinted:\n{out[-3000:]}"
        ran += 1
    assert ran > 0 or readme == "05_multigpu_fsdp_training/README.md", f"{readme}: no block was walked"
