"""Lesson 07, exercise 1: predict the pipeline bubble by hand, then measure it.

    python 07_pipeline_parallel/solutions/bubble_by_hand.py

With p stages and m micro-batches, GPipe runs m forwards on each stage, but the last stage starts p - 1 slots
after the first, and the first stage's backwards wait p - 1 slots for the last's: each rank works m of m + p - 1
slots, so it idles (p - 1) / (m + p - 1) of the step. For p = 2: 1/2, 1/3, 1/5, 1/9 for m = 1, 2, 4, 8.
Measured: two gloo processes (common.launcher), bubble.measure on lesson 07's model cut into two stages of equal
work (24 blocks of 1024, batch 32), each forward and backward timed on each rank, idle = 1 - busy / step time,
the mean over 3 steps after a warm-up. The measured bubble is larger than the formula's, and more so with many
micro-batches: each micro-batch adds a send and a receive, and smaller matrices run less efficiently, which the
formula (equal slots, free messages) leaves out. The timings vary from run to run; the predictions do not.
"""
import sys
from fractions import Fraction
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from common.exits import run  # noqa: E402
from common.launcher import launch  # noqa: E402

import bubble  # noqa: E402
from torch_floor import require_torch_2_10  # noqa: E402

P, MICROBATCHES = 2, [1, 2, 4, 8]


def predict(p: int, m: int) -> Fraction:
    """By hand: m busy slots of m + p - 1 on every rank (GPipe and 1F1B alike)."""
    return Fraction(p - 1, m + p - 1)


def main(argv=None):
    require_torch_2_10()
    rows = launch(bubble.sweep, nprocs=P, args=("gpipe", MICROBATCHES, 4, 24, 1024, 32), timeout_s=240)[0]
    print(f"GPipe, p = {P} stages: idle fraction (p - 1) / (m + p - 1) predicted, and measured on {P} gloo ranks")
    print(f"{'m':>3}  {'predicted':>15}  {'measured':>8}  {'per rank':>9}  s/step")
    for m, row in zip(MICROBATCHES, rows):
        fraction = predict(P, m)
        assert float(fraction) == bubble.predict_idle("gpipe", P, m)  # by hand = bubble.py's formula
        per_rank = " ".join(f"{x:.2f}" for x in row["idle_per_rank"])
        print(f"{m:>3}  {str(fraction):>5} = {float(fraction):.3f}  {row['idle_measured']:>8.3f}  {per_rank:>9}  "
              f"{row['s_per_step']:.3f}")
    measured = [row["idle_measured"] for row in rows]
    print(f"measured falls as m grows: {all(a > b for a, b in zip(measured, measured[1:]))} "
          f"({', '.join(f'{x:.3f}' for x in measured)})")
    above = [x - float(predict(P, m)) for m, x in zip(MICROBATCHES, measured)]
    print(f"measured - predicted: {' '.join(f'{x:+.3f}' for x in above)}")


if __name__ == "__main__":
    run(main)
