"""Failure 6, DataLoader workers killed: shared memory (/dev/shm) or file descriptors run out.

    python troubleshooting/dataloader_workers.py                      # 2 workers, 16 MiB batches through /dev/shm
    python troubleshooting/dataloader_workers.py --workers 0          # no workers: no shared memory at all
    python troubleshooting/dataloader_workers.py --many-tensors       # 64 batches x 64 small tensors, all kept
    python troubleshooting/dataloader_workers.py --many-tensors --sharing file_system
    python troubleshooting/dataloader_workers.py --sparse-shm         # how a full /dev/shm becomes a "Bus error"

A worker process builds each batch and hands it to the training process through shared memory:
a file in /dev/shm (a tmpfs, 64 MB by default in a Docker container) that both map. With the
default sharing strategy on Linux ("file_descriptor") every tensor travels as an open file
descriptor, so a process that keeps many tensors alive can also hit its open-files limit.
Run it in a small /dev/shm (see the README) to see the failures; nothing here needs a GPU.
"""
import argparse
import mmap
import os

import torch
from torch.utils.data import DataLoader, Dataset


SHARED = []  # the mappings a worker keeps (--sparse-shm)


class Samples(Dataset):
    def __init__(self, sample_mb: float, many_tensors: bool, sparse_shm: bool):
        self.numel = int(sample_mb * 2**20) // 4  # float32
        self.many_tensors = many_tensors
        self.sparse_shm = sparse_shm

    def __len__(self):
        return 256 if self.many_tensors else 16

    def __getitem__(self, i):
        if self.sparse_shm:
            # What older PyTorch releases did with each batch: make a sparse file in /dev/shm, map
            # it, write into it. tmpfs finds a page at the first write to it; when none is left
            # the kernel kills the writer with SIGBUS ("Bus error") instead of returning an error.
            path = f"/dev/shm/troubleshooting-{os.getpid()}-{i}"
            fd = os.open(path, os.O_CREAT | os.O_RDWR)
            os.unlink(path)  # the space stays taken while the mapping is open, and is freed at exit
            os.ftruncate(fd, self.numel * 4)
            SHARED.append(mmap.mmap(fd, self.numel * 4))  # kept, like batches waiting to be used
            os.close(fd)
            SHARED[-1][:] = b"\1" * (self.numel * 4)
            return torch.zeros(1)
        if self.many_tensors:
            return [torch.full((4,), float(i)) for _ in range(64)]  # 64 tiny tensors per sample
        return torch.full((self.numel,), float(i))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sample-mb", type=float, default=4.0, help="MiB per sample (a batch is 4 samples)")
    parser.add_argument("--sharing", choices=["file_descriptor", "file_system"],
                        help="torch.multiprocessing sharing strategy (default: the platform's)")
    parser.add_argument("--many-tensors", action="store_true", help="64 batches of 64 small tensors, all kept")
    parser.add_argument("--sparse-shm", action="store_true", help="workers write into a sparse /dev/shm file")
    args = parser.parse_args()

    if args.sharing:
        # Must be set before the DataLoader starts its workers.
        torch.multiprocessing.set_sharing_strategy(args.sharing)
    shm = os.statvfs("/dev/shm")
    print(f"/dev/shm: {shm.f_blocks * shm.f_frsize / 2**20:.0f} MiB, sharing strategy "
          f"{torch.multiprocessing.get_sharing_strategy()}, {args.workers} workers", flush=True)

    loader = DataLoader(Samples(args.sample_mb, args.many_tensors, args.sparse_shm), batch_size=4,
                        num_workers=args.workers)
    kept = []  # e.g. predictions collected for evaluation: every tensor here stays shared
    for batch in loader:
        kept.append(batch)
    print(f"ok: {len(kept)} batches", flush=True)


if __name__ == "__main__":
    main()
