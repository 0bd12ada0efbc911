"""Lesson 02, exercise 1: 4 micro-batches of 16, each loss divided by 4, take the same optimizer step as 1 batch of 64.

    python 02_singlegpu_training/solutions/grad_accum.py

From the same weights, on the same 64 images, it takes ONE optimizer step twice: with the lesson's own train() on
one batch of 64, and with the accumulating loop below on 4 batches of 16; then compares the weights. First with
dropout off (p = 0), then on. It reads no data set and writes nothing.

Why dropout off: it draws a random mask per forward pass, so 4 passes of 16 images drop other activations than
1 pass of 64. With it off, each loss divided by 4 makes the 4 gradients add up to the mean over the 64 images,
the gradient of the large batch: the weights agree up to float rounding. (The trainer's --grad-accum is this
loop; under DDP it also skips the all_reduce of the first 3 backward passes: trainer/README.md.)
"""
import copy
import runpy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

COURSE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(COURSE))  # for `common`, also when the course is not installed

# The lesson script's functions, without running its main() (run_path gives it another __name__).
lesson = runpy.run_path(str(COURSE / "02_singlegpu_training" / "mnist_singlegpu.py"))
CPU = torch.device("cpu")


def accumulate(model, loader, optimizer, micro_batches: int):
    """One optimizer step from `micro_batches` batches: their gradients add up in .grad before the step."""
    model.train()
    optimizer.zero_grad()
    for data, target in loader:
        loss = F.nll_loss(model(data), target)
        (loss / micro_batches).backward()  # / N: the sum of N mean gradients is N times too large
    optimizer.step()


def one_step(start, images, labels, batch_size: int, dropout: bool) -> torch.nn.Module:
    """A copy of `start` after one optimizer step on these 64 images, in batches of `batch_size`."""
    model = copy.deepcopy(start)
    if not dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    loader = DataLoader(TensorDataset(images, labels), batch_size=batch_size)  # the same order, no shuffle
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)  # the lesson's
    torch.manual_seed(0)  # the same dropout stream for both runs
    if batch_size == len(images):
        lesson["train"](model, CPU, loader, optimizer)  # one batch: the lesson's own step
    else:
        accumulate(model, loader, optimizer, micro_batches=len(loader))
    return model


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def main() -> None:
    torch.manual_seed(1)
    start = lesson["Net"]()
    images, labels = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    for dropout in (False, True):
        big = one_step(start, images, labels, batch_size=64, dropout=dropout)
        accumulated = one_step(start, images, labels, batch_size=16, dropout=dropout)
        print(f"dropout {'on ' if dropout else 'off'}: largest weight difference after one step "
              f"{max_difference(big, accumulated):.1e} (the step itself moved weights by up to "
              f"{max_difference(start, big):.1e})")


if __name__ == "__main__":
    main()
