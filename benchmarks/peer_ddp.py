"""The peer lesson 04's scaling is measured against: MNIST with DDP as a researcher writes it by hand.

torch and torchvision only, none of the course's `common`: torchvision's MNIST Dataset (ToTensor, Normalize),
a DistributedSampler (set_epoch every epoch), a DataLoader (batch 64 per GPU, num_workers worker processes started
each epoch, pin_memory on CUDA), and pytorch/examples' mnist/main.py model, Adadelta (lr 1.0) and StepLR (gamma
0.7). No warm-up, no checkpoints, no metrics files. bench.py's `peer` suite calls `train` inside the process group
of the throughput suite's launch, so lesson 04's DataLoader path and this loop scale on the same GPUs in one run
(and under the same cuDNN and TF32 settings: the launch's).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms


class Net(nn.Module):
    """pytorch/examples' mnist/main.py CNN: two convolutions, max-pool, dropout, two linear layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout2(F.relu(self.fc1(torch.flatten(self.dropout1(x), 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def train(root: str, device, epochs: int = 3, batch: int = 64, num_workers: int = 8, samples: int | None = None,
          seed: int = 1) -> dict:
    """One run in the current process group: per epoch its training seconds (the slowest rank's) and images/s,
    the median epoch's images/s, and the test accuracy after the last epoch. `root` holds MNIST/raw; `samples`
    keeps the first that many training and test images (the CPU smoke mode)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train_set = datasets.MNIST(root, train=True, download=False, transform=transform)
    test_set = datasets.MNIST(root, train=False, download=False, transform=transform)
    if samples:
        train_set, test_set = Subset(train_set, range(samples)), Subset(test_set, range(samples))
    sampler = DistributedSampler(train_set, seed=seed)  # the world size and rank of the process group
    options = {"num_workers": num_workers, "pin_memory": device.type == "cuda"}
    loader = DataLoader(train_set, batch_size=batch, sampler=sampler, **options)
    torch.manual_seed(seed)
    model = DDP(Net().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    seconds = []
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        start = _now(device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            F.nll_loss(model(x), y).backward()
            optimizer.step()
        seconds.append(_now(device) - start)
        scheduler.step()
    slowest = torch.tensor(seconds, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace, as in lesson 04's numbers
    images = len(sampler) * world  # every rank trains len(sampler) images an epoch
    per_epoch = [images / s for s in slowest.tolist()]
    return {"epoch_seconds": slowest.tolist(), "epoch_images_per_second": per_epoch,
            "images_per_second": statistics.median(per_epoch), "median_epoch_s": statistics.median(slowest.tolist()),
            "steps_per_epoch": len(loader), "test_accuracy": _accuracy(model.module, test_set, device, rank, world)}


@torch.no_grad()
def _accuracy(net, test_set, device, rank: int, world: int) -> float:
    """Each rank tests every world-th test image; the counts are summed over the ranks."""
    net.eval()
    counts = torch.zeros(2, device=device)
    for x, y in DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=1000):
        counts[0] += (net(x.to(device)).argmax(1) == y.to(device)).sum()
        counts[1] += len(y)
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()
