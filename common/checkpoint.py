"""Single-file checkpoints for lessons 02-04: everything needed to resume, written atomically.

Rank 0 writes, because under DDP every rank holds the same weights; the others wait at a
barrier so nobody reads a half-written file. The file is first written to a temporary name
in the same folder, flushed to disk, then renamed over the old one: a crash mid-save leaves
the previous checkpoint intact. (Lesson 05 shards its checkpoints with DCP instead.)
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from common.cli import args_to_dict
from common.distributed import barrier, get_rank, get_world_size, is_main_process
from common.errors import CourseError, one_line
from common.files import atomic_write

FORMAT = "distributed-pytorch-course/v1"


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP / DataParallel / torch.compile wrappers (no 'module.' prefixes)."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def atomic_save(obj, path: str | os.PathLike) -> None:
    """torch.save, all or nothing: a kill mid-save leaves the previous file intact."""
    with atomic_write(path) as f:
        torch.save(obj, f)


def gather_rng_states() -> list[dict]:
    """Every rank's random-number state (dropout differs per rank), collected on all ranks."""
    mine = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["cuda"] = torch.cuda.get_rng_state()
    if not dist.is_initialized():
        return [mine]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def restore_rng_states(states: list[dict]) -> None:
    """Continue this rank's random numbers exactly; skipped when the number of ranks changed."""
    if len(states) != get_world_size():
        return
    mine = states[get_rank()]
    torch.set_rng_state(mine["torch"].cpu())
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["cuda"].cpu())


def save_checkpoint(path, model, optimizer=None, scheduler=None, *, epoch: int, step: int,
                    args=None, lesson: str = "", model_state: dict | None = None) -> None:
    """Rank 0 writes the checkpoint; every rank returns only once the file is complete.

    model_state replaces model.state_dict() when the weights were gathered elsewhere (FSDP's full state).
    """
    rng = gather_rng_states()  # a collective: every rank takes part, rank 0 keeps them
    if is_main_process():
        atomic_save({
            "format": FORMAT,
            "lesson": lesson,
            "model": unwrap(model).state_dict() if model_state is None else model_state,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "epoch": epoch,
            "step": step,
            "rng": rng,
            "args": args_to_dict(args),
        }, path)
    barrier()


def read_checkpoint(path, map_location="cpu") -> dict:
    """Load and validate a checkpoint file; one-line CourseError for anything that is not one of ours."""
    path = Path(path)
    if path.is_dir():
        raise CourseError(f"{path} is a folder (a sharded DCP checkpoint from lesson 05?): "
                          "pass a .pt file written by this lesson's script")
    if not path.exists():
        raise CourseError(f"checkpoint {path} does not exist: check --resume")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated zip, pickle of arbitrary objects, random bytes, ...
        raise CourseError(f"{path} is not a readable checkpoint (truncated or not written by this course): "
                          f"{one_line(exc, 200)}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CourseError(f"{path} was not written by this course's save_checkpoint: "
                          "pass a checkpoint from this course's --output-dir")
    return ckpt


def load_checkpoint(path, model, optimizer=None, scheduler=None, map_location="cpu") -> dict:
    """Restore model (plain or wrapped), optimizer and scheduler in place; return the checkpoint dict."""
    ckpt = read_checkpoint(path, map_location)
    try:
        unwrap(model).load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        raise CourseError(f"{path} holds a model of another shape ({one_line(exc, 160)}): "
                          "use the same --width and lesson as when it was saved") from None
    if optimizer is not None and ckpt["optimizer"] is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    if scheduler is not None and ckpt["scheduler"] is not None:
        scheduler.load_state_dict(ckpt["scheduler"])
    restore_rng_states(ckpt["rng"])
    return ckpt
