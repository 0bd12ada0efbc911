"""Workers for tests/test_fsdp.py: lesson 05's FSDP2 pieces against a plain, unsharded Net, on CPU with gloo.

They live in a module so that common.launcher's spawned processes can import them. Each check returns
the largest difference it found; the test asserts on them in the parent process.
"""
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import trainer.fsdp2 as lesson05
from common.cli import base_parser
from common.model import Net
from common.position import Position
from trainer.loop import Run
from trainer.optim import make_optimizer, make_scheduler


def sharded_net(width, mesh, seed):
    """What lesson 05 does: build on the meta device, fully_shard per unit and the root, to_empty, init_weights."""
    with torch.device("meta"):
        model = Net(width=width)
    for unit in (model.features, model.fc1, *model.blocks, model.fc2, model):
        fully_shard(unit, mesh=mesh)
    model.to_empty(device="cpu")
    lesson05.init_weights(model, base_parser("05", "test").parse_args(["--seed", str(seed), "--width", str(width)]))
    return model


def no_dropout(model):
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # the same function on every path


def full_state(model):
    """The whole model's weights on every rank (a collective)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def max_diff(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def lesson_args(output_dir, grad_accum, clip_grad):
    args = base_parser("05_multigpu_fsdp_training", "test").parse_args(
        ["--optimizer", "sgd", "--lr", "0.1", "--output-dir", str(output_dir), "--epochs", "1"])
    args.grad_accum, args.clip_grad = grad_accum, clip_grad
    return args


def one_step_with_lesson_train(width, mesh, batches, grad_accum, clip_grad, output_dir):
    """One optimizer step of the trainer's loop (trainer/loop.py) as --parallel fsdp2 runs it (its no_sync) on this
    rank's micro-batches, dropout off; the full weights after."""
    model = sharded_net(width, mesh, seed=1)
    no_dropout(model)
    args = lesson_args(output_dir, grad_accum, clip_grad)
    optimizer = make_optimizer(args, model.parameters())
    run = SimpleNamespace(args=args, model=model, device=torch.device("cpu"), train_loader=batches, optimizer=optimizer,
                          scheduler=make_scheduler(args, optimizer, steps_per_epoch=1), position=Position(),
                          stopping=lambda: False, no_sync=lambda: lesson05.no_sync(model), amp_dtype=None,
                          scaler=torch.amp.GradScaler("cpu", enabled=False),  # no --amp
                          clip_grad_norm=torch.nn.utils.clip_grad_norm_, counted=True)
    Run.train_epoch(run)
    return full_state(model)


def fsdp_equivalence(width, micro, accum, clip, output_dir):
    """On a 1-D mesh over all ranks and on an HSDP (2, W/2) mesh:
    init: meta-device + the lesson's init_weights equals eager Net() with the same seed;
    init_from: set_model_state_dict(full, broadcast_from_rank0) gives exactly rank 0's weights;
    accum: `accum` micro-batches under the trainer's no_sync (set_requires_gradient_sync(False)) equal one step
        on accum-times-larger batches, and equal a plain Net stepping on the whole global batch;
    clip: the same with --clip-grad active; the sharded norm (.full_tensor()) equals the plain Net's norm.
    """
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    eager = Net(width=width)
    generator = torch.Generator().manual_seed(123)
    per_rank = micro * accum
    images = torch.randn(world * per_rank, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (world * per_rank,), generator=generator)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    micro_batches = list(zip(images[mine].split(micro), labels[mine].split(micro)))
    big_batch = [(images[mine], labels[mine])]

    # The reference: a plain Net on the whole global batch (the mean over all ranks' images), SGD as the lesson.
    reference = {}
    for clip_grad in (None, clip):
        plain = Net(width=width)
        plain.load_state_dict(eager.state_dict())
        no_dropout(plain)
        args = lesson_args(output_dir, 1, clip_grad)
        optimizer = make_optimizer(args, plain.parameters())
        F.nll_loss(plain(images), labels).backward()
        exact = torch.cat([p.grad.double().flatten() for p in plain.parameters()]).norm().item()
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), clip_grad or float("inf"))  # fp32: ~1e-5 off
        optimizer.step()
        reference[clip_grad] = (plain.state_dict(), (norm.item(), exact))

    results = {}
    for name, shape in (("fsdp", (world,)), ("hsdp", (2, world // 2))):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        out = {"placements": str(sharded_net(width, mesh, seed=1).fc1.weight.placements)}
        out["init"] = max_diff(full_state(sharded_net(width, mesh, seed=1)), eager.state_dict())

        model = sharded_net(width, mesh, seed=1)
        torch.manual_seed(99)
        other = Net(width=width).state_dict()  # rank 0's file, in the lesson
        sent = {k: v.clone() for k, v in other.items()} if rank == 0 else {}  # it is turned into shards in place
        set_model_state_dict(model, sent,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        out["init_from"] = max_diff(full_state(model), other)

        for clip_grad in (None, clip):
            accumulated = one_step_with_lesson_train(width, mesh, micro_batches, accum, clip_grad, output_dir)
            large = one_step_with_lesson_train(width, mesh, big_batch, 1, clip_grad, output_dir)
            key = "clip" if clip_grad else "accum"
            out[key] = max(max_diff(accumulated, large), max_diff(accumulated, reference[clip_grad][0]))

        model = sharded_net(width, mesh, seed=1)
        no_dropout(model)
        F.nll_loss(model(images[mine]), labels[mine]).backward()  # reduce-scatter: each rank keeps its shard
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        out["norm"], (out["norm_plain"], out["norm_float64"]) = norm.full_tensor().item(), reference[clip][1]
        results[name] = out
    dist.barrier()
    dist.destroy_process_group()
    return results
