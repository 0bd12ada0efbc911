"""MNIST for every lesson: find or fetch the raw files once (torchvision downloads), then read them as tensors.

`--data mnist` (default) uses the real data set under DATA_DIR/MNIST/raw/;
`--data synthetic` writes a generated look-alike under DATA_DIR/synthetic/MNIST/raw/
(see common/synthetic.py), so the two never mix. Missing real data is an error that names
the fix; the course never falls back to synthetic data silently.
"""
import gc
import gzip
import os
import shutil
import socket
import struct
import warnings
from pathlib import Path

import torch
from torch.utils.data import Dataset, Subset

from common.errors import CourseError, one_line
from common.files import atomic_write, creatable_folder
from common.synthetic import write_synthetic_mnist

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
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


def _missing_error(raw: Path, reason: str) -> CourseError:
    """The fix for a machine without internet too: the four .gz files, copied by hand (prepare_data extracts them)."""
    files = [f"{name}.gz" for name in RAW_FILES]
    return CourseError(
        f"MNIST not found in {raw} ({one_line(reason)}): check --data-dir; without internet, copy "
        f"{', '.join(files[:-1])} and {files[-1]} into {raw}/ from a machine with internet (`python "
        f"01_setup/download_mnist.py` leaves them in data/MNIST/raw/ of the course there) and run again, "
        f"or train with --data synthetic")


def _extract_gz(gz: Path, dest: Path) -> None:
    """Decompress `gz` to `dest`, all or nothing."""
    try:
        with atomic_write(dest) as out, gzip.open(gz, "rb") as src:
            shutil.copyfileobj(src, out, 1 << 20)
    except (OSError, EOFError) as e:
        raise CourseError(f"could not extract {gz} ({one_line(e)}): delete it and run again") from e


def _download(root: Path) -> str | None:
    """Download through torchvision; None on success, else why not (one line).

    $MNIST_MIRROR (a base URL) replaces torchvision's mirrors for this call only.
    """
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
    """Make the four uncompressed raw files exist and return the torchvision root.

    mnist: nothing to do if they are there; else extract any .gz files found next to them;
    else download (if `download`). synthetic: write them (a no-op if already written with `seed`).
    Raises CourseError (one line naming the fix) if that is not possible.
    """
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
        if problem is not None and (raw / f"{name}.gz").is_file():
            _extract_gz(raw / f"{name}.gz", raw / name)
            problems[name] = _idx_problem(raw / name)
    bad = {name: p for name, p in problems.items() if p is not None}
    if not bad:
        return root
    corrupt = {name: p for name, p in bad.items() if p != "missing"}
    if corrupt:
        name, problem = next(iter(corrupt.items()))
        raise CourseError(f"{raw / name} is {problem}: delete it and run again")
    if not download:
        raise _missing_error(raw, f"{len(bad)} of 4 raw files missing, download disabled")
    failure = _download(root)
    if failure:
        raise _missing_error(raw, failure)
    bad = [name for name in RAW_FILES if _idx_problem(raw / name) is not None]
    if bad:
        raise _missing_error(raw, f"{bad[0]} is still missing or incomplete after the download")
    return root


class MNISTFiles(Dataset):
    """The MNIST IDX files of ROOT/MNIST/raw as tensors: `data` (uint8, N x 28 x 28) and `targets`.

    An item is what torchvision's MNIST with ToTensor() and Normalize((0.1307,), (0.3081,)) returns, bit for
    bit: the image as float32 in [0, 1], then (x - mean) / std, and the label as an int. Reading the files
    directly spares every process the import of torchvision (seconds per process), and a DataLoader
    worker the detour through a PIL image.
    """

    def __init__(self, root, train: bool = True):
        prefix = "train" if train else "t10k"
        self.data = _read_idx(raw_folder(root) / f"{prefix}-images-idx3-ubyte")
        self.targets = _read_idx(raw_folder(root) / f"{prefix}-labels-idx1-ubyte").long()

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        image = self.data[index].unsqueeze(0).float().div(255)  # what ToTensor() does to a uint8 image
        return (image - MNIST_MEAN) / MNIST_STD, int(self.targets[index])


def _read_idx(path: Path) -> torch.Tensor:
    """An IDX file (big-endian header: magic, then one size per dimension; then uint8 values) as a tensor."""
    blob = path.read_bytes()
    dims = 3 if struct.unpack(">I", blob[:4])[0] == 2051 else 1
    shape = struct.unpack(">" + "I" * dims, blob[4:4 + 4 * dims])
    return torch.frombuffer(bytearray(blob[4 + 4 * dims:]), dtype=torch.uint8).view(*shape)


def _first(ds, n, what: str):
    if n is None:
        return ds
    if not 1 <= n <= len(ds):
        raise CourseError(f"--{what} must be between 1 and {len(ds)}, got {n}")
    return Subset(ds, range(n))


def split_validation(train, val_samples: int, seed: int):
    """(train, validation): `val_samples` images drawn from `train` by `seed`, the same on every rank; the rest
    stay in order. No image is in both; with val_samples 0 the training set is unchanged and there is none."""
    if not val_samples:
        return train, None
    if val_samples >= len(train):
        raise CourseError(f"--val-samples {val_samples} leaves no training images out of {len(train)}: lower it")
    held_out = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))[:val_samples]
    keep = torch.ones(len(train), dtype=torch.bool)
    keep[held_out] = False
    return Subset(train, keep.nonzero().flatten().tolist()), Subset(train, held_out.sort().values.tolist())


def load_mnist(data_dir, kind: str = "mnist", train_samples=None, test_samples=None, val_samples: int = 0,
               seed: int = 0, is_main: bool = True, barrier=None, download: bool = True):
    """Return (train, validation or None, test): the first `train_samples` / `test_samples` examples (all if
    None), with `val_samples` of the training ones held out (split_validation, by `seed`).

    Only the main process prepares the files; `barrier` (a callable, e.g. dist.barrier) makes the
    other ranks wait for it. Every process then reads the files (MNISTFiles).
    """
    root = dataset_root(data_dir, kind)
    failure = None
    if is_main:
        try:
            prepare_data(data_dir, kind, download=download)
        except Exception as e:
            failure = e
    # On failure main still reaches the barrier (so no rank hangs), then raises; the others find the files missing.
    if barrier is not None:
        barrier()
    if failure is not None:
        raise failure
    raw = raw_folder(root)
    missing = [name for name in RAW_FILES if not (raw / name).is_file()]
    if missing and kind == "synthetic":
        raise CourseError(f"synthetic data missing in {raw}: the main process could not write it (see its "
                          f"error); the data dir must be writable and shared by all ranks")
    if missing:
        raise _missing_error(raw, f"{missing[0]} missing: the main process could not prepare it (see its "
                                  f"error), or the data dir is not shared by all ranks")
    train, test = MNISTFiles(root, train=True), MNISTFiles(root, train=False)
    train, val = split_validation(_first(train, train_samples, "train-samples"), val_samples, seed)
    return train, val, _first(test, test_samples, "test-samples")
