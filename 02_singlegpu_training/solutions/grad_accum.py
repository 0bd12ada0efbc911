"""Lesson 02, exercise 1: 4 micro-batches of 16 (--grad-accum 4) take the same optimizer step as 1 batch of 64.

    python 02_singlegpu_training/solutions/grad_accum.py

It runs the lesson's own train() for ONE optimizer step, twice, from the same weights on the same 64 images:
as `--batch-size 64` and as `--batch-size 16 --grad-accum 4`, then compares the weights. First with dropout
off (p = 0), then on. It reads no data set and writes nothing.

Why dropout off: it draws a random mask per forward pass, so 4 passes of 16 images drop other activations than
1 pass of 64. With it off, each loss divided by 4 makes the 4 gradients add up to the mean over the 64 images,
the gradient of the large batch: the weights agree up to float rounding.
"""
import copy
import runpy
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

COURSE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(COURSE))  # for `common`, also when the course is not installed
from common.cli import base_parser, parse  # noqa: E402
from common.optim import make_optimizer, make_scheduler  # noqa: E402
from common.position import Position  # noqa: E402

# The lesson script's functions, without running its main() (run_path gives it another __name__).
lesson = runpy.run_path(str(COURSE / "02_singlegpu_training" / "mnist_singlegpu.py"))


class NoStop:
    request = False  # what StopSignals says when nobody pressed Ctrl-C


def one_step(start, images, labels, batch_size: int, grad_accum: int, dropout: bool) -> torch.nn.Module:
    """A copy of `start` after one optimizer step of the lesson's train() with these flags."""
    args = parse(base_parser(lesson["LESSON"], ""), ["--batch-size", batch_size, "--grad-accum", grad_accum,
                                                     "--max-steps", 1, "--num-workers", 0])
    model = copy.deepcopy(start)
    if not dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    dataset = TensorDataset(images, labels)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=SequentialSampler(dataset))  # the same order
    optimizer = make_optimizer(args, model.parameters())  # the lesson's default: Adadelta, lr 1.0
    scheduler = make_scheduler(args, optimizer, 1)
    torch.manual_seed(0)  # the same dropout stream for both runs
    no_scaling = torch.amp.GradScaler("cpu", enabled=False)  # float32 (no --amp): the scaler passes through
    lesson["train"](args, model, torch.device("cpu"), loader, optimizer, scheduler, Position(), NoStop(),
                    None, no_scaling)
    return model


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def main() -> None:
    torch.manual_seed(1)
    start = lesson["Net"]()
    images, labels = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    for dropout in (False, True):
        big = one_step(start, images, labels, batch_size=64, grad_accum=1, dropout=dropout)
        accumulated = one_step(start, images, labels, batch_size=16, grad_accum=4, dropout=dropout)
        print(f"dropout {'on ' if dropout else 'off'}: largest weight difference after one step "
              f"{max_difference(big, accumulated):.1e} (the step itself moved weights by up to "
              f"{max_difference(start, big):.1e})")


if __name__ == "__main__":
    main()
