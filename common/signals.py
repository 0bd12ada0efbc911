"""Requests to stop from outside the program: Slurm's SIGUSR1 / SIGTERM, and Ctrl-C (SIGINT) (docs/checkpoints.md).

A handler only writes down that a request came; the lesson decides WHERE to stop (under DDP and FSDP every rank must
leave at the same step: lessons 04-06 all_reduce the requests, `agreed`). A second Ctrl-C within CTRL_C_REPEAT_S seconds
counts as the same press; a later one stops at once (KeyboardInterrupt), without waiting for the checkpoint.
"""
import os
import shutil
import signal
import subprocess
import time

import torch
import torch.distributed as dist

from common.distributed import is_main_process

# Ordered: the all_reduce MAX over ranks keeps the strongest request. SIGUSR1 asks for a requeue.
REQUESTS = {signal.SIGINT: 1, signal.SIGTERM: 2, signal.SIGUSR1: 3}
NAMES = {0: "none", 1: "Ctrl-C (SIGINT)", 2: "SIGTERM", 3: "SIGUSR1"}
CTRL_C_REPEAT_S = 2.0


class StopSignals:
    """`with StopSignals(signal.SIGUSR1, signal.SIGTERM, signal.SIGINT) as stop:` ... `stop.request` (0: none)."""

    def __init__(self, *signals: int):
        self.signals = signals
        self.request = 0  # the strongest request so far (REQUESTS); lessons 04-06 agree on it across ranks
        self.vote = None  # agreed(): the vote in flight (an async all_reduce and its tensor)
        self.reported = False  # report() says it once, however often the lesson's votes agree
        self._first_ctrl_c = None
        self._saved: dict = {}

    def __enter__(self) -> "StopSignals":
        for sig in self.signals:
            self._saved[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():  # leave a notebook's kernel as we found it
            signal.signal(sig, handler)

    def _handler(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_ctrl_c is not None and now - self._first_ctrl_c > CTRL_C_REPEAT_S:
                # A second Ctrl-C: the user does not want to wait for the checkpoint. Ctrl-C's handler from before
                # (Python's, or common.exits.run's NoteCtrlC, which also notes it) raises KeyboardInterrupt.
                previous = self._saved.get(signal.SIGINT)
                if callable(previous):
                    previous(signum, frame)
                raise KeyboardInterrupt
            self._first_ctrl_c = self._first_ctrl_c or now
        self.request = max(self.request, REQUESTS[signum])

    def agreed(self, group, now: bool = False) -> bool:
        """Lessons 04-06, every 10 steps: True on EVERY rank, at the same call, once a request reached ANY rank (all
        must stop at the same step, or some wait for ever). The vote runs in the background (async_op=True) and is read
        at the next call: no rank's CPU waits for the others', so no GPU runs dry meanwhile. now=True (an epoch's end)
        also votes on the requests since the last call, and waits for the result. `group`: a gloo group."""
        agreed = 0
        if self.vote:  # the vote the previous call started: finished long ago
            work, votes = self.vote
            work.wait()
            agreed, self.vote = int(votes), None
        if not agreed:
            votes = torch.tensor([self.request])  # a CPU tensor on a gloo group: voting never waits for the GPU
            work = dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group, async_op=True)
            if now:
                work.wait()
                agreed = int(votes)
            else:
                self.vote = (work, votes)
        if agreed:
            self.request = agreed  # the strongest request of any rank, the same on every rank
        return agreed > 0

    def report(self, epoch: int, step: int) -> None:
        """After the checkpoint: say what happened and how to go on; for SIGUSR1 ask Slurm to requeue the job. Once:
        a stop that an epoch's vote reported is agreed again by the vote after the loop. Step 0: before epoch
        `epoch` began (a request after the last epoch's vote: its checkpoint is that epoch's)."""
        if self.reported or not is_main_process():
            return
        self.reported = True
        if self.request == REQUESTS[signal.SIGUSR1]:
            then = requeue_slurm_job()
        elif self.request == REQUESTS[signal.SIGTERM]:
            then = "not requeueing (Slurm decides after a SIGTERM); continue with --resume auto"
        else:
            then = "continue with the same command and --resume auto"
        where = f"at epoch {epoch} step {step}" if step else f"after epoch {epoch - 1}"
        print(f"stopped by {NAMES[self.request]} {where}, checkpoint saved: {then}", flush=True)


def requeue_slurm_job() -> str:
    """Ask Slurm to put this job back in the queue (it restarts with the same job id)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or not shutil.which("scontrol"):
        return "not a Slurm job: restart it yourself with --resume auto"
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    # Slurm accepts the requeue and at once ends the job's processes, scontrol too when it has not exited
    # yet: killed by a signal (a negative return code) means the requeue is under way, not that it failed.
    if result.returncode > 0:
        return f"scontrol requeue {job} failed: {result.stderr.strip()} (is the job submitted with --requeue?)"
    return f"requeued Slurm job {job}"
