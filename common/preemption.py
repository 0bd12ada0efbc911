"""Stop cleanly when the cluster asks, and let Slurm restart the job.

Slurm sends SIGUSR1 shortly before the time limit (`#SBATCH --signal=USR1@120`) and SIGTERM on
preemption or scancel. A signal reaches each process at a random moment, possibly while the
others are inside an all_reduce. So the handler only sets a flag; every few steps all ranks
all_reduce that flag and, if ANY rank got a signal, ALL of them stop at the same step.
Only SIGUSR1 requeues the job: SIGTERM may be a user's scancel, which must stay cancelled
(a site that preempts with PreemptMode=REQUEUE puts the job back in the queue itself).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess

import torch
import torch.distributed as dist

from common.distributed import get_rank


class StopSignal:
    """Turns SIGUSR1/SIGTERM into an agreed stop at a step boundary."""

    CODES = {0: None, 1: "SIGTERM", 2: "SIGUSR1"}  # all_reduce MAX: SIGUSR1 wins if both arrived

    def __init__(self, check_every: int = 10):
        self.check_every = check_every
        self.received = 0  # this rank's code
        self.agreed = 0  # the code all ranks agreed on
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handler)
        # FAIL_AT_STEP=RANK:STEP makes one rank raise there: for the course's tests and exercises.
        rank, _, step = os.environ.get("FAIL_AT_STEP", "").partition(":")
        self.fail_at = (int(rank), int(step)) if step else None

    def _handler(self, signum, frame) -> None:
        self.received = max(self.received, 2 if signum == signal.SIGUSR1 else 1)

    def requested(self, step: int, device: torch.device) -> bool:
        """Call at every step on every rank; True on all ranks once any rank has received a signal."""
        if self.fail_at == (get_rank(), step):
            raise RuntimeError(f"FAIL_AT_STEP: rank {get_rank()} fails at step {step} on purpose")
        if step % self.check_every:
            return False
        flag = torch.tensor([float(self.received)], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.agreed = int(flag.item())
        return self.agreed > 0


    def requeue(self, epoch: int, step: int) -> None:
        """After the checkpoint: rank 0 says what happened and, for SIGUSR1, asks Slurm to run the job again."""
        if get_rank() == 0:
            name = self.CODES[self.agreed]
            then = requeue_slurm_job() if name == "SIGUSR1" else "not requeueing (Slurm decides after a SIGTERM)"
            print(f"preempted: {name} at epoch {epoch} step {step}, checkpoint saved; {then}", flush=True)


def requeue_slurm_job() -> str:
    """Ask Slurm to put this job back in the queue (it restarts with the same job id)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or not shutil.which("scontrol"):
        return "not a Slurm job: restart it yourself with --resume auto"
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if result.returncode != 0:
        return f"scontrol requeue {job} failed: {result.stderr.strip()} (is the job submitted with --requeue?)"
    return f"requeued Slurm job {job}"
