"""Train a small CNN on MNIST on one GPU (or the CPU): a script as a researcher writes it, before any distribution.

    python 08_your_model/port/train.py --data-dir data --epochs 2

It imports nothing of the course. Its DDP version is train_ddp.py and its FSDP2 version train_fsdp.py: from the
course folder, `diff 08_your_model/port/train.py 08_your_model/port/train_ddp.py` shows every change, and
08_your_model/checklist.md the bug each change prevents. MNIST offline: python 01_setup/download_mnist.py first.
"""
import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms


class Net(nn.Module):
    """Two convolution blocks and a classifier head: 0.42 M parameters, 28x28 grey images in, 10 logits out."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),  # 28x28 -> 14x14
            nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),  # 14x14 -> 7x7
        ])
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {value}")
    return value


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the whole usage first; one line is easier to read in a log
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args():
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default="data", help="folder holding MNIST/raw, downloaded there if missing "
                   "(default: %(default)s; offline: python 01_setup/download_mnist.py)")
    p.add_argument("--epochs", type=positive_int, default=3, help="passes over the training set (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="training batch size (default: %(default)s)")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="Adam's learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1, help="seed of the weights and the data order (default: %(default)s)")
    p.add_argument("--train-samples", type=positive_int, help="use the first N training images (default: all)")
    p.add_argument("--test-samples", type=positive_int, help="use the first N test images (default: all)")
    p.add_argument("--checkpoint", default="checkpoints/mnist_cnn.pt", help="where the weights of the epoch with "
                   "the lowest test loss go (default: %(default)s)")
    p.add_argument("--init-from", help="start from the weights in this file, one --checkpoint wrote (default: random)")
    p.add_argument("--cosine", action="store_true", help="decay the learning rate to 0 along a cosine, step by step")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: cuda if a GPU is visible, else cpu (default: %(default)s)")
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if not Path(args.data_dir).is_dir():
        p.error(f"--data-dir {args.data_dir} is not a folder (create it: mkdir -p {args.data_dir})")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but no GPU is visible")
    return args


def load_data(args):
    """The training and test sets, each cut to its first N images if asked; downloads MNIST if it is missing."""
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    folder = Path(args.data_dir) / "MNIST"
    new_folder = not folder.exists()
    try:
        train_set = datasets.MNIST(args.data_dir, train=True, download=True, transform=transform)
        test_set = datasets.MNIST(args.data_dir, train=False, download=True, transform=transform)
    except (OSError, RuntimeError) as e:
        if new_folder:  # leave nothing behind: the failed download's folders and partial files
            shutil.rmtree(folder, ignore_errors=True)
        sys.exit(f"error: MNIST is not in {folder}/raw and could not be downloaded ({str(e).splitlines()[0]}): "
                 f"get it with python 01_setup/download_mnist.py --data-dir {args.data_dir} (see 01_setup/README.md)")
    if args.train_samples:
        train_set = Subset(train_set, range(min(args.train_samples, len(train_set))))
    if args.test_samples:
        test_set = Subset(test_set, range(min(args.test_samples, len(test_set))))
    return train_set, test_set


def train_one_epoch(model, loader, optimizer, schedule, device):
    """One pass over `loader`; returns the sum of the per-image losses and the number of images."""
    model.train()
    loss_sum, seen = 0.0, 0
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        if schedule:
            schedule.step()
        loss_sum += loss.item() * len(labels)
        seen += len(labels)
    return loss_sum, seen


@torch.no_grad()
def evaluate(model, loader, device):
    """Returns the sum of the per-image losses, the number of correct predictions and the number of images."""
    model.eval()
    loss_sum, correct, total = 0.0, 0, 0
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        logits = model(images)
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(dim=1) == labels).sum().item()
        total += len(labels)
    return loss_sum, correct, total


def save(state, path):
    """Writes `path` whole or not at all: a run stopped while saving keeps the file of the last best epoch."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


def debug_record(model, **facts):
    """TEST HOOK (tests/test_port.py), off unless PORT_DEBUG_DIR is set: one JSON line per epoch and process."""
    if os.environ.get("PORT_DEBUG_DIR"):
        facts["checksum"] = sum(p.sum().item() for p in model.parameters())
        with open(Path(os.environ["PORT_DEBUG_DIR"]) / f"rank{os.environ.get('RANK', '0')}.jsonl", "a") as f:
            f.write(json.dumps(facts) + "\n")


def main():
    args = parse_args()
    torch.manual_seed(args.seed)  # first, before anything random: the same seed, the same data order and weights
    device = torch.device(args.device)
    train_set, test_set = load_data(args)
    loader_options = {"num_workers": 2, "pin_memory": True} if device.type == "cuda" else {}
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, **loader_options)
    test_loader = DataLoader(test_set, batch_size=1000, **loader_options)

    model = Net().to(device)
    if args.init_from:  # map_location: onto this process's device, whichever device saved it
        model.load_state_dict(torch.load(args.init_from, map_location=device, weights_only=True))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps = args.epochs * len(train_loader)  # the optimizer steps of the whole run
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps) if args.cosine else None
    print(f"training on {device}: {len(train_set)} training images, {len(test_set)} test images", flush=True)
    best = float("inf")
    for epoch in range(1, args.epochs + 1):
        train_loss, seen = train_one_epoch(model, train_loader, optimizer, schedule, device)
        test_loss, correct, total = evaluate(model, test_loader, device)
        debug_record(model, epoch=epoch, train=[train_loss, seen], test=[test_loss, correct, total])
        print(f"epoch {epoch} | train_loss {train_loss / seen:.4f} | test_loss {test_loss / total:.4f} | "
              f"test_accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
        if test_loss / total < best:  # keep the best epoch's weights
            best = test_loss / total
            save(model.state_dict(), args.checkpoint)
            print(f"saved {args.checkpoint} (epoch {epoch})", flush=True)


if __name__ == "__main__":
    main()
