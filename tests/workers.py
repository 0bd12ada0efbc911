"""Worker functions for multi-process tests. They live in a module so spawned processes can import them.

common.launcher starts them with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, as torchrun would,
so each worker calls init_process_group itself, like a lesson script.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.metrics import EpochMeter, all_reduce_sum


def reduce_unequal(per_rank_values):
    """Each rank feeds its own list of (loss, correct) pairs; returns the global EpochMeter result."""
    dist.init_process_group("gloo")
    meter = EpochMeter()
    for loss, correct in per_rank_values[dist.get_rank()]:
        meter.update(torch.tensor(loss), correct, 1)
    out = meter.all_reduce()
    dist.destroy_process_group()
    return out


def ddp_one_step(state, data, target, lr):
    """One SGD step of DDP on this rank's half of the batch; returns the updated parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from common.model import Net
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = Net()
    model.load_state_dict(state)
    model.eval()  # dropout off, so both runs compute the same function
    ddp = DDP(model)
    shard = slice(rank * len(data) // world_size, (rank + 1) * len(data) // world_size)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    F.nll_loss(ddp(data[shard]), target[shard]).backward()  # DDP averages the gradients over ranks
    opt.step()
    dist.destroy_process_group()
    return {k: v.clone() for k, v in model.state_dict().items()}


def sum_rank(_):
    dist.init_process_group("gloo")
    out = all_reduce_sum([dist.get_rank(), 1])
    dist.destroy_process_group()
    return out


def raise_on_rank(bad_rank):
    dist.init_process_group("gloo")
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    dist.barrier()  # the healthy ranks wait here until the launcher stops them
    dist.destroy_process_group()


def lr_per_step(argv, steps_per_epoch):
    """The learning rate each optimizer step uses, built as the lessons build it, under this world size."""
    from types import SimpleNamespace

    from common.model import Net
    from trainer.optim import make_optimizer, make_scheduler
    dist.init_process_group("gloo")
    args = SimpleNamespace(**argv)
    optimizer = make_optimizer(args, Net().parameters(), dist.get_world_size())
    scheduler = make_scheduler(args, optimizer, steps_per_epoch)
    used = []
    for _ in range(args.epochs * steps_per_epoch):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    dist.destroy_process_group()
    return used
