"""Lesson 03, exercise 1 (a solution): the `module.` prefix, and the lesson's checkpoint in a plain Net.

From the course folder, after the lesson's first run (it wrote runs/03-first):
    python 03_dp_training/solutions/load_into_plain_net.py runs/03-first

nn.DataParallel holds the model as its attribute `module`, so its own state_dict() names every tensor
`module.<name>`, which a plain Net refuses. The lesson saves `model.module.state_dict()`: plain names. This
loads the run's newest checkpoint into a plain Net and tests it on the run's own test images; the result must
be the run's last test accuracy, image for image.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the course folder: `common`

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from common.data import load_mnist
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
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise CourseError("give the lesson's run folder: load_into_plain_net.py runs/03-first")
    run_dir = Path(argv[0])
    checkpoints = sorted(run_dir.glob("checkpoints/ckpt-*.pt"))
    if not (run_dir / "metrics.json").is_file() or not checkpoints:
        raise CourseError(f"{run_dir}: no metrics.json or checkpoints/ckpt-*.pt: run the lesson's first command first")
    record = json.loads((run_dir / "metrics.json").read_text())
    args = record["args"]
    shape = {"width": args["width"], "blocks": args["blocks"], "hidden": args["hidden"]}

    wrapped = nn.DataParallel(Net(**shape))
    print(f"nn.DataParallel(Net()).state_dict(): {first_keys(wrapped.state_dict())}")
    print(f"Net().state_dict():                  {first_keys(Net(**shape).state_dict())}")
    refused = Net(**shape).load_state_dict(wrapped.state_dict(), strict=False)  # strict=True raises a RuntimeError
    print(f"a plain Net given the wrapper's keys: {len(refused.missing_keys)} missing, "
          f"{len(refused.unexpected_keys)} unexpected (e.g. {refused.unexpected_keys[0]})")

    net = Net(**shape)
    net.load_state_dict(torch.load(checkpoints[-1], map_location="cpu", weights_only=True)["model"])  # strict
    _, _, test = load_mnist(args["data_dir"], args["data"], args["train_samples"], args["test_samples"])
    correct, last = count_correct(net, test, args["test_batch_size"]), record["epochs"][-1]
    print(f"{checkpoints[-1].name} in a plain Net: {correct}/{len(test)} test images right; "
          f"the run's last epoch: {last['test_correct']}/{last['test_samples']}")


if __name__ == "__main__":
    run(main)
