"""Worker functions for multi-process tests. They live in a module so spawned processes can import them."""
import torch
import torch.nn.functional as F

from common.distributed import cleanup, setup
from common.metrics import EpochMeter, all_reduce_sum


def reduce_unequal(per_rank_values):
    """Each rank feeds its own list of (loss, correct) pairs; returns the global EpochMeter result."""
    ctx = setup()
    meter = EpochMeter()
    for loss, correct in per_rank_values[ctx.rank]:
        meter.update(torch.tensor(loss), correct, 1)
    out = meter.reduce()
    cleanup()
    return out


def ddp_one_step(state, data, target, lr):
    """One SGD step of DDP on this rank's half of the batch; returns the updated parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from common.model import Net
    ctx = setup()
    model = Net()
    model.load_state_dict(state)
    model.eval()  # dropout off, so both runs compute the same function
    ddp = DDP(model)
    shard = slice(ctx.rank * len(data) // ctx.world_size, (ctx.rank + 1) * len(data) // ctx.world_size)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    F.nll_loss(ddp(data[shard]), target[shard]).backward()  # DDP averages the gradients over ranks
    opt.step()
    cleanup()
    return {k: v.clone() for k, v in model.state_dict().items()}


def ddp_checkpoint_roundtrip(path, state):
    """Save under DDP, then load the same file back into a fresh DDP model; returns loaded weights."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from common.checkpoint import load_checkpoint, save_checkpoint
    from common.model import Net
    setup()
    model = Net()
    model.load_state_dict(state)
    ddp = DDP(model)
    opt = torch.optim.Adadelta(ddp.parameters())
    save_checkpoint(path, ddp, opt, epoch=3, step=30, lesson="test")
    fresh = DDP(Net())
    ckpt = load_checkpoint(path, fresh, torch.optim.Adadelta(fresh.parameters()))
    cleanup()
    return ckpt["epoch"], {k: v.clone() for k, v in fresh.module.state_dict().items()}


def sum_rank(_):
    ctx = setup()
    out = all_reduce_sum([ctx.rank, 1])
    cleanup()
    return out


def raise_on_rank(bad_rank):
    ctx = setup()
    if ctx.rank == bad_rank:
        raise ValueError(f"boom from rank {ctx.rank}")
    torch.distributed.barrier()  # the healthy ranks wait here until the launcher stops them
    cleanup()
