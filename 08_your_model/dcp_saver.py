"""Lesson 08's checkpoints: a DCP folder per epoch, written by every rank, optionally while training goes on.

`dcp.save` returns when every rank's files are on disk: training waits for the write. `dcp.async_save`
(--async-checkpoint) copies the state to host memory and returns; a thread writes the files while training goes on.
Either way the files go to NAME.tmp, and only a finished checkpoint is renamed to its name: a crash leaves the
previous one. The printed wait is all the time a save held training, also the time it waited for the previous
write to finish (an async write slower than an epoch holds the next save).
"""
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from common.files import replace_folder
from common.log import log0


class Saver:
    """`save(path, state)` after each epoch; `wait()` before anything that needs the last checkpoint on disk."""

    def __init__(self, checkpoints, asynchronous: bool):
        self.checkpoints, self.pending = checkpoints, None  # pending: (the future, its scratch folder, its name)
        # async_save's messages travel on a gloo group of their own, off the training's (NCCL on GPUs; and gloo's
        # collectives must not interleave with the writer thread's): DCP needs a CPU backend for async_save.
        self.group = dist.new_group(backend="gloo") if asynchronous else None

    def save(self, path: Path, state: dict) -> None:
        start = time.perf_counter()  # training waits from here: for the previous write, then this one (or its copy)
        still_writing = self.wait()  # the previous checkpoint first: one write at a time, renamed before the next
        scratch, previous = path.with_name(path.name + ".tmp"), time.perf_counter() - start
        if self.group is None:
            dcp.save(state, checkpoint_id=scratch)  # every rank writes its shards; returns when all are on disk
            self.pending = (None, scratch, path)
            self.wait()
        else:
            future = dcp.async_save(state, checkpoint_id=scratch, process_group=self.group)  # staged: returns
            self.pending = (future, scratch, path)
        how = "dcp.async_save: written in the background" if self.group else "dcp.save"
        if still_writing:  # the write was slower than the epoch: training waited for it
            how += f"; {previous:.3f} s of it for the previous checkpoint, still being written"
        log0(f"checkpoint {path.name}: training waited {time.perf_counter() - start:.3f} s ({how})")

    def wait(self) -> bool:
        """Before the next save and before exit: the pending write finishes, then it gets its name. True if this rank
        found an async write still running."""
        if self.pending is None:
            return False
        future, scratch, path = self.pending
        self.pending = None
        still_writing = future is not None and not future.done()
        if future is not None:
            future.result()  # this rank's files, and rank 0's .metadata once every rank wrote: DCP's finish step
        dist.barrier()  # every rank's shards are on disk
        if dist.get_rank() == 0:
            replace_folder(scratch, path)  # only a complete checkpoint gets the name
        self.checkpoints.prune(path)
        dist.barrier()
        return still_writing
