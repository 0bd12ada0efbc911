"""Write files all-or-nothing, so a crash or a kill never leaves a half-written file behind."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_write(path, mode: str = "wb"):
    """Yield a file in the same folder as `path`; on success it is flushed to disk and renamed over `path`.

    Readers see the old file or the new one, never a mix. On an exception the temp file is removed.
    """
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
    """Give the complete folder `finished` the name `path`, replacing a folder of that name if there is one.

    The old one is moved aside first and deleted last: a crash in between leaves a whole checkpoint
    under one of the two names, never half of one.
    """
    import shutil
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
