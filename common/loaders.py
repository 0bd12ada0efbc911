"""Two ways to feed batches: a DataLoader (the classic), or the whole dataset resident on the GPU.

MNIST's 70,000 images are 220 MB as float32: they fit on any GPU many times over. Holding it there removes the
DataLoader (worker processes, collation, host-to-device copies), which is most of the time the
classic example spends. Both paths take the SAME sampler, so sharding and shuffling are identical.
"""
from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, Sampler, Subset
from torchvision.datasets import MNIST

from common.data import MNIST_MEAN, MNIST_STD, loader_kwargs
from common.errors import CourseError


def _as_tensors(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Images normalised exactly as ToTensor + Normalize would, and labels, for the whole dataset."""
    indices = None
    while isinstance(dataset, Subset):
        indices = torch.as_tensor(dataset.indices) if indices is None else torch.as_tensor(dataset.indices)[indices]
        dataset = dataset.dataset
    if isinstance(dataset, MNIST):  # fast path: torchvision already holds the raw uint8 tensor
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
        self.images, self.labels = (t.to(device) for t in _as_tensors(dataset))
        self.batch_size, self.sampler, self.device = batch_size, sampler, device

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self):
        order = torch.as_tensor(list(self.sampler), device=self.device)
        for batch in order.split(self.batch_size):
            yield self.images[batch], self.labels[batch]


def make_loader(dataset, batch_size: int, sampler: Sampler, device: torch.device, num_workers: int = 0,
                on_device: bool = False):
    """A DataLoader over `sampler`, or a DeviceLoader when the data should live on the device."""
    if on_device:
        return DeviceLoader(dataset, batch_size, sampler, device)
    # Its own generator: creating an iterator then leaves the global RNG (dropout) alone, so resumes are exact.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, generator=torch.Generator(),
                      **loader_kwargs(device, num_workers))


def steps_per_epoch(loader, args) -> int:
    """Optimizer steps in one epoch: the loader's batches / --grad-accum, capped by --max-steps."""
    per_step = getattr(args, "grad_accum", 1)
    steps = min(len(loader) // per_step, args.max_steps or len(loader))
    if steps == 0:
        raise CourseError(f"--grad-accum {per_step} needs more batches than this rank's {len(loader)}: "
                          f"lower it or use more --train-samples")
    return steps
