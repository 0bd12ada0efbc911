"""One checkpointing component for every lesson: numbered checkpoints, keep the last N, resume auto.

Checkpoints go to OUTPUT_DIR/checkpoints/ckpt-eEEEE-sSSSSSS(.pt), named after the epochs
completed and the optimizer steps already done in the next one, so names sort by progress.
A new checkpoint is written completely and read back before older ones are deleted.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch.distributed.checkpoint as dcp

from common.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from common.dcp_checkpoint import load_sharded, save_sharded
from common.distributed import barrier, is_main_process
from common.log import log0

NAME = re.compile(r"^ckpt-e(\d{4})-s(\d{7})(\.pt)?$")


class Checkpointer:
    """sharded=False: one .pt written by rank 0 (lessons 02-04); True: a DCP folder, all ranks (05)."""

    def __init__(self, output_dir, lesson: str, keep: int = 2, sharded: bool = False):
        self.dir = Path(output_dir) / "checkpoints"
        self.lesson, self.keep, self.sharded = lesson, keep, sharded

    def _path(self, epoch: int, epoch_step: int) -> Path:
        return self.dir / f"ckpt-e{epoch:04d}-s{epoch_step:07d}{'' if self.sharded else '.pt'}"

    def candidates(self) -> list[Path]:
        """This run's checkpoints, newest first."""
        if not self.dir.is_dir():
            return []
        return sorted((p for p in self.dir.iterdir() if NAME.match(p.name)), key=lambda p: p.name, reverse=True)

    def _loadable(self, path: Path) -> bool:
        try:
            if self.sharded:
                dcp.FileSystemReader(str(path)).read_metadata()
            else:
                read_checkpoint(path)
            return True
        except Exception:
            return False

    def save(self, model, optimizer, scheduler, *, epoch: int, epoch_step: int = 0, args=None) -> Path:
        """Write checkpoint (epoch, epoch_step); then drop all but the newest `keep` good ones."""
        path = self._path(epoch, epoch_step)
        if self.sharded:
            save_sharded(path, model, optimizer, scheduler, epoch=epoch, step=epoch_step, args=args, lesson=self.lesson)
        else:
            save_checkpoint(path, model, optimizer, scheduler, epoch=epoch, step=epoch_step, args=args,
                            lesson=self.lesson)
        if is_main_process() and self._loadable(path):  # never delete the old ones before the new one reads back
            for old in self.candidates()[self.keep:]:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        barrier()
        return path

    def resume(self, spec: str | None, model, optimizer, scheduler, map_location) -> tuple[int, int]:
        """spec None: fresh; "auto": newest good checkpoint here, else fresh; a path: that checkpoint.

        Returns (first epoch to run, optimizer steps of that epoch already done).
        """
        if spec is None:
            return 1, 0
        if spec == "auto":
            path = next((p for p in self.candidates() if self._loadable(p)), None)  # newest that reads back
            if path is None:
                log0(f"resume: starting fresh (no checkpoint in {self.dir})")
                return 1, 0
        else:
            path = Path(spec)
        if self.sharded:
            meta = load_sharded(path, model, optimizer, scheduler, lesson=self.lesson)
        else:
            meta = load_checkpoint(path, model, optimizer, scheduler, map_location=map_location)
        log0(f"resume: from {path} (epoch {meta['epoch']}, step {meta['step']})")
        return meta["epoch"] + 1, meta["step"]
