"""Lesson 06, exercise 1: predict the collectives of one training step, then count them with CommDebugMode.

    python 06_tensor_parallel/solutions/count_collectives.py

Two gloo processes (common.launcher), the lesson's TPNet with --blocks 3, on a 1 x 2 mesh (TP only) and on a
2 x 1 mesh (FSDP2 only). The prediction is the README's: U = 3 + blocks FSDP2 units (features, fc1, each
block, fc2), each all-gathered in forward and again in backward and reduce-scattered once, if dp > 1; two
all-reduces per block (down's partial sums in forward, up's input gradient in backward), if tp > 1.
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from common.launcher import launch  # noqa: E402

import tp_workers  # noqa: E402

BLOCKS = 3


def predict(dp: int, tp: int, blocks: int) -> dict:
    units, counts = 3 + blocks, {}
    if dp > 1:
        counts.update(all_gather=2 * units, reduce_scatter=units)
    if tp > 1:
        counts["all_reduce"] = 2 * blocks
    return counts


def count(blocks: int) -> dict:
    """On each rank: one step on each mesh, the collectives CommDebugMode saw (tp_workers.equivalence)."""
    names = {"_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter", "all_reduce": "all_reduce"}
    counted = {}
    for tp in (2, 1):
        mesh = tp_workers.start(tp)
        step = tp_workers.equivalence(mesh, blocks=blocks)["step"]
        counted[(mesh.size(0), tp)] = {names[op]: n for op, n in step.items()}
    return counted


def main():
    counted = launch(count, nprocs=2, args=(BLOCKS,), timeout_s=240)[0]
    for (dp, tp), seen in counted.items():
        expected = predict(dp, tp, BLOCKS)
        print(f"mesh {dp} x {tp}, --blocks {BLOCKS}: predicted {expected}, counted {seen}: "
              f"{'equal' if expected == seen else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
