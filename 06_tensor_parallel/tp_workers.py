"""Ranks for tests/test_tensor_parallel.py and the notebook: lesson 06's own pieces against a plain TPNet.

common.launcher.launch starts each function in fresh CPU processes (gloo); they live in a .py file because a
child process cannot import a function typed into a notebook. Every check builds the model exactly as the
lesson's main() does (TPNet after manual_seed, parallelize_module on each block, fully_shard) and returns plain
numbers; the gradient-norm check uses the trainer's clip_grad_norm (trainer/tp.py: --clip-grad).
"""
import copy
import importlib.util
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode, visualize_sharding
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the course folder (`common`) and this one (comm_bytes)

from comm_bytes import ByteCounter  # noqa: E402
from trainer.tp import clip_grad_norm  # noqa: E402


def lesson():
    """mnist_tpmodel.py as a module (its name starts with a digit folder, so not importable by name)."""
    if "mnist_tpmodel" not in sys.modules:
        spec = importlib.util.spec_from_file_location("mnist_tpmodel", HERE / "mnist_tpmodel.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["mnist_tpmodel"] = module
    return sys.modules["mnist_tpmodel"]


def start(tp: int):
    """The process group (once) and the lesson's ("dp", "tp") mesh: another --tp is another mesh of the same ranks."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    return init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))


def parallelize(model, mesh):
    """mnist_tpmodel.py's main(): TP over "tp" inside each block, then FSDP2 over "dp" on the units and the root."""
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], lesson().TP_PLAN)
    for unit in [model.features, model.fc1, *model.blocks, model.fc2, model]:
        fully_shard(unit, mesh=mesh["dp"])
    return model


def build(mesh, blocks: int, hidden: int, seed: int = 1):
    """The lesson's model on this rank (sharded) and a plain TPNet with the same full weights, without dropout
    (Identity in its place: the same function on both paths, and no view returned from an FSDP2 unit)."""
    torch.manual_seed(seed)  # as the lesson: the same weights on every rank
    plain = lesson().TPNet(blocks=blocks, hidden=hidden)
    model = parallelize(copy.deepcopy(plain), mesh)
    for net in (model, plain):
        net.features[-1], net.dropout = torch.nn.Identity(), torch.nn.Identity()
    return model, plain


def equivalence(mesh, blocks: int = 2, hidden: int = 16, batch: int = 4) -> dict:
    """One training step of the sharded model against the plain one on the whole global batch."""
    model, plain = build(mesh, blocks, hidden)
    dp, dp_rank = mesh.size(0), mesh.get_local_rank("dp")
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(dp * batch, 1, 28, 28, generator=g), torch.randint(0, 10, (dp * batch,), generator=g)
    mine = slice(dp_rank * batch, (dp_rank + 1) * batch)  # this TP group's share: the same on its TP peers
    with CommDebugMode() as comm, ByteCounter() as payloads, warnings.catch_warnings():  # counts and bytes
        # Under CommDebugMode (not without it; torch 2.14) FSDP2 sees its units' outputs as views and warns that
        # an in-place op on them would skip a gather. There is none here.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module", category=UserWarning)
        output = model(images[mine])
        forward = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        F.nll_loss(output, labels[mine]).backward()
    total = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    reference = plain(images)
    F.nll_loss(reference, labels).backward()
    grads = dict(plain.named_parameters())
    grad_diff = max((p.grad.full_tensor() - grads[name].grad).abs().max().item()
                    for name, p in model.named_parameters())
    norm = clip_grad_norm(model.parameters(), 1e9).item()  # max_norm 1e9: measures, clips nothing
    held = held_bytes(model)  # after one AdamW step
    return {"rank": dist.get_rank(), "dp_rank": dp_rank, "tp_rank": mesh.get_local_rank("tp"),
            "output_diff": (output - reference[mine]).abs().max().item(), "grad_diff": grad_diff,
            "norm": norm, "norm_plain": torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()]).item(),
            "forward": forward, "step": total, "bytes": payloads.bytes, "held": held,
            "initial": {k: v for k, v in plain.state_dict().items()} if dist.get_rank() == 0 else None,
            "local_shapes": {name: tuple(p.to_local().shape) for name, p in model.named_parameters()},
            "placements": {name: str(p.placements) for name, p in model.named_parameters()}}


def held_bytes(model) -> dict:
    """The bytes of this rank's pieces after one AdamW step: weights, gradients, exp_avg + exp_avg_sq."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()

    def size(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()
    return {"weights": sum(size(p) for p in model.parameters()), "gradients": sum(size(p.grad) for p in model.parameters()),
            "adamw": sum(size(state[k]) for state in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))}


def ddp_bytes(blocks: int = 2, hidden: int = 16, batch: int = 4) -> dict:
    """The bytes DDP's buckets hand to all_reduce in one step of a plain TPNet (a comm hook sees each bucket),
    and the bytes each rank holds."""
    model = DistributedDataParallel(lesson().TPNet(blocks=blocks, hidden=hidden))
    seen = []

    def counting_hook(state, bucket):
        seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    F.nll_loss(model(torch.randn(batch, 1, 28, 28)), torch.randint(0, 10, (batch,))).backward()
    return {"payload": sum(seen), "held": held_bytes(model)}


def sampler_indices(mesh, samples: int = 40, epoch: int = 1) -> list:
    """The training indices this rank reads in one epoch, with the lesson's sampler (by data-parallel rank)."""
    sampler = DistributedSampler(range(samples), num_replicas=mesh.size(0), rank=mesh.get_local_rank("dp"),
                                 shuffle=True, seed=1)
    sampler.set_epoch(epoch)
    return list(sampler)


def load_model_and_optimizer(mesh, path: str, blocks: int, hidden: int) -> dict:
    """Read a lesson checkpoint's model and optimizer into this mesh (the resharding is DCP's); full on rank 0."""
    model, _ = build(mesh, blocks, hidden, seed=99)  # other values: the load must replace them all
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)  # the lesson's default optimizer
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)  # only these keys; the checkpoint holds more (position, history, ...)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    full_model, full_optimizer = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    shapes = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    if dist.get_rank() != 0:
        return {"shapes": shapes}
    return {"shapes": shapes, "model": full_model, "optimizer": full_optimizer["state"]}


def checks(tp: int, load_tp: int | None = None, path: str | None = None, blocks: int = 2, hidden: int = 16) -> dict:
    """What tests/test_tensor_parallel.py asks of one group of ranks, in one launch (starting ranks is the slow part)."""
    mesh = start(tp)
    result = {"step": equivalence(mesh), "indices": sampler_indices(mesh), "ddp": ddp_bytes(blocks, hidden)}
    if load_tp is not None and load_tp != tp:
        result["step_other_mesh"] = equivalence(start(load_tp))  # e.g. FSDP2 alone: its collectives and bytes
    if path:
        result["load"] = load_model_and_optimizer(start(load_tp), path, blocks, hidden)
    return result


# ---- the notebook's cells (tensor_parallel.ipynb), 2 ranks each -------------------------------------------------

def show_placements() -> None:
    """A 4 x 4 tensor placed Shard(0), Shard(1), Replicate() over 2 ranks, and a Partial one: what each rank holds."""
    dist.init_process_group("gloo")
    mesh, rank = init_device_mesh("cpu", (dist.get_world_size(),)), dist.get_rank()
    full = torch.arange(16.0).reshape(4, 4)
    for placement in (Shard(0), Shard(1), Replicate()):
        piece = distribute_tensor(full, mesh, [placement]).to_local()
        print(f"[rank {rank}] {placement!r:13} local {tuple(piece.shape)}: {piece.tolist()}")
    partial = DTensor.from_local(torch.full((2,), rank + 1.0), mesh, [Partial()])  # rank 0 holds 1s, rank 1 2s
    print(f"[rank {rank}] Partial()     local {partial.to_local().tolist()}, full_tensor() (the sum over ranks) "
          f"{partial.full_tensor().tolist()}")
    for placement in (Shard(0), Shard(1)):  # DTensor's own picture of who holds which rows and columns (rank 0)
        if rank == 0:
            print(f"visualize_sharding, {placement!r} (cpu:N is rank N):")
        visualize_sharding(distribute_tensor(full, mesh, [placement]))  # needs the tabulate package


def pair_by_hand(hidden: int = 4, batch: int = 2) -> None:
    """One MLP block three ways: whole, by hand with one all_reduce, and with parallelize_module."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same block and input on every rank
    block, x = lesson().MLP(hidden), torch.randn(batch, hidden)
    with torch.no_grad():
        whole = block(x)
        cols = slice(rank * 4 * hidden // world, (rank + 1) * 4 * hidden // world)  # my share of the 4h features
        y = F.relu(x @ block.up.weight[cols].T + block.up.bias[cols])  # column-parallel: my slice, no messages
        z = y @ block.down.weight[:, cols].T  # row-parallel: a partial sum of down(y), batch x hidden
        print(f"[rank {rank}] up slice {tuple(y.shape)}, partial sum of down {tuple(z.shape)}")
        dist.all_reduce(z)  # the pair's one collective
        by_hand = x + z + block.down.bias  # the bias once, after the sum
    mesh = init_device_mesh("cpu", (world,))
    tp_block = parallelize_module(copy.deepcopy(block), mesh, lesson().TP_PLAN)
    with torch.no_grad(), CommDebugMode() as comm:
        library = tp_block(x)
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    print(f"[rank {rank}] max |by hand - whole| = {(by_hand - whole).abs().max().item():.1e}, "
          f"max |parallelize_module - whole| = {(library - whole).abs().max().item():.1e}, "
          f"parallelize_module's collectives {counts}")


def comm_table(tp: int, blocks: int = 2, hidden: int = 16) -> str:
    """One training step of the lesson's model on a (world/tp, tp) mesh under CommDebugMode: its table (rank 0)."""
    mesh = start(tp)
    model, _ = build(mesh, blocks, hidden)
    with CommDebugMode() as comm, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module", category=UserWarning)  # as in equivalence()
        F.nll_loss(model(torch.randn(4, 1, 28, 28)), torch.randint(0, 10, (4,))).backward()
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    print(f"[rank {dist.get_rank()}] mesh dp {mesh.size(0)} x tp {tp}: {counts}")
    return re.sub(r"\x1b\[[0-9;]*m", "", comm.generate_comm_debug_tracing_table(noise_level=0))  # no colours
