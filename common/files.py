"""Files and folders all-or-nothing, so a crash never leaves half of one; relative paths in the course folder."""
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_write(path, mode: str = "wb"):
    """Yield a temporary file beside `path`, renamed over it once on disk: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; data and run folders are often shared
        os.replace(tmp, path)  # atomic on POSIX
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def atomic_save(obj, path) -> None:
    """torch.save, all or nothing: a kill mid-save leaves the previous file intact."""
    import torch
    with atomic_write(path) as f:
        torch.save(obj, f)


def replace_folder(finished, path) -> None:
    """Rename the complete folder `finished` to `path`. The old one is moved aside first and deleted last: a crash in
    between leaves a whole checkpoint under one of the two names, never half of one."""
    finished, path = Path(finished), Path(path)
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    finished.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def creatable_folder(path) -> str | None:
    """None if `path` is a folder or could be made one (its nearest existing ancestor is a folder we may write
    to), else why not. Creates nothing: a mistyped path must not leave folders behind."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if existing != path and not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def work_in_course_folder() -> None:
    """Make every relative path (data/, runs/, flags, --config) the course folder's, wherever the lesson was started:
    no second data/ or runs/ beside the script. The script's own course, not the one `common` came from. Each
    script's main calls it first, before parsing its flags; outside a lesson script (a notebook, pytest) it does
    nothing."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)  # none in a notebook or an interactive session
    path = Path(script).resolve() if script else Path("/")
    course = next((p for p in path.parents if (p / "common").is_dir() and (p / "01_setup").is_dir()), None)
    lesson = path.relative_to(course).parts[0] if course else ""
    if not (lesson[:2].isdigit() and lesson[2:3] == "_") and lesson != "trainer":  # pytest in COURSE/.venv, say
        return
    try:
        here = Path.cwd()
    except FileNotFoundError:  # the folder was deleted under the shell
        here = None
    if here == course:
        return
    os.chdir(course)
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(f"working in the course folder {course}: relative paths (data/, runs/, yours) are read there",
              flush=True)
