"""The plain training loop lesson 04 is measured against: the same Net, optimizer and schedule, nothing else.

The whole training set sits on every device as one tensor; each epoch, rank r trains on the indices lesson 04's
DistributedSampler gives it. AdamW (fused on GPUs) +
OneCycle (pct_start 0.25, no momentum cycling), as lesson 04's recipe flags ask for; DDP only when there are
several processes. No DataLoader, no checkpoints, no metrics files: what a user would write by hand.
bench.py's worker calls `train` inside its own process group, in the same launch as lesson 04's runs.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, Subset

from common.data import load_mnist
from common.model import Net


def tensors(data_dir: str, kind: str, device, train_samples=None, test_samples=None) -> list:
    """(train images, labels, test images, labels) on `device`, normalised exactly as the lessons' Dataset does."""
    out = []
    for ds in load_mnist(data_dir, kind, train_samples, test_samples, download=False)[::2]:  # train and test
        indices = list(ds.indices) if isinstance(ds, Subset) else range(len(ds))
        base = ds.dataset if isinstance(ds, Subset) else ds
        images = torch.stack([base[i][0] for i in indices])  # the Dataset's own normalisation, item by item
        out += [images.to(device), base.targets[list(indices)].to(device)]
    return out


def _now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the GPU runs behind the CPU: wait for it, or the clock times launches only
    return time.perf_counter()


def _model(device, world: int, total_steps: int, lr: float):
    model = Net().to(device)
    if world > 1:  # DDP broadcasts rank 0's weights now and all_reduces gradients in backward
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total_steps, pct_start=0.25,
                                                cycle_momentum=False)
    return model, opt, sched


def _step(model, opt, sched, x, y) -> None:
    loss = F.nll_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()


@torch.no_grad()
def _accuracy(model, x, y, rank: int, world: int) -> float:
    """Each rank counts every world_size-th test image; the counts are summed over the ranks."""
    net = model.module if isinstance(model, DDP) else model  # no DDP hooks: the ranks' shares may differ in size
    net.eval()
    counts = torch.tensor([0.0, len(y[rank::world])], device=x.device)
    for i in range(rank, len(x), 2000 * world):
        counts[0] += (net(x[i:i + 2000 * world:world]).argmax(1) == y[i:i + 2000 * world:world]).sum()
    if world > 1:
        dist.all_reduce(counts)
    net.train()
    return (counts[0] / counts[1]).item()


def warm_up(data, device, world: int, batch: int, steps: int = 3) -> None:
    """Untimed steps on a throwaway model at both batch shapes: CUDA kernels, cuDNN autotuning, NCCL connections."""
    per_rank = len(data[0]) // world
    trio = _model(device, world, 10**6, 1e-3)
    for size in {batch, per_rank % batch or batch}:
        for _ in range(steps):
            _step(*trio, torch.randn(size, 1, 28, 28, device=device), torch.randint(0, 10, (size,), device=device))
    _now(device)


def train(seed: int, data, device, batch: int, lr: float, epochs: int) -> dict:
    """One run of `epochs` epochs: per epoch its training seconds and the test accuracy after it. Lesson 04's
    randomness, drawn as lesson 04 draws it: the initial weights from `seed`, the data order of its
    DistributedSampler, dropout from `seed + rank`. The two then train on the same numbers and reach 99% in the same
    epoch (up to cuDNN's nondeterminism), so their times to 99% differ by their code, not by their luck."""
    x, y, x_test, y_test = data
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    sampler = DistributedSampler(range(len(x)), world, rank, shuffle=True, seed=seed)
    steps = -(-len(sampler) // batch)
    torch.manual_seed(seed)
    model, opt, sched = _model(device, world, steps * epochs, lr)
    torch.manual_seed(seed + rank)
    seconds, accuracy = [], []
    for epoch in range(1, epochs + 1):
        start = _now(device)
        sampler.set_epoch(epoch)  # the shuffle is part of an epoch's time, as in the lesson
        for indices in torch.as_tensor(list(sampler), device=device).split(batch):
            _step(model, opt, sched, x[indices], y[indices])
        seconds.append(_now(device) - start)
        accuracy.append(_accuracy(model, x_test, y_test, rank, world))
    return {"epoch_seconds": seconds, "accuracy": accuracy, "steps_per_epoch": steps}
