"""Ranks for tests/test_pipeline.py: lesson 07's own stages and schedules against a plain Net, on CPU with gloo;
at the end, those of the notebook (pipeline.ipynb) and the exercises' solutions: a small model cut by hand.

common.launcher.launch starts each function in fresh CPU processes; they live in a .py file because a child process
cannot import a function typed into a notebook. Every check builds the stages exactly as the lesson does (build,
make_schedule) and returns plain numbers; the test asserts on them in the parent process.
"""
import sys
from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the course folder (`common`) and this one (bubble)

from bubble import lesson, measure  # noqa: E402  (lesson: the script, imported by its path)
from common.model import Net  # noqa: E402


def start(dp: int):
    """The process group (once) and the lesson's ("pp", "dp") mesh."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return init_device_mesh("cpu", (dist.get_world_size() // dp, dp), mesh_dim_names=("pp", "dp"))


def flags(schedule: str, blocks: int = 4, hidden: int = 16, microbatches: int = 4, seed: int = 1) -> Namespace:
    return Namespace(pp_schedule=schedule, blocks=blocks, hidden=hidden, width=1, seed=seed, compile=None,
                     microbatches=microbatches)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def equivalence(mesh, schedule: str, batch: int = 8, microbatches: int = 4) -> dict:
    """One pipelined training step against the plain Net on the whole global batch; then one with scale_grads=False.
    Dropout is Identity on both paths: the same function, whatever the random streams."""
    L = lesson()
    args = flags(schedule, microbatches=microbatches)
    stages, ids, count, model, _ = L.build(args, mesh, torch.device("cpu"))
    torch.manual_seed(args.seed)
    plain = Net(width=1, blocks=args.blocks, hidden=args.hidden)  # what init_weights must reproduce
    for net in [plain, *stages]:
        if getattr(net, "first", True):
            net.features[-1], net.dropout = torch.nn.Identity(), torch.nn.Identity()
    initial = max((full(p) - dict(plain.named_parameters())[k]).abs().max().item() for k, p in model.named_parameters())
    schedule_ = L.make_schedule(args, stages, ids, count, mesh["pp"].get_group(), torch.device("cpu"), training=True)
    dp, dp_rank = mesh.size(1), mesh.get_local_rank("dp")
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(dp * batch, 1, 28, 28, generator=g), torch.randint(0, 10, (dp * batch,), generator=g)
    mine = slice(dp_rank * batch, (dp_rank + 1) * batch)  # this pipeline's share
    first, last = 0 in ids, count - 1 in ids
    F.nll_loss(plain(images), labels).backward()  # one process, the whole global batch, the mean loss
    reference = {k: p.grad for k, p in plain.named_parameters()}
    out = {"rank": dist.get_rank(), "pp_rank": mesh.get_local_rank("pp"), "dp_rank": dp_rank, "ids": ids,
           "count": count, "initial_diff": initial, "names": sorted(k for k, _ in model.named_parameters())}
    for scale in (True, False):
        schedule_.scale_grads = scale  # read at the end of step(): divide by the micro-batches or not
        losses = []
        model.zero_grad(set_to_none=True)
        schedule_.step(*[images[mine]] * first, target=labels[mine] if last else None, losses=losses)
        factor = 1 if scale else microbatches  # without the division: m times the mean, the sum of m means
        grads = {k: full(p.grad) for k, p in model.named_parameters()}
        out[f"grad_diff_{scale}"] = max((g - factor * reference[k]).abs().max().item() for k, g in grads.items())
        if last:
            loss = torch.stack(losses).mean().item()
            out[f"loss_diff_{scale}"] = abs(loss - F.nll_loss(plain(images[mine]), labels[mine]).item())
            out["losses"] = len(losses)
    return out


class Stub:
    """What checkpoint_state asks of the run's History and CheckpointDir."""
    run = "test"

    def state_dict(self) -> dict:
        return {"rows": "[]"}

    def load_state_dict(self, *args) -> None:
        pass


def roundtrip(mesh, path: str, schedule: str = "interleaved") -> dict:
    """One training step, the lesson's DCP checkpoint, and a model and optimizer built afresh (other weights, no
    state) that load it: the largest difference in any weight and optimizer state, and the learning rates."""
    L = lesson()
    made = []
    for seed in (1, 2):
        stages, ids, count, model, _ = L.build(flags(schedule, seed=seed), mesh, torch.device("cpu"))
        optimizer = torch.optim.Adadelta(model.parameters(), lr=0.5)
        made.append((stages, model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)))
    (stages, model, optimizer, scheduler), (_, fresh, fresh_optimizer, fresh_scheduler) = made
    pipe = L.make_schedule(flags(schedule), stages, ids, count, mesh["pp"].get_group(), torch.device("cpu"),
                           training=True)
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
    pipe.step(*[images] * (0 in ids), target=labels if count - 1 in ids else None)
    optimizer.step()
    scheduler.step()  # lr 0.5 x 0.7
    position = L.Position()
    L.save_checkpoint(Path(path), model, optimizer, scheduler, position, Stub(), Stub())
    L.load_checkpoint(Path(path), fresh, fresh_optimizer, fresh_scheduler, L.Position(), Stub(), Stub())
    weights = max((full(a) - full(b)).abs().max().item() for a, b in zip(model.parameters(), fresh.parameters()))
    state = max((full(s[k]) - full(fresh_optimizer.state[q][k])).abs().max().item()
                for p, q in zip(model.parameters(), fresh.parameters()) for s in [optimizer.state[p]]
                for k in ("square_avg", "acc_delta"))
    return {"weights": weights, "state": state, "lr": [g["lr"] for g in fresh_optimizer.param_groups]}


def checks(dp: int, schedules: list[str], path: str) -> dict:
    """equivalence() for each schedule on one mesh, a checkpoint's round trip, and (pp only) a measured timeline
    of lesson 07's bubble."""
    mesh = start(dp)
    results = {name: equivalence(mesh, name) for name in schedules}
    results["roundtrip"] = roundtrip(mesh, path)
    if dp == 1:
        results["bubble"] = measure("gpipe", 4, "cpu", steps=2, blocks=4, hidden=16, batch=16)
    return results


# ---- the notebook (pipeline.ipynb): a small model cut into 2 stages by hand, one PipelineStage per rank --------

def tiny_model() -> torch.nn.Sequential:
    """The notebook's model, the same on every rank (seed 0): 6 features -> 8 -> 8 -> 3 classes."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 3))


def tiny_batch(size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def by_hand(schedule: str = "gpipe", microbatches: int = 4, scale_grads: bool = True, quiet: bool = False) -> dict:
    """One training step of tiny_model cut in two by hand (layers 0-1 on rank 0, 2-4 on rank 1) under ScheduleGPipe
    or Schedule1F1B, printing each forward (F) and backward (B) in the order the rank ran them and what it got and
    sent; then each gradient against one process's on the whole batch. Returns the numbers."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    part = tiny_model()[:2] if rank == 0 else tiny_model()[2:]  # slices keep the layers' names: "0", "2", "4"
    stage = PipelineStage(part, rank, p, torch.device("cpu"))  # stage `rank` of p; sends and receives: the world
    pipe = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stage, microbatches, loss_fn=F.cross_entropy,
                                                                   scale_grads=scale_grads)
    images, labels = tiny_batch()
    events, current = [], []

    def on_forward(module, inputs, output):  # the stage's layers ran: what came in, what goes on
        if not current:
            return  # a forward outside forward_one_chunk (none in torch 2.14; kept safe)
        mb = current[-1]
        if rank == 0:
            events.append(f"F{mb}: images {_shape(inputs[0])} of micro-batch {mb} -> sends {_shape(output)} to rank 1")
        else:
            events.append(f"F{mb}: receives {_shape(inputs[0])} from rank 0 -> output {_shape(output)} -> loss")
            inputs[0].register_hook(lambda g, mb=mb: events.append(f"B{mb}: sends the gradient {_shape(g)} of "
                                                                   f"what it received back to rank 0"))
        if rank == 0:
            output.register_hook(lambda g, mb=mb: events.append(f"B{mb}: receives the gradient {_shape(g)} from "
                                                                f"rank 1 -> the gradients of layer 0"))

    def wrap(method):
        def wrapper(chunk_id, *args, **kwargs):
            current.append(chunk_id)
            try:
                return method(chunk_id, *args, **kwargs)
            finally:
                current.pop()
        return wrapper

    part.register_forward_hook(on_forward)
    stage.forward_one_chunk = wrap(stage.forward_one_chunk)
    stage.backward_one_chunk = wrap(stage.backward_one_chunk)
    losses = []
    if rank == 0:
        pipe.step(images)  # the whole batch: the schedule cuts it into micro-batches
    else:
        pipe.step(target=labels, losses=losses, return_outputs=False)
    reference = tiny_model()  # one process, the whole batch, the mean loss
    whole = F.cross_entropy(reference(images), labels)
    whole.backward()
    ref = dict(reference.named_parameters())
    factor = 1 if scale_grads else microbatches
    diff = max((q.grad - factor * ref[k].grad).abs().max().item() for k, q in part.named_parameters())
    ratio = {k: (q.grad / ref[k].grad).flatten().tolist() for k, q in part.named_parameters()}
    order = " ".join(e.split(":")[0] for e in events)
    if not quiet:
        layers = ", ".join(f"{k}: {type(m).__name__}" for k, m in part.named_children())
        print(f"stage {rank} of {p} ({layers}): {sum(q.numel() for q in part.parameters())} parameters")
        print(f"{schedule}, {microbatches} micro-batches of {len(images) // microbatches}; order: {order}")
        for e in events:
            print("  " + e)
        if losses:
            print(f"losses of the {len(losses)} micro-batches: {[round(x.item(), 4) for x in losses]}")
            print(f"their mean {torch.stack(losses).mean().item():.6f}; one process, the whole batch: "
                  f"{whole.item():.6f}")
        names = ", ".join(k for k, _ in part.named_parameters())
        print(f"max |grad - one process's grad| over {names}: {diff:.1e}")
    dist.barrier()
    return {"order": order, "diff": diff, "ratio": ratio, "grads": {k: q.grad for k, q in part.named_parameters()},
            "loss_diff": abs(torch.stack(losses).mean().item() - whole.item()) if losses else None}


def bubble_rows(schedule: str, microbatches: list[int], steps: int = 3, blocks: int = 8, hidden: int = 256,
                batch: int = 32) -> list[dict]:
    """bubble.measure for each micro-batch count, on the ranks of this launch (one pipeline of world-size stages)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return [measure(schedule, m, "cpu", steps=steps, blocks=blocks, hidden=hidden, batch=batch) for m in microbatches]
