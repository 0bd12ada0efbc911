"""The worker functions of ddp.ipynb: read this file beside the notebook.

Every function runs in EVERY process, once per rank, on the CPU with gloo (the notebook's
launcher, common/launcher.py, sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun
would, and hides the GPUs). On a GPU node a training script does the same with "nccl",
``model.to(f"cuda:{local_rank}")`` and ``DDP(model, device_ids=[local_rank])``.
"""
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.model import Net


def say(text):
    """Print one line prefixed with this process's rank, in one write."""
    sys.stdout.write(f"[rank {dist.get_rank()}] {text}\n")
    sys.stdout.flush()


def fmt(t, n=3):
    """The first n values of a tensor, rounded: '[+0.0123, -0.0456, +0.0789]'."""
    return "[" + ", ".join(f"{v:+.4f}" for v in t.detach().flatten()[:n].tolist()) + "]"


def sampler_indices(dataset_size=10, epochs=(1, 2)):
    """Which examples does each rank's DistributedSampler hand out?"""
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dataset = range(dataset_size)  # any sequence: the sampler only hands out indices into it
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=1)
    seen = {}
    for epoch in epochs:
        sampler.set_epoch(epoch)  # a new shuffle each epoch; forget it and every epoch repeats the same order
        seen[epoch] = list(sampler)
        say(f"epoch {epoch}: indices {seen[epoch]}")
    odd = DistributedSampler(range(dataset_size + 1), num_replicas=world_size, rank=rank, shuffle=False)
    say(f"{dataset_size + 1} examples, no shuffle: indices {list(odd)}")
    dist.destroy_process_group()
    return seen


def ddp_wrap():
    """DDP(model) broadcasts rank 0's weights: every replica starts identical."""
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())  # deliberately DIFFERENT initial weights on each rank
    model = Net()
    say(f"before DDP(model): fc2.bias {fmt(model.fc2.bias)}")
    ddp = DDP(model)  # CPU + gloo: no device_ids
    say(f"after  DDP(model): fc2.bias {fmt(model.fc2.bias)}")
    values = model.fc2.bias.detach().clone()
    del ddp
    dist.destroy_process_group()
    return values


def _batch(size=64):
    torch.manual_seed(0)  # the same random "images" and labels on every rank
    return torch.randn(size, 1, 28, 28), torch.randint(0, 10, (size,))


def _max_grad_difference(model, reference):
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))


def gradients_2x32_vs_1x64(batch_size=64):
    """Each rank takes half of a batch; DDP's averaged gradient equals one process's on the whole batch."""
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    images, labels = _batch(batch_size)
    model = Net().eval()  # eval: dropout off, so both computations are the same function
    reference = copy.deepcopy(model)  # a plain copy: one process, no DDP
    ddp = DDP(model)
    per_rank = batch_size // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    say(f"my images: {mine.start}..{mine.stop - 1} ({per_rank} of {batch_size})")
    F.nll_loss(ddp(images[mine]), labels[mine]).backward()  # DDP all_reduces and averages the gradients here
    F.nll_loss(reference(images), labels).backward()  # the whole batch in one process
    say(f"fc2.bias.grad  DDP {world_size}x{per_rank}: {fmt(model.fc2.bias.grad)}   "
        f"one process 1x{batch_size}: {fmt(reference.fc2.bias.grad)}")
    diff = _max_grad_difference(model, reference)
    say(f"max |grad({world_size}x{per_rank}) - grad(1x{batch_size})| = {diff:.1e}")
    del ddp
    dist.destroy_process_group()
    return diff


def no_sync_accumulation(batch_size=64, micro_batches=2):
    """Gradient accumulation: all_reduce once per optimizer step, not once per micro-batch."""
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    images, labels = _batch(batch_size)
    model = Net().eval()
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    all_reduces = []

    def counting_allreduce(state, bucket):  # DDP's default communication (one all_reduce per bucket), counted
        all_reduces.append(bucket.index())
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_allreduce)
    per_rank = batch_size // world_size
    micro = per_rank // micro_batches
    for i in range(micro_batches):
        start = rank * per_rank + i * micro
        x, y = images[start:start + micro], labels[start:start + micro]
        if i < micro_batches - 1:
            with ddp.no_sync():  # forward AND backward inside: backward only ADDS into .grad, no communication
                (F.nll_loss(ddp(x), y) / micro_batches).backward()  # each micro-batch's share of the mean
            state = "no_sync: local to this rank"
        else:
            (F.nll_loss(ddp(x), y) / micro_batches).backward()  # all_reduces the ACCUMULATED gradients
            state = "synced: the same on every rank"
        say(f"after micro-batch {i} (images {start}..{start + micro - 1}): fc2.bias.grad {fmt(model.fc2.bias.grad)} "
            f"| all_reduce calls so far: {len(all_reduces)} | {state}")
    F.nll_loss(reference(images), labels).backward()
    diff = _max_grad_difference(model, reference)
    say(f"max |grad({world_size} ranks x {micro_batches} micro-batches x {micro}) - grad(1x{batch_size})| = {diff:.1e}")
    del ddp
    dist.destroy_process_group()
    return {"difference": diff, "all_reduce_calls": len(all_reduces)}
