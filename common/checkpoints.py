"""The checkpoint folder of a run: names, which checkpoint to resume from, keep the newest N.

The lesson scripts write and read the checkpoints themselves (torch.save / dcp.save); this class
only manages OUTPUT_DIR/checkpoints/ckpt-eEEEE-sSSSSSS(.pt), named after the epochs completed and
the optimizer steps already done in the next one, so that names sort by progress. It refuses to
mix runs: a fresh run never writes among an earlier run's checkpoints, and a resume refuses, in one
line, a checkpoint of an incompatible run.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from common.distributed import barrier, is_main_process
from common.errors import CourseError, one_line
from common.log import log0
from common.progress import FORMAT, compatibility

NAME = re.compile(r"^ckpt-e(\d{4})-s(\d{7})(\.pt)?$")


def read_progress(path) -> dict:
    """The Progress state saved in a checkpoint file (.pt) or DCP folder; one-line CourseError if unreadable."""
    path = Path(path)
    if not path.exists():
        raise CourseError(f"checkpoint {path} does not exist: check --resume")
    try:
        if path.is_dir():
            template = {"progress": {"format": "", "epoch": 0, "step": 0, "rng": b"",
                                     "run": {k: None for k in compatibility(None, "")}}}
            dcp.load(template, checkpoint_id=path)  # reads only these few values, on every rank
            state = template["progress"]
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)["progress"]
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise CourseError(f"{path} is not a readable checkpoint (truncated, or not written by this course): "
                          f"{one_line(exc, 200)}") from None
    if state.get("format") != FORMAT:
        raise CourseError(f"{path} was not written by this version of the course: start fresh or pass another")
    return state


class CheckpointDir:
    """OUTPUT_DIR/checkpoints. sharded=False: one .pt per checkpoint (lessons 02-04); True: DCP folders (05)."""

    def __init__(self, output_dir, args, lesson: str, sharded: bool = False):
        self.dir = Path(output_dir) / "checkpoints"
        self.run = compatibility(args, lesson)
        self.keep, self.sharded = args.keep_checkpoints, sharded

    def path(self, progress) -> Path:
        """Where the checkpoint of `progress` goes: epochs completed and steps done in the next epoch."""
        return self.dir / f"ckpt-e{progress.epoch - 1:04d}-s{progress.step:07d}{'' if self.sharded else '.pt'}"

    def all(self) -> list[Path]:
        """The checkpoints in the folder, newest first."""
        if not self.dir.is_dir():
            return []
        return sorted((p for p in self.dir.iterdir() if NAME.match(p.name)), key=lambda p: p.name, reverse=True)

    def resume_from(self, spec: str | None) -> Path | None:
        """Every rank calls it. None: a fresh run (refused if the folder holds checkpoints); "auto": the newest
        one that reads back (None if there is none); else that path. The checkpoint must fit this run."""
        if is_main_process() and self.dir.is_dir():
            for stale in self.dir.glob("*.tmp"):  # shards of a save that was killed
                shutil.rmtree(stale, ignore_errors=True)
        barrier()
        if spec is None:
            if self.all():
                raise CourseError(f"{self.dir} holds checkpoints of an earlier run: continue it with --resume auto, "
                                  f"or start a new run with another --output-dir")
            return None
        if spec == "auto":
            path, saved = None, None
            for candidate in self.all():  # the newest that reads back: a save cut short is skipped
                try:
                    path, saved = candidate, read_progress(candidate)
                    break
                except CourseError as exc:
                    log0(f"resume: skipping {candidate} ({exc})")
            if path is None:
                log0(f"resume: starting fresh (no checkpoint in {self.dir})")
                return None
        else:
            path, saved = Path(spec), read_progress(spec)
        differ = [f"{k} {saved['run'].get(k)!r} there, {v!r} here" for k, v in self.run.items() if saved["run"].get(k) != v]
        if differ:
            raise CourseError(f"{path} is from another kind of run ({'; '.join(differ)}): use the same flags, "
                              f"or start fresh with another --output-dir")
        log0(f"resume: from {path}, continuing at epoch {saved['epoch']} step {saved['step']}")
        return path

    def prune(self, just_written: Path) -> None:
        """After a save: keep the newest `keep` checkpoints, always including the one just written (rank 0 does it)."""
        if not is_main_process():
            return
        older = [p for p in self.all() if p != just_written]
        for old in older[self.keep - 1:]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
