"""Ranks for tests/test_pipeline.py: lesson 07's stages (stages.py) and schedules against a plain Net, on CPU with gloo.

common.launcher.launch starts each function in fresh CPU processes. Every check builds the stages as the trainer
does (trainer/pp.py: build, make_schedule, PipelineDCP: lesson 07's loop with every schedule and exact resume)
and returns plain numbers; the test asserts on them in the parent process.
"""
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

LESSON = Path(__file__).resolve().parents[1] / "07_pipeline_parallel"
sys.path[:0] = [str(LESSON.parent), str(LESSON)]  # the course folder (`common`) and lesson 07's (bubble)

import trainer.pp as pipeline  # noqa: E402  (the trainer's build, make_schedule, checkpoints: lesson 07 grown)
from bubble import measure  # noqa: E402
from common.errors import CourseError  # noqa: E402
from common.model import Net  # noqa: E402
from common.position import Position  # noqa: E402


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
    L = pipeline
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
    """What the checkpoint asks of the run's History and CheckpointDir."""
    run = "test"

    def state_dict(self) -> dict:
        return {"rows": "[]"}

    def load_state_dict(self, *args) -> None:
        pass


def run_of(model, optimizer, scheduler, position=None) -> SimpleNamespace:
    """What the trainer's pipeline checkpoint (trainer/pp.py: PipelineDCP, trainer/state.py) asks of a run."""
    return SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler, scaler=None,
                           position=position or Position(), history=Stub(), checkpoints=Stub())


def roundtrip(mesh, path: str, schedule: str = "interleaved") -> dict:
    """One training step, the lesson's DCP checkpoint, and a model and optimizer built afresh (other weights, no
    state) that load it: the largest difference in any weight and optimizer state, and the learning rates."""
    L = pipeline
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
    L.PipelineDCP().save(Path(path), run_of(model, optimizer, scheduler))
    L.PipelineDCP().load(Path(path), run_of(fresh, fresh_optimizer, fresh_scheduler))
    weights = max((full(a) - full(b)).abs().max().item() for a, b in zip(model.parameters(), fresh.parameters()))
    state = max((full(s[k]) - full(fresh_optimizer.state[q][k])).abs().max().item()
                for p, q in zip(model.parameters(), fresh.parameters()) for s in [optimizer.state[p]]
                for k in ("square_avg", "acc_delta"))
    return {"weights": weights, "state": state, "lr": [g["lr"] for g in fresh_optimizer.param_groups]}


class CollectiveCounts(CommDebugMode):
    """CommDebugMode's collective counts without its module tracker, whose hooks fail inside the pipeline's backward
    (torch 2.14.1, in stage_backward_input's torch.autograd.grad: "A leaf node was passed to
    _will_engine_execute_node but we are currently running autograd.grad()")."""

    def __init__(self):
        super().__init__()
        self.advanced_module_tracker = SimpleNamespace(name="Global", is_bw=False, activation_checkpointing=False,
                                                       module_parents_dict={"Global": set()},
                                                       __enter__=lambda: None, __exit__=lambda *args: None)


def unsharded_bytes(stages) -> int:
    """The bytes of the gathered (unsharded) parameters this rank holds now: FSDP2 registers them, plain tensors,
    in place of the DTensor shards while a unit is unsharded."""
    return sum(p.numel() * p.element_size() for stage in stages for p in stage.parameters()
               if not isinstance(p, DTensor))


def gathers(mesh, microbatches: int, reshard_after_forward: bool | None) -> dict:
    """The lesson's model (--blocks 4 --hidden 128, its defaults) in stages on the pp x dp mesh, 1F1B, built by the
    lesson (None) or with FSDP2's reshard_after_forward forced: the all-gathers of a training step (the second: the
    first also infers the shapes), per unit; and the gathered bytes held at the start of each micro-batch's forward
    (F) and backward (B)."""
    L, args = pipeline, flags("1f1b", hidden=128, microbatches=microbatches)
    lesson_fully_shard = L.fully_shard
    if reshard_after_forward is not None:
        forced = {"reshard_after_forward": reshard_after_forward}
        L.fully_shard = lambda module, **kw: fully_shard(module, **kw | forced)
    try:
        stages, ids, count, model, _ = L.build(args, mesh, torch.device("cpu"))
    finally:
        L.fully_shard = lesson_fully_shard
    pipe = L.make_schedule(args, stages, ids, count, mesh["pp"].get_group(), torch.device("cpu"), training=True)
    held = []

    def before_forward(module, inputs):
        held.append(("F", unsharded_bytes(stages)))

    def after_forward(module, inputs, output):
        output.register_hook(lambda grad: held.append(("B", unsharded_bytes(stages))))

    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
    for step in range(2):
        if step:  # the second step: watched
            stages[0].register_forward_pre_hook(before_forward)
            stages[0].register_forward_hook(after_forward)
        with CollectiveCounts() as comm:
            pipe.step(*[images] * (0 in ids), target=labels if count - 1 in ids else None)
        model.zero_grad(set_to_none=True)
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    units = sum(len(stage.units()) for stage in stages)
    full_bytes = sum(full(p).numel() * full(p).element_size() for p in model.parameters())
    return {"units": units, "all_gather": counts.get("_allgather_base_", 0) / units,
            "reduce_scatter": counts.get("_reduce_scatter_base_", 0) / units, "held": held, "full_bytes": full_bytes,
            "after_step": unsharded_bytes(stages)}


def state(model, optimizer) -> dict:
    """Every weight and optimizer value of the whole model, by name, on every rank (each rank gives its stages')."""
    full_state = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    weights, optim = get_state_dict(model, optimizer, options=full_state)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {**{f"model.{k}": v for k, v in weights.items()},
                                   **{f"optim.{k}": v for k, v in optim.items()}})
    return {k: v for part in every for k, v in part.items()}


def relayout(path: str) -> dict:
    """A checkpoint of a pp 2 x dp 2 1F1B run after one step, at an epoch's end and mid-epoch, resumed by other
    layouts of the same 4 ranks: another --dp, number of stages and --pp-schedule. The largest difference from what
    was saved, by name, or the one-line error."""
    L, cpu = pipeline, torch.device("cpu")

    def made(shape, schedule, seed):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp"))
        stages, ids, count, model, _ = L.build(flags(schedule, seed=seed), mesh, cpu)
        optimizer = torch.optim.Adadelta(model.parameters(), lr=0.5)
        return mesh, stages, ids, count, model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)

    mesh, stages, ids, count, model, optimizer, scheduler = made((2, 2), "1f1b", 1)
    pipe = L.make_schedule(flags("1f1b"), stages, ids, count, mesh["pp"].get_group(), cpu, training=True)
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
    pipe.step(*[images] * (0 in ids), target=labels if count - 1 in ids else None)
    optimizer.step()
    scheduler.step()
    saved = state(model, optimizer)
    for name, position in (("end", Position(2, 0)), ("mid", Position(1, 3))):
        L.PipelineDCP().save(Path(path) / name, run_of(model, optimizer, scheduler, position))
    out = {"saved": sorted(saved)}
    for shape, schedule in (((4, 1), "1f1b"), ((2, 2), "interleaved"), ((4, 1), "gpipe")):
        for name in ("end", "mid"):
            _, _, _, _, fresh, fresh_optimizer, fresh_scheduler = made(shape, schedule, 2)
            key = f"{shape[0]}x{shape[1]} {schedule} {name}"
            try:
                L.PipelineDCP().load(Path(path) / name, run_of(fresh, fresh_optimizer, fresh_scheduler))
            except CourseError as e:
                out[key] = str(e).replace(path, "PATH")
                continue
            mine = state(fresh, fresh_optimizer)
            out[key] = {"names": sorted(mine), "lr": fresh_optimizer.param_groups[0]["lr"],
                        "diff": max((v - saved[k]).abs().max().item() if isinstance(v, torch.Tensor)
                                    else float(v != saved[k]) for k, v in mine.items())}
    return out


def checks(dp: int, schedules: list[str], path: str) -> dict:
    """equivalence() for each schedule on one mesh, a checkpoint's round trip; pp only: a measured timeline of
    lesson 07's bubble; pp x dp: FSDP2's all-gathers per step, and checkpoints resumed by other layouts."""
    mesh = start(dp)
    results = {name: equivalence(mesh, name) for name in schedules}
    results["roundtrip"] = roundtrip(mesh, path)
    if dp == 1:
        results["bubble"] = measure("gpipe", 4, "cpu", steps=2, blocks=4, hidden=16, batch=16)
    else:
        results["gathers"] = {(m, raf): gathers(mesh, m, raf) for m in (2, 4) for raf in (True, None)}
        results["relayout"] = relayout(path + "-relayout")
    return results
