"""Exercise 3: compare the weights of two finished lesson 04 runs.

    python 04_ddp_training/solutions/ex3_compare.py runs/ex3-batch64 runs/ex3-accum4

Reads each run's newest checkpoint (checkpoints/04-epoch-NNN.pt, written by rank 0) and prints the largest
difference between any two corresponding weights.
"""
import sys
from pathlib import Path

import torch


def newest(run: Path) -> dict:
    checkpoints = sorted((run / "checkpoints").glob("04-epoch-*.pt"))  # zero-padded epochs: names sort by epoch
    if not checkpoints:
        sys.exit(f"error: no checkpoint in {run / 'checkpoints'}: pass the --output-dir of a finished run")
    return torch.load(checkpoints[-1], map_location="cpu", weights_only=True)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("error: pass two run folders (their --output-dir), e.g. runs/ex3-batch64 runs/ex3-accum4")
    first, second = (newest(Path(arg)) for arg in argv)
    if first["epoch"] != second["epoch"]:
        sys.exit(f"error: the runs stopped at epochs {first['epoch']} and {second['epoch']}: train both as long")
    largest = max((first["model"][name] - second["model"][name]).abs().max().item() for name in first["model"])
    count = sum(tensor.numel() for tensor in first["model"].values())
    print(f"epoch {first['epoch']}: largest difference over {count:,} weights: {largest:.1e}")


if __name__ == "__main__":
    main(sys.argv[1:])
