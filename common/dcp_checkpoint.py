"""Sharded checkpoints for FSDP2 with torch.distributed.checkpoint (DCP).

Every rank writes only its own shards, in parallel, into one folder; DCP records how the
tensors were split, so the folder loads again on a DIFFERENT number of ranks (it reshards).
The folder is written under a temporary name and swapped in only when every rank has finished,
so a crash mid-save never replaces a good checkpoint.
"""
from __future__ import annotations

import io
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)

from common.checkpoint import gather_rng_states, restore_rng_states, save_checkpoint, unwrap
from common.cli import args_to_dict
from common.distributed import barrier, is_main_process
from common.errors import CourseError, one_line


def _state(model, optimizer, scheduler, epoch: int, step: int, args, lesson: str, rng: bytes = b"") -> dict:
    model_sd, optim_sd = get_state_dict(unwrap(model), optimizer)  # DTensor shards, no communication
    return {"model": model_sd, "optim": optim_sd,
            "meta": {"lesson": lesson, "epoch": epoch, "step": step, "args": args_to_dict(args), "rng": rng,
                     "scheduler": scheduler.state_dict() if scheduler is not None else {}}}


def save_sharded(path, model, optimizer, scheduler=None, *, epoch: int, step: int, args=None,
                 lesson: str = "") -> None:
    """All ranks call this: each writes its shards to PATH.tmp, then rank 0 swaps it in for PATH."""
    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that was killed
    barrier()
    buffer = io.BytesIO()
    torch.save(gather_rng_states(), buffer)  # one opaque value: its length depends on the number of ranks
    state = _state(model, optimizer, scheduler, epoch, step, args, lesson, buffer.getvalue())
    dcp.save(state, checkpoint_id=tmp)
    barrier()  # every rank's shards are on disk
    if is_main_process():
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_sharded(path, model, optimizer, scheduler=None, lesson: str = "") -> dict:
    """All ranks call this with the model already sharded; returns the saved epoch/step/args."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        hint = "a .pt file from lessons 02-04?" if path.is_file() else "missing or not a DCP folder"
        raise CourseError(f"{path} is not a sharded DCP checkpoint ({hint}): "
                          f"pass a checkpoint folder written by lesson 05's --output-dir")
    state = _state(model, optimizer, scheduler, 0, 0, None, lesson)
    try:
        dcp.load(state, checkpoint_id=path)  # reads the pieces this rank needs, whatever the old world size
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise CourseError(f"{path} does not fit this model ({one_line(exc, 200)}): "
                          "use the same --width as when it was saved") from None
    set_state_dict(unwrap(model), optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    meta = state["meta"]
    if meta["lesson"] != lesson:
        raise CourseError(f"{path} was written by {meta['lesson']!r}, not {lesson!r}")
    if scheduler is not None and meta["scheduler"]:
        scheduler.load_state_dict(meta["scheduler"])
    if meta["rng"]:
        restore_rng_states(torch.load(io.BytesIO(meta["rng"]), weights_only=True))
    return meta


def export_full(path, model, *, epoch: int, args=None, lesson: str = "") -> None:
    """Gather the full (unsharded) weights onto rank 0's CPU and save one .pt for inference."""
    full = get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    save_checkpoint(path, model, epoch=epoch, step=0, args=args, lesson=lesson,
                    model_state={k: v.to(torch.float32) for k, v in full.items()})
