"""A fresh copy of the course, as a learner's clone has it, and a block of commands run in it (tests/walk.py's runs).

copy_course: the files git tracks or would track (no runs/, no data/); prepare: that copy with real MNIST if found
(find_mnist), the venv linked, and the learner's environment; run_block: bash -euo pipefail with a deadline, the
block's processes killed with their children when it passes.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)  # the venv this runs in: the learner's, after `source .venv/bin/activate`
RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def find_mnist(course: Path = ROOT) -> Path | None:
    """The MNIST/raw folder of $MNIST_DIR, else of ../shared/data/mnist, if it holds the four files (.gz or not)."""
    for base in (os.environ.get("MNIST_DIR"), course.parent / "shared" / "data" / "mnist"):
        raw = Path(base) / "MNIST" / "raw" if base else None
        if raw and all((raw / name).is_file() or (raw / f"{name}.gz").is_file() for name in RAW_FILES):
            return raw
    return None


def copy_course(course: Path, dest: Path) -> Path:
    """The course as a fresh clone would have it: the files git tracks or would track (not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=course,
                            capture_output=True)
    if listed.returncode == 0 and listed.stdout:
        for name in filter(None, listed.stdout.decode().split("\0")):
            src = course / name
            if src.is_file():  # a tracked file deleted in the working tree is gone from the next commit too
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name)
    else:  # not a git checkout (e.g. an unpacked archive)
        shutil.copytree(course, dest, ignore=shutil.ignore_patterns(
            ".git", ".venv*", "runs", "data", "logs", "outputs", "__pycache__", ".pytest_cache", "*.egg-info"))
    return dest


def prepare(course: Path, dest: Path, mnist: Path | None, extra_env: dict | None = None) -> dict:
    """A fresh copy of the course at dest, and the environment its blocks run in."""
    copy_course(course, dest)
    if mnist:
        raw = dest / "data" / "MNIST" / "raw"
        raw.mkdir(parents=True)
        for item in mnist.iterdir():
            shutil.copyfile(item, raw / item.name)  # copyfile: writable copies of read-only files
    (dest / ".venv").symlink_to(VENV)  # what `make setup` made; `make` targets use .venv/bin/...
    if (dest / "pyproject.toml").exists():  # older than the venv's stamp: `make` must not reinstall into the venv
        os.utime(dest / "pyproject.toml", (0, 0))
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "WORKSHOP_DATA_DIR", "MNIST_MIRROR", "NOTEBOOK_OUTPUT_DIR", "PYTHONHOME")}
    env.update(PATH=f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(VENV),
               PYTHONPATH=str(dest), PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
    env.update(extra_env or {})
    return env


def run_block(commands: str, cwd: Path, env: dict, timeout: float) -> tuple[int, str]:
    """bash -euo pipefail, stdout and stderr as the terminal shows them; a hang is killed with its children."""
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", commands], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:  # torchrun starts its workers in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out = ""
        return -9, (out or "") + f"\n(the walk stopped the block after {timeout:.0f} s)"


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (Linux /proc; elsewhere none), found before any of them is killed."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found
