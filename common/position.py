"""Where a run is: the epoch to run next, the optimizer steps already done in it, and every rank's random state.

A checkpoint stores it so that a restarted run continues with the same batches and the same random numbers.
It also hands out the epoch's batches (with the progress bar) and meter: both start where the epoch stopped.
"""
import io
import itertools

import torch

from common.errors import CourseError
from common.log import progress_bar
from common.metrics import EpochMeter
from common.rank_states import all_gather_states, restore_states


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
        self.saved_ranks = None  # load_state_dict: how many ranks the checkpoint's run had

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
        """A collective (all_gather_object, common/rank_states.py): every rank's random state and loss sums."""
        # The sums of an interrupted epoch are this rank's own: each rank gets its own back on resume.
        partial = self._meter.partial() if self._meter is not None and self.step else {}
        return {"epoch": self.epoch, "step": self.step, "rng": all_gather_states(partial)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = state["epoch"], state["step"]
        self.saved_ranks = len(torch.load(io.BytesIO(state["rng"]), weights_only=True))  # one state per rank
        self._partial = restore_states(state["rng"])
