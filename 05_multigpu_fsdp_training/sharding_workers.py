"""The worker functions of fsdp.ipynb: read this file beside the notebook.

Every function runs in EVERY process, once per rank, on the CPU with gloo (the notebook's
launcher, common/launcher.py, sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun
would, and hides the GPUs). On GPUs the same code uses "nccl" and init_device_mesh("cuda", ...).
"""
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common.model import Net

SHOWN = ("features.0.weight", "fc1.weight", "fc2.bias")  # three parameters to print, small to large


def say(text):
    """Print one line prefixed with this process's rank, in one write."""
    sys.stdout.write(f"[rank {dist.get_rank()}] {text}\n")
    sys.stdout.flush()


def sharded_net(seed):
    """A Net whose parameters are split across all ranks (FSDP2)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # 1-D mesh: all ranks, one after another
    torch.manual_seed(seed)
    model = Net()
    for unit in (model.features, model.fc1, model.fc2):
        fully_shard(unit, mesh=mesh)  # each unit: one all_gather just before it runs, freed after
    fully_shard(model, mesh=mesh)  # the root: whatever is left
    return model


def show_shards():
    """Placements and local shard shapes of parameters, gradients and optimizer state."""
    dist.init_process_group("gloo")
    model = sharded_net(seed=0)
    for name in SHOWN:
        p = model.get_parameter(name)  # a DTensor: a global shape, and this rank's piece
        say(f"{name:<17} {type(p).__name__} global {tuple(p.shape)} placements {p.placements} "
            f"local shard {tuple(p.to_local().shape)}")
    mine = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    say(f"holds {mine:,} of {total:,} parameters ({mine / total:.0%})")

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    images, labels = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))  # random images
    F.nll_loss(model(images), labels).backward()  # forward all_gathers each layer; backward reduce-scatters grads
    optimizer.step()
    fc1 = model.fc1.weight
    say(f"fc1.weight.grad local {tuple(fc1.grad.to_local().shape)}, Adam exp_avg local "
        f"{tuple(optimizer.state[fc1]['exp_avg'].to_local().shape)}: gradients and optimizer state are sharded too")
    dist.destroy_process_group()
    return mine


def _full_parameters(model):
    """Every parameter gathered whole (a collective: all ranks call it); kept on rank 0 only."""
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    return full if dist.get_rank() == 0 else None


def save_checkpoint(path):
    """Train one step, then every rank writes its own shards with DCP."""
    dist.init_process_group("gloo")
    model = sharded_net(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    images, labels = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    F.nll_loss(model(images), labels).backward()
    optimizer.step()  # now Adam has state (exp_avg, exp_avg_sq) to save as well

    model_state, optim_state = get_state_dict(model, optimizer)  # sharded state dicts (DTensors)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)  # all ranks write at once
    say(f"saved my shards: fc1.weight rows {tuple(model.fc1.weight.to_local().shape)}, "
        f"fc2.bias {tuple(model.fc2.bias.to_local().shape)}")
    full = _full_parameters(model)
    dist.destroy_process_group()
    return full


def load_checkpoint(path):
    """Load a checkpoint written by any number of ranks: DCP reads just the pieces of our shards."""
    dist.init_process_group("gloo")
    model = sharded_net(seed=123)  # different random weights: the load must overwrite all of them
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model_state, optim_state = get_state_dict(model, optimizer)  # the shapes we want, sharded our way
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)  # fills those tensors in place, resharding as needed
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    say(f"loaded my shards: fc1.weight rows {tuple(model.fc1.weight.to_local().shape)}, "
        f"fc2.bias {tuple(model.fc2.bias.to_local().shape)}, "
        f"Adam step {optimizer.state[model.fc1.weight]['step'].item():.0f}")
    full = _full_parameters(model)
    dist.destroy_process_group()
    return full


def state_bytes(blocks, hidden):
    """The bytes of parameters, gradients and AdamW state THIS rank holds, on the parameter-heavy Net, after a step.

    Counted from the tensors themselves: a DTensor's to_local() is the piece this rank stores.
    """
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Net(blocks=blocks, hidden=hidden)
    for unit in (model.features, model.fc1, *model.blocks, model.fc2, model):  # as lesson 05 does
        fully_shard(unit, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    F.nll_loss(model(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,))).backward()
    optimizer.step()

    def local_bytes(tensors):
        return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)
    held = {"parameters": local_bytes(model.parameters()),
            "gradients": local_bytes(p.grad for p in model.parameters()),
            "AdamW state": local_bytes(t for s in optimizer.state.values() for t in s.values() if t.dim() > 0)}
    say(" | ".join(f"{k} {v / 2**20:6.2f} MiB" for k, v in held.items()) +
        f" | total {sum(held.values()) / 2**20:6.2f} MiB")
    dist.destroy_process_group()
    return sum(held.values())
