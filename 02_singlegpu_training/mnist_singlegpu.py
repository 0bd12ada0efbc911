r"""Lesson 02: the classic MNIST CNN on ONE device: a GPU if there is one, else the CPU.

The baseline every later lesson changes as little as possible (diff them). From the course folder:
    python 02_singlegpu_training/mnist_singlegpu.py --data synthetic --train-samples 2000 --test-samples 1000 \
        --epochs 2 --num-workers 0 --output-dir runs/02-first
A long run's extras (exact resume, signals, AMP, compile, metrics.json): trainer/README.md.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader

from common.cli import lesson_parser
from common.data import load_mnist
from common.distributed import pick_device
from common.epoch_checkpoints import EpochCheckpoints
from common.exits import run
from common.model import Net

LESSON = "02"


def main(argv=None):
    args = lesson_parser(LESSON, "Lesson 02: MNIST on one device").parse_args(argv)
    checkpoints = EpochCheckpoints(args.output_dir, LESSON, flags=args)
    resume = checkpoints.resume_from(args.resume)  # first, before anything slow: a used --output-dir is refused

    device = pick_device(args.device)  # cuda if there is a GPU, else cpu
    torch.manual_seed(args.seed)

    train_ds, _, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples)
    loader_options = {"num_workers": args.num_workers, "pin_memory": device.type == "cuda"}
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, **loader_options)
    test_loader = DataLoader(test_ds, batch_size=args.test_batch_size, **loader_options)

    model = Net().to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)  # lr x 0.7 after every epoch
    start = 1
    if resume:  # --resume auto: the newest checkpoint; the run continues with the epoch after it
        checkpoint = torch.load(resume, map_location=device, weights_only=True)  # onto `device`; tensors, no code
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start = checkpoint["epoch"] + 1
        print(f"resumed from {resume}")

    for epoch in range(start, args.epochs + 1):
        began = time.perf_counter()
        train(model, device, train_loader, optimizer)
        seconds = time.perf_counter() - began
        loss, correct, count = test(model, device, test_loader)
        scheduler.step()
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "epoch": epoch}
        print(f"epoch {epoch}: test loss {loss:.4f}, accuracy {correct:.0f}/{count:.0f}, train {seconds:.1f} s")
        with checkpoints.writing(epoch) as path:  # a temporary name, renamed once complete
            torch.save(state, path)


def train(model, device, train_loader, optimizer):
    model.train()
    for data, target in train_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()


@torch.no_grad()
def test(model, device, test_loader):
    """The test set's mean loss, and how many images were right out of how many."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for data, target in test_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(data)
        loss_sum += F.nll_loss(output, target, reduction="sum").item()  # a SUM: the mean is exact
        correct += (output.argmax(dim=1) == target).sum().item()
        count += len(data)
    return loss_sum / count, correct, count


if __name__ == "__main__":
    run(main)
