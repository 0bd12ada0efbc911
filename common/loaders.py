"""Feeding batches: the DataLoader's options, or the whole dataset resident on the GPU (DeviceLoader).

MNIST's 70,000 images are 220 MB as float32: on the GPU they spare the DataLoader (workers, collation, copies),
most of the time the classic example spends. Both take the SAME sampler: sharding and shuffling are identical.
"""
import math
import os
import signal

import torch
from torch.utils.data import Sampler, Subset

from common.data import MNIST_MEAN, MNIST_STD


def usable_cpus() -> int:
    """The CPUs this process may run on (Slurm and taskset restrict them), not every CPU of the node."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


def default_num_workers() -> int:
    """DataLoader workers per process: its share of the usable CPUs (SLURM_CPUS_PER_TASK counts a task's, which
    torchrun splits into LOCAL_WORLD_SIZE processes), minus one for the training loop."""
    cpus = int(os.environ.get("SLURM_CPUS_PER_TASK", usable_cpus()))
    return max(0, min(8, cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1))


def _as_tensors(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The images of MNISTFiles (or a Subset of it) normalised exactly as its items are, and the labels."""
    indices = torch.arange(len(dataset))
    while isinstance(dataset, Subset):
        indices = torch.as_tensor(dataset.indices)[indices]
        dataset = dataset.dataset
    images = (dataset.data[indices].unsqueeze(1).float() / 255 - MNIST_MEAN) / MNIST_STD
    return images, dataset.targets[indices]


class DeviceLoader:
    """(images, labels) batches sliced from tensors on the device, in the order the sampler gives each epoch."""

    def __init__(self, dataset, batch_size: int, sampler: Sampler, device: torch.device):
        self.dataset = dataset
        self.images, self.labels = (t.to(device) for t in _as_tensors(dataset))
        self.batch_size, self.sampler, self.device = batch_size, sampler, device

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self):
        order = torch.as_tensor(list(self.sampler), device=self.device)
        for batch in order.split(self.batch_size):
            yield self.images[batch], self.labels[batch]


def loader_options(args, device: torch.device) -> dict:
    """DataLoader options besides the dataset, batch size and sampler. pin_memory: page-locked buffers copy to a GPU
    faster (and allow non_blocking); the loader's own generator leaves the global RNG (dropout) alone, so a resumed
    run draws exactly the same numbers."""
    return {"num_workers": args.num_workers, "pin_memory": device.type == "cuda", "worker_init_fn": ignore_stop_signals,
            "persistent_workers": args.num_workers > 0, "generator": torch.Generator()}


def ignore_stop_signals(worker_id: int) -> None:
    """In each DataLoader worker: leave Ctrl-C, SIGTERM and SIGUSR1 to the training process. Slurm and a terminal
    signal every process, the workers too, and a killed worker makes the loop raise instead of saving its checkpoint.
    Safe: the DataLoader stops its workers itself, and an orphaned worker exits on its own."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
