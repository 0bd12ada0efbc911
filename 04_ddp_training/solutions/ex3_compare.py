"""Exercise 3: compare two finished lesson 04 runs, weights and training loss.

    python 04_ddp_training/solutions/ex3_compare.py runs/ex3/batch64 runs/ex3/accum4

Reads each run's metrics.json and its newest checkpoint (checkpoints/ckpt-*.pt, written by rank 0) and prints
the training losses and the largest difference between any two corresponding weights.
"""
import json
import sys
from pathlib import Path

import torch


def newest_weights(run: Path) -> dict:
    checkpoints = sorted((run / "checkpoints").glob("ckpt-*.pt"))  # names sort by progress
    if not checkpoints:
        sys.exit(f"error: no checkpoint in {run / 'checkpoints'}: pass the --output-dir of a finished run")
    return torch.load(checkpoints[-1], map_location="cpu", weights_only=True)["model"]


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("error: pass two run folders (their --output-dir), e.g. runs/ex3/batch64 runs/ex3/accum4")
    runs = [Path(arg) for arg in argv]
    losses = [json.loads((run / "metrics.json").read_text())["epochs"][-1]["train_loss"] for run in runs]
    first, second = (newest_weights(run) for run in runs)
    largest = max((first[name] - second[name]).abs().max().item() for name in first)
    count = sum(tensor.numel() for tensor in first.values())
    print(f"train_loss {losses[0]:.6f} and {losses[1]:.6f}")
    print(f"largest difference over {count:,} weights: {largest:.1e}")


if __name__ == "__main__":
    main(sys.argv[1:])
