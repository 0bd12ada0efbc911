"""MNIST as tensors: the raw files (common/download.py fetches them) read into a Dataset, a validation split."""
import struct
from pathlib import Path

import torch
from torch.utils.data import Dataset, Subset

from common.download import RAW_FILES, dataset_root, missing_error, prepare_data, raw_folder
from common.errors import CourseError

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081


class MNISTFiles(Dataset):
    """ROOT/MNIST/raw as `data` (uint8, N x 28 x 28) and `targets`; an item is bit for bit torchvision's MNIST with
    ToTensor() and Normalize(). Reading the files directly spares every process torchvision's import (seconds)."""

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
    """(train, validation or None): `val_samples` images drawn by `seed`, the same on every rank; the rest in order."""
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
    """(train, validation or None, test), the first N of each (all if None). Only the main process prepares the
    files; `barrier` (e.g. dist.barrier) makes the others wait for it, then every process reads them."""
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
        raise missing_error(raw, f"{missing[0]} missing: the main process could not prepare it (see its "
                                  f"error), or the data dir is not shared by all ranks")
    train, test = MNISTFiles(root, train=True), MNISTFiles(root, train=False)
    train, val = split_validation(_first(train, train_samples, "train-samples"), val_samples, seed)
    return train, val, _first(test, test_samples, "test-samples")
