"""Lesson 07, exercise 2: a schedule divides the gradients by the number of micro-batches, unless scale_grads=False.

    python 07_pipeline_parallel/solutions/scale_grads.py

The loss function runs once per micro-batch and returns that micro-batch's MEAN loss; backward adds the m
micro-batches' gradients into .grad, which makes m times the gradient of the whole batch's mean loss. At the end of
step() the schedule divides them by m: the switch is an argument of the schedule's constructor,
ScheduleGPipe(stage, m, loss_fn=..., scale_grads=True), the default (torch/distributed/pipelining/schedules.py:
_step_microbatches ends with stage.perform_reduce_grad(m if self.scale_grads else 1), which divides the gradients
in stage.py). Then they equal one process's on the whole batch. With scale_grads=False they stay m times larger:
right for a loss that SUMS (reduction="sum"), m times too large for a mean loss.
Two gloo processes (common.launcher), the lesson's smallest example (pp_minimal.step: a small model cut in two by
hand), GPipe, 4 micro-batches of 2, the same batch and weights both times.
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from common.exits import run  # noqa: E402
from common.launcher import launch  # noqa: E402

import pp_minimal  # noqa: E402
from torch_floor import require_torch_2_10  # noqa: E402

MICROBATCHES = 4


def both(microbatches: int) -> dict:
    """On each rank: one step with the default and one with scale_grads=False, from the same weights."""
    return {scale: pp_minimal.step("gpipe", microbatches, scale_grads=scale, quiet=True) for scale in (True, False)}


def main(argv=None):
    require_torch_2_10()
    for rank, runs in enumerate(launch(both, nprocs=2, args=(MICROBATCHES,), timeout_s=120)):
        scaled, unscaled = runs[True]["grads"], runs[False]["grads"]
        nonzero = [unscaled[k][scaled[k] != 0] / scaled[k][scaled[k] != 0] for k in scaled]
        ratios = torch.cat(nonzero).unique().tolist()
        zero = sum(int((scaled[k] == 0).sum()) for k in scaled)
        both_zero = all(torch.equal(unscaled[k][scaled[k] == 0], scaled[k][scaled[k] == 0]) for k in scaled)
        print(f"[rank {rank}] stage {rank}, {', '.join(scaled)}: grad(scale_grads=False) / grad(default) = "
              f"{ratios} in all {sum(len(x) for x in nonzero)} nonzero elements ({zero} zero in both: {both_zero})")
        print(f"[rank {rank}] max |grad(default) - one process's| = {runs[True]['diff']:.1e}, "
              f"max |grad(scale_grads=False) - {MICROBATCHES} x one process's| = {runs[False]['diff']:.1e}")
    print(f"ratio = the number of micro-batches, {MICROBATCHES}: the default divides by it")


if __name__ == "__main__":
    run(main)
