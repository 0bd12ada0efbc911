"""Feeding batches: the DataLoader's options, or the whole dataset resident on the GPU (DeviceLoader).

MNIST's 70,000 images are 220 MB as float32: they fit on any GPU many times over. Holding it there removes the
DataLoader (worker processes, collation, host-to-device copies), which is most of the time the
classic example spends. Both paths take the SAME sampler, so sharding and shuffling are identical.
"""
from __future__ import annotations

import math
import os
import signal

import torch
from torch.utils.data import Sampler, Subset

from common.data import MNIST_MEAN, MNIST_STD, MNISTFiles


def usable_cpus() -> int:
    """The CPUs this process may run on (Slurm and taskset restrict them), not every CPU of the node."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


def default_num_workers() -> int:
    """DataLoader workers per process: this process's share of the usable CPUs, minus one for the training loop.

    Slurm's SLURM_CPUS_PER_TASK counts the CPUs of the whole task; torchrun splits a task into
    LOCAL_WORLD_SIZE processes, which must share them.
    """
    cpus = int(os.environ.get("SLURM_CPUS_PER_TASK", usable_cpus()))
    return max(0, min(8, cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1))


def _as_tensors(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Images normalised exactly as ToTensor + Normalize would, and labels, for the whole dataset."""
    indices = None
    while isinstance(dataset, Subset):
        indices = torch.as_tensor(dataset.indices) if indices is None else torch.as_tensor(dataset.indices)[indices]
        dataset = dataset.dataset
    if isinstance(dataset, MNISTFiles):  # fast path: it already holds the raw uint8 tensor
        images, labels = dataset.data, dataset.targets
        if indices is not None:
            images, labels = images[indices], labels[indices]
        images = (images.unsqueeze(1).float() / 255 - MNIST_MEAN) / MNIST_STD
        return images, labels
    pairs = [dataset[i] for i in (indices.tolist() if indices is not None else range(len(dataset)))]
    return torch.stack([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])


class DeviceLoader:
    """Iterates (images, labels) batches sliced from tensors that live on the device.

    Each epoch it asks the sampler for this rank's indices (call sampler.set_epoch as usual),
    so a DistributedSampler shards it exactly as it would shard a DataLoader.
    """

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
    """DataLoader options besides the dataset, batch size and sampler.

    pin_memory: page-locked host buffers make the copy to a GPU faster (and non_blocking possible);
    persistent_workers: keep the worker processes between epochs instead of starting them again;
    generator: the loader's own, so that starting an epoch leaves the global RNG (dropout) alone and
    a resumed run draws exactly the same numbers.
    """
    return {"num_workers": args.num_workers, "pin_memory": device.type == "cuda", "worker_init_fn": ignore_stop_signals,
            "persistent_workers": args.num_workers > 0, "generator": torch.Generator()}


def ignore_stop_signals(worker_id: int) -> None:
    """In each DataLoader worker: leave Ctrl-C, SIGTERM and SIGUSR1 to the training process.

    Slurm (at the time limit, on scancel) and a terminal signal every process of the job, the workers
    too. A worker killed by SIGTERM makes the training loop raise "DataLoader worker ... is killed by
    signal" instead of finishing the step and saving its checkpoint. Ignoring them here is safe: the
    DataLoader stops its workers itself, and a worker whose training process is gone exits on its own.
    """
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
