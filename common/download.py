"""MNIST's four raw files, found, checked, extracted or downloaded (torchvision's mirrors) before any rank reads them.

`--data synthetic` writes a look-alike under DATA_DIR/synthetic (common/synthetic.py), so the two never mix; missing
real data is an error that names the fix, never a silent fallback to synthetic data.
"""
import gc
import gzip
import os
import shutil
import socket
import struct
import warnings
from pathlib import Path

from common.errors import CourseError, one_line
from common.files import atomic_write, creatable_folder
from common.synthetic import write_synthetic_mnist

RAW_FILES = {  # file name -> IDX magic number
    "train-images-idx3-ubyte": 2051,
    "train-labels-idx1-ubyte": 2049,
    "t10k-images-idx3-ubyte": 2051,
    "t10k-labels-idx1-ubyte": 2049,
}
DOWNLOAD_TIMEOUT_S = 60


def default_data_dir() -> str:
    """$WORKSHOP_DATA_DIR if set, else ./data."""
    return os.environ.get("WORKSHOP_DATA_DIR") or "./data"


def dataset_root(data_dir, kind: str) -> Path:
    """The torchvision root for `kind`: DATA_DIR for mnist, DATA_DIR/synthetic for synthetic."""
    if kind == "mnist":
        return Path(data_dir)
    if kind == "synthetic":
        return Path(data_dir) / "synthetic"
    raise CourseError(f"unknown data kind {kind!r}: use --data mnist or --data synthetic")


def raw_folder(root) -> Path:
    return Path(root) / "MNIST" / "raw"


def _idx_problem(path: Path) -> str | None:
    """None if `path` is a complete IDX file of the expected kind, else what is wrong with it."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = f.read(16)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    magic = RAW_FILES[path.name]
    dims = 3 if magic == 2051 else 1
    if len(header) < 4 * (1 + dims) or struct.unpack(">I", header[:4])[0] != magic:
        return "not an IDX file"
    shape = struct.unpack(">" + "I" * dims, header[4:4 + 4 * dims])
    expected = 4 * (1 + dims) + shape[0] * (784 if dims == 3 else 1)
    return None if size == expected else f"truncated ({size} bytes, expected {expected})"


def missing_error(raw: Path, reason: str) -> CourseError:
    """The fix for a machine without internet too: the four .gz files, copied by hand (prepare_data extracts them)."""
    files = [f"{name}.gz" for name in RAW_FILES]
    return CourseError(
        f"MNIST not found in {raw} ({one_line(reason)}): check --data-dir; without internet, copy "
        f"{', '.join(files[:-1])} and {files[-1]} into {raw}/ from a machine with internet (`python "
        f"01_setup/download_mnist.py` leaves them in data/MNIST/raw/ of the course there) and run again, "
        f"or train with --data synthetic")


def _download(root: Path) -> str | None:
    """Download through torchvision ($MNIST_MIRROR, a base URL, replaces its mirrors); None on success, else why not."""
    import torchvision  # only to download: it costs seconds to import, and every rank reads the files without it
    cls = torchvision.datasets.MNIST
    created = [p for p in (Path(root), raw_folder(root).parent, raw_folder(root)) if not p.exists()]
    saved_mirrors, saved_timeout = cls.mirrors, socket.getdefaulttimeout()
    mirror = os.environ.get("MNIST_MIRROR")
    if mirror:
        cls.mirrors = [mirror if mirror.endswith("/") else mirror + "/"]
    if saved_timeout is None:  # urllib waits forever by default; a dead network should fail, not hang
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            try:
                cls(str(root), train=False, download=True)
                return None
            except Exception as e:  # torchvision raises RuntimeError, URLError, OSError, ...
                reason = f"download failed: {e if isinstance(e, RuntimeError) else f'{type(e).__name__}: {e}'}"
            gc.collect()  # torchvision leaves failed HTTP responses open: finalise them here, quietly
            if created:  # a mistyped --data-dir must not leave empty folders behind
                shutil.rmtree(created[0], ignore_errors=True)
            return reason
    finally:
        cls.mirrors = saved_mirrors
        socket.setdefaulttimeout(saved_timeout)


def prepare_data(data_dir, kind: str = "mnist", download: bool = True, seed: int = 0) -> Path:
    """Make the four raw files exist (extract .gz files found beside them, else download; synthetic: write them) and
    return the torchvision root; a CourseError naming the fix if that is not possible."""
    root = dataset_root(data_dir, kind)
    problem = creatable_folder(data_dir)
    if problem:
        raise CourseError(f"--data-dir {data_dir}: {problem}: check --data-dir")
    if kind == "synthetic":
        try:
            write_synthetic_mnist(root, seed=seed)
        except OSError as exc:
            raise CourseError(f"cannot write the synthetic data to {root} ({exc.strerror}): pick a --data-dir "
                              f"you can write to") from None
        return root
    raw = raw_folder(root)
    problems = {name: _idx_problem(raw / name) for name in RAW_FILES}
    for name, problem in problems.items():
        gz = raw / f"{name}.gz"
        if problem is not None and gz.is_file():
            try:  # all or nothing
                with atomic_write(raw / name) as out, gzip.open(gz, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
            except (OSError, EOFError) as e:
                raise CourseError(f"could not extract {gz} ({one_line(e)}): delete it and run again") from e
            problems[name] = _idx_problem(raw / name)
    bad = {name: p for name, p in problems.items() if p is not None}
    if not bad:
        return root
    for name, problem in bad.items():
        if problem != "missing":
            raise CourseError(f"{raw / name} is {problem}: delete it and run again")
    if not download:
        raise missing_error(raw, f"{len(bad)} of 4 raw files missing, download disabled")
    failure = _download(root)
    if failure:
        raise missing_error(raw, failure)
    bad = [name for name in RAW_FILES if _idx_problem(raw / name) is not None]
    if bad:
        raise missing_error(raw, f"{bad[0]} is still missing or incomplete after the download")
    return root
