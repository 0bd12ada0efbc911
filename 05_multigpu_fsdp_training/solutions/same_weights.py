"""Exercise 1 of lesson 05: a checkpoint written by 2 ranks, loaded by 3 (or 1), holds the same model.

    python 05_multigpu_fsdp_training/solutions/same_weights.py runs/05_multigpu_fsdp_training runs/05-load-on-3

The first folder is the run that wrote the checkpoint, the others are runs that only loaded it (lesson 05 with
--resume and the same --epochs: nothing left to train, so they load, reshard and export model_full.pt). Checks
that every model_full.pt is the first one, tensor for tensor, bit for bit, and that a plain Net (no process
group, no FSDP) with those weights scores on the run's test set exactly what the run printed in its last epoch.
Reads the runs, writes nothing.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the course folder: `common`

import torch
from torch.utils.data import DataLoader

from common.cli import Parser
from common.data import load_mnist
from common.errors import CourseError
from common.exits import run
from common.files import work_in_course_folder
from common.model import Net, model_flags


def weights(folder: Path) -> dict:
    """model_full.pt of a lesson 05 run folder: the full weights, written at the end of every run that finished."""
    path = folder / "model_full.pt"
    if not path.is_file():
        raise CourseError(f"{path} not found: give the --output-dir of a lesson 05 run that finished")
    return torch.load(path, map_location="cpu", weights_only=True)


@torch.no_grad()
def score(state, args) -> int:
    """Test images a plain Net with `state` classifies correctly: the run's test set, rebuilt from its flags."""
    model = Net(**model_flags(args))
    model.load_state_dict(state)
    model.eval()
    _, _, test = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples, args.val_samples,
                            seed=args.seed, download=False)
    return sum(int((model(x).argmax(dim=1) == y).sum()) for x, y in DataLoader(test, batch_size=1000))


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="the run that saved the checkpoint, then the runs that loaded it")
    folders = p.parse_args(argv).runs
    first, *others = [weights(folder) for folder in folders]
    for folder, state in zip(folders[1:], others):
        differ = sorted(k for k in first.keys() | state.keys()
                        if k not in first or k not in state or not torch.equal(first[k], state[k]))
        if differ:
            raise CourseError(f"{folder}/model_full.pt differs from {folders[0]}'s in {', '.join(differ[:4])}")
        print(f"OK: {folder}/model_full.pt equals {folders[0]}/model_full.pt: all {len(first)} tensors, bit for bit",
              flush=True)
    trained = folders[0] / "metrics.json"  # a run that only loaded has trained no epoch: it writes none
    if not trained.is_file():
        raise CourseError(f"{trained} not found: give the run that trained and saved the checkpoint first")
    metrics = json.loads(trained.read_text())
    last = metrics["epochs"][-1]
    correct = score(first, argparse.Namespace(**metrics["args"]))  # the run's own flags
    if correct != last["test_correct"]:
        raise CourseError(f"a plain Net with these weights scores {correct}/{last['test_samples']}, the run printed "
                          f"{last['test_correct']}")
    print(f"OK: a plain Net with these weights scores {correct}/{last['test_samples']} on the test set, what the run "
          f"printed for epoch {last['epoch']} (test_accuracy {last['test_accuracy']:.4f})", flush=True)


if __name__ == "__main__":
    run(main)
