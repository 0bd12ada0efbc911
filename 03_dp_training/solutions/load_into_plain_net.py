"""Lesson 03, exercise 1 (a solution): the `module.` prefix, and the lesson's checkpoint in a plain Net.

From the course folder, after the lesson's first run (it wrote runs/03-first), with that run's data flags:
    python 03_dp_training/solutions/load_into_plain_net.py runs/03-first --test-samples 1000

nn.DataParallel holds the model as its attribute `module`, so its own state_dict() names every tensor
`module.<name>`, which a plain Net refuses. The lesson saves `model.module.state_dict()`: plain names. This
loads the run's newest checkpoint into a plain Net and tests it on the run's own test images; the result must
be the accuracy of the run's last epoch line, image for image.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the course folder: `common`

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from common.data import load_mnist
from common.download import default_data_dir
from common.epoch_checkpoints import EpochCheckpoints
from common.errors import CourseError
from common.exits import run
from common.model import Net


def first_keys(state: dict) -> str:
    return ", ".join(list(state)[:2]) + ", ..."


@torch.no_grad()
def count_correct(net: Net, dataset, batch_size: int) -> int:
    net.eval()  # dropout off, as in the lesson's test()
    return sum(int((net(x).argmax(dim=1) == y).sum()) for x, y in DataLoader(dataset, batch_size=batch_size))


def main(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 03's checkpoint in a plain Net")
    parser.add_argument("run_dir", type=Path, help="the lesson's --output-dir, e.g. runs/03-first")
    parser.add_argument("--data", choices=["mnist", "synthetic"], default="mnist", help="as the run had it")
    parser.add_argument("--data-dir", default=default_data_dir(), help="as the run had it")
    parser.add_argument("--test-samples", type=int, default=None, help="as the run had it (default: all)")
    args = parser.parse_args(argv)
    newest = EpochCheckpoints(args.run_dir, "03").resume_from("auto")  # what --resume auto would take
    if newest is None:
        raise CourseError(f"{args.run_dir}: no checkpoints/03-epoch-NNN.pt: run the lesson's first command first")

    wrapped = nn.DataParallel(Net())
    print(f"nn.DataParallel(Net()).state_dict(): {first_keys(wrapped.state_dict())}")
    print(f"Net().state_dict():                  {first_keys(Net().state_dict())}")
    refused = Net().load_state_dict(wrapped.state_dict(), strict=False)  # strict=True raises a RuntimeError
    print(f"a plain Net given the wrapper's keys: {len(refused.missing_keys)} missing, "
          f"{len(refused.unexpected_keys)} unexpected (e.g. {refused.unexpected_keys[0]})")

    net = Net()
    net.load_state_dict(torch.load(newest, map_location="cpu", weights_only=True)["model"])  # strict
    _, _, test = load_mnist(args.data_dir, args.data, None, args.test_samples)
    print(f"{newest.name} in a plain Net: {count_correct(net, test, 1000)}/{len(test)} test images right "
          f"(compare the run's last epoch line)")


if __name__ == "__main__":
    run(main)
