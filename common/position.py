"""Where a run is: the epoch to run next, the optimizer steps already done in it, and every rank's random state.

A checkpoint stores it so that a restarted run continues with the same batches and the same random numbers.
"""
import io
import itertools
import json

import torch
import torch.distributed as dist

from common.distributed import get_rank, get_world_size
from common.errors import CourseError
from common.log import progress_bar
from common.metrics import EpochMeter


def steps_per_epoch(loader, args) -> int:
    """Optimizer steps in one epoch: the loader's batches / --grad-accum, capped by --max-steps."""
    per_step = getattr(args, "grad_accum", 1)
    steps = min(len(loader) // per_step, args.max_steps or len(loader))
    if steps == 0:
        raise CourseError(f"--grad-accum {per_step} needs more batches than this rank's {len(loader)}: "
                          f"lower it or use more --train-samples")
    return steps


class Position:
    def __init__(self, epoch: int = 1, step: int = 0):
        self.epoch, self.step = epoch, step  # the epoch to run next, and the optimizer steps already done in it
        self._meter, self._partial = None, {}  # the training sums of the epoch in progress

    def meter(self, device) -> EpochMeter:
        """The epoch's training-loss meter; a resumed epoch goes on with the sums it had when it stopped."""
        self._meter = EpochMeter(device, **self._partial)
        return self._meter

    def remaining(self, loader, args):
        """This epoch's batches from `step` on (G of them per step with --grad-accum G), up to --max-steps."""
        per_step = getattr(args, "grad_accum", 1)
        end, first = steps_per_epoch(loader, args) * per_step, self.step * per_step
        return progress_bar(itertools.islice(loader, first, end), f"epoch {self.epoch}", end - first)

    def next_epoch(self) -> None:
        self.epoch, self.step = self.epoch + 1, 0
        self._meter, self._partial = None, {}

    def state_dict(self) -> dict:
        """A collective: every rank's random state and loss sums travel to every rank (rank 0 saves them all)."""
        # The sums of an interrupted epoch are this rank's own: each rank gets its own back on resume.
        partial = self._meter.partial() if self._meter is not None and self.step else {}
        mine = {"torch": torch.get_rng_state(), "partial": json.dumps(partial)}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            mine["cuda"] = torch.cuda.get_rng_state()
        states = [mine]
        if dist.is_initialized():
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, mine)
        buffer = io.BytesIO()
        torch.save(states, buffer)  # one opaque value: its length depends on the number of ranks
        return {"epoch": self.epoch, "step": self.step, "rng": buffer.getvalue()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = state["epoch"], state["step"]
        states = torch.load(io.BytesIO(state["rng"]), weights_only=True)
        partials = [json.loads(s["partial"]) for s in states]
        if len(states) == get_world_size():  # with another number of ranks, exact replay is impossible anyway
            self._partial = partials[get_rank()]
            torch.set_rng_state(states[get_rank()]["torch"].cpu())
            if "cuda" in states[get_rank()] and torch.cuda.is_available():
                torch.cuda.set_rng_state(states[get_rank()]["cuda"].cpu())
        elif get_rank() == 0 and any(partials):  # rank 0 carries the interrupted epoch's sums of every old rank
            self._partial = {"loss_sum": sum(p.get("loss_sum", 0.0) for p in partials),
                             "count": sum(p.get("count", 0) for p in partials),
                             "seconds": max(p.get("seconds", 0.0) for p in partials)}
