"""Where a run reads and writes: the course's data/ and runs/, from any working directory, installed or not.

Each test works in a copy of the course (the files a clone has), so the repository stays clean, and checks that
nothing appeared inside a lesson folder: a run started there used to create a second data/ and runs/ beside
the script, which git ignores, so nobody noticed.
"""
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from course_copy import ROOT, copy_course

TINY = ["--data", "synthetic", "--train-samples", "128", "--test-samples", "64", "--epochs", "1", "--num-workers", "0"]
SYS_PATH_LINE = "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))"


def lesson_files(course: Path) -> set[str]:
    """Every file and folder inside the lesson folders and trainer/, but Python's bytecode caches (not the run's)."""
    return {str(p.relative_to(course)) for lesson in (*course.glob("0*"), course / "trainer") for p in lesson.rglob("*")
            if "__pycache__" not in p.parts}


def env(**changes) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORKSHOP_DATA_DIR", "NOTEBOOK_OUTPUT_DIR")}
    return {**base, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **changes}


def test_a_trainer_run_from_its_folder_reads_and_writes_in_the_course_folder(tmp_path):
    course = copy_course(ROOT, tmp_path / "course")
    before = lesson_files(course)
    done = subprocess.run([sys.executable, "train.py", "--parallel", "single", *TINY], cwd=course / "trainer",
                          env=env(), capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in out, out[-3000:]
    assert f"working in the course folder {course.resolve()}:" in out.splitlines()[0], out[-3000:]
    assert lesson_files(course) == before, sorted(lesson_files(course) - before)
    assert (course / "runs" / "trainer-single" / "metrics.json").is_file()  # the default --output-dir
    assert (course / "data" / "synthetic" / "MNIST" / "raw").is_dir()  # the default --data-dir, data/


def test_a_notebook_run_from_its_folder_writes_in_the_course_folder(tmp_path, monkeypatch):
    course = copy_course(ROOT, tmp_path / "course")
    before = lesson_files(course)
    for name in ("WORKSHOP_DATA_DIR", "NOTEBOOK_OUTPUT_DIR"):  # the notebook's own defaults
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(course))  # the kernel imports the copy's `common`
    book = nbformat.read(course / "02_singlegpu_training" / "singlegpu.ipynb", as_version=4)
    NotebookClient(book, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(course / "02_singlegpu_training")}}).execute()
    assert lesson_files(course) == before, sorted(lesson_files(course) - before)
    assert len(list((course / "runs" / "notebook").glob("lesson02-*/checkpoints/02-epoch-001.pt"))) == 1
    assert (course / "data" / "synthetic" / "MNIST" / "raw").is_dir()


def site_packages_without(tmp_path: Path, *missing: str) -> Path:
    """This venv's packages as another Python would have them: no course installed (no editable finder, no .pth)
    and without `missing`. Run with `python -S` and PYTHONPATH=<it>, as a cluster's `module load` torch is."""
    site, farm = Path(sysconfig.get_paths()["purelib"]), tmp_path / "site-packages"
    farm.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.endswith(".pth") or name.startswith(("__editable__", "distributed_pytorch_course")) or \
                name.split("-")[0] in missing:
            continue
        (farm / entry.name).symlink_to(entry)
    return farm


def test_the_trainer_runs_without_the_course_installed_from_any_folder(tmp_path):
    course = copy_course(ROOT, tmp_path / "course")
    python = [sys.executable, "-S"]  # no site: this venv's site-packages (and the course's install) are not seen
    site = {"PYTHONPATH": str(site_packages_without(tmp_path)), "PYTHONNOUSERSITE": "1"}
    probe = subprocess.run([*python, "-c", "import torch, common"], cwd=tmp_path, env=env(**site),
                           capture_output=True, text=True, timeout=120)
    assert "No module named 'common'" in probe.stderr, probe.stderr  # torch is there, the course is not
    done = subprocess.run([*python, str(course / "trainer" / "train.py"), "--parallel", "single", *TINY],
                          cwd=tmp_path, env=env(**site), capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in out, out[-3000:]
    # `common` came from the copy: its runs/ holds the run
    assert (course / "runs" / "trainer-single" / "metrics.json").is_file(), out[-3000:]


def test_a_missing_package_is_one_line_naming_the_fix(tmp_path):
    course = copy_course(ROOT, tmp_path / "course")
    site = {"PYTHONPATH": str(site_packages_without(tmp_path, "tqdm")), "PYTHONNOUSERSITE": "1"}
    done = subprocess.run([sys.executable, "-S", str(course / "04_ddp_training" / "mnist_ddpmodel.py"), "--help"],
                          cwd=tmp_path, env=env(**site), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and done.stdout == "", done.stdout
    assert re.fullmatch(r"error: tqdm not installed for \S+: activate the course's environment .*"
                        r"`pip install tqdm` into this Python\n", done.stderr), done.stderr


def test_every_lesson_script_finds_common_without_an_install():
    """The line that makes the course folder importable comes before the script's first `common` import."""
    folders = (*ROOT.glob("0*"), ROOT / "troubleshooting", ROOT / "trainer")
    scripts = [p for folder in folders for p in folder.glob("*.py")
               if '__name__ == "__main__"' in p.read_text() and re.search(r"^(from|import) common", p.read_text(), re.M)]
    assert len(scripts) >= 13, scripts
    for script in scripts:
        text = script.read_text()
        first_import = re.search(r"^(from|import) common", text, re.M).start()
        assert SYS_PATH_LINE in text[:first_import], f"{script.relative_to(ROOT)}: no `{SYS_PATH_LINE}` before `common`"
