"""Lesson 04, after training: predict the MNIST test set on N ranks and gather the results on rank 0.

    torchrun --standalone --nproc_per_node=2 04_ddp_training/predict.py --checkpoint CKPT.pt
    python 04_ddp_training/predict.py --checkpoint CKPT.pt      # one process, no process group

Every rank predicts its shard of the test set (DistributedSampler, which PADS the shards to equal size),
rank 0 gathers all rows, puts them back in dataset order, drops the padded duplicates and writes
predictions.csv, predictions.pt, confusion_matrix.png and misclassified.png. See reference.md,
"Predictions gathered on rank 0".
"""
import csv
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

import torch
import torch.distributed as dist
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.utils.data import DataLoader, DistributedSampler

from common.cli import Parser, positive_int
from common.data import MNIST_MEAN, MNIST_STD, load_mnist
from common.download import default_data_dir
from common.distributed import detect_launch, launch_env, pick_device
from common.errors import CourseError, one_line
from common.exits import run
from common.files import work_in_course_folder
from common.model import Net

COLUMNS = ["index", "label", "predicted"] + [f"p{k}" for k in range(10)]  # one row per image


def parse_args(argv=None):
    p = Parser(description="Lesson 04: distributed prediction, results gathered on rank 0")
    p.add_argument("--checkpoint", required=True, help="a lesson 04 checkpoint .pt, or the trainer's model_full.pt (fsdp2, tp, 2d, pp)")
    p.add_argument("--data", choices=["mnist", "synthetic"], default="mnist",
                   help="the test set to predict (default: mnist)")
    p.add_argument("--data-dir", default=default_data_dir(),
                   help="folder holding MNIST/raw (default: $WORKSHOP_DATA_DIR or ./data)")
    p.add_argument("--test-samples", type=positive_int, default=None,
                   help="predict the first N test images (default: all)")
    p.add_argument("--batch-size", type=positive_int, default=1000,
                   help="images per forward pass, per rank (default: 1000)")
    p.add_argument("--gather", choices=["tensor", "object"], default="tensor",
                   help="tensor: all_gather_into_tensor, every rank gets all; object: gather_object, pickled, "
                        "only rank 0 gets it (default: tensor)")
    p.add_argument("--width", type=positive_int, default=None,
                   help="the Net's --width at training; checked against the checkpoint (default: read from it)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda:LOCAL_RANK if there is a GPU, else the CPU (default: auto)")
    p.add_argument("--out", default=os.path.join("runs", "04_ddp_training", "predict"),
                   help="where rank 0 writes its files (default: runs/04_ddp_training/predict)")
    return p.parse_args(argv)


def load_model(path, width, device):
    """A Net with the weights in `path`: a training checkpoint ({"model": state_dict, ...}) or a bare state_dict."""
    if not Path(path).is_file():
        raise CourseError(f"--checkpoint {path} is not a file: pass a .pt of lesson 04 (or the trainer's model_full.pt)")
    try:  # weights_only: tensors and plain containers only, never code from the file
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # unpickling errors come in many types
        raise CourseError(f"--checkpoint {path} is not a checkpoint of torch.save "
                          f"({type(exc).__name__}: {one_line(exc, 100)})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # lessons 02-04 save weights, optimizer and progress together
    state = state if isinstance(state, dict) else {}
    consume_prefix_in_state_dict_if_present(state, "_orig_mod.")  # saved from a torch.compile'd model
    # Net's shape from the weights: the first conv has 1 input channel and 32 x width filters.
    conv1 = next((t for t in state.values() if torch.is_tensor(t) and t.dim() == 4 and t.shape[1] == 1), None)
    if conv1 is None or conv1.shape[0] % 32 or not torch.is_tensor(state.get("fc2.weight")):
        raise CourseError(f"--checkpoint {path} holds no weights of common.model.Net: pass a lesson 04 checkpoint")
    found = conv1.shape[0] // 32
    if width is not None and width != found:
        raise CourseError(f"--checkpoint {path} is a Net of width {found}, not --width {width}: "
                          f"pass --width {found} or leave --width out")
    model = Net(width=found, blocks=len({k.split(".")[1] for k in state if k.startswith("blocks.")}),
                hidden=state["fc2.weight"].shape[1],  # fc2 maps hidden -> 10
                batch_norm=any(k.endswith("running_mean") for k in state))  # lesson 04's --sync-bn
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise CourseError(f"--checkpoint {path} does not fit common.model.Net: {one_line(exc, 150)}") from None
    return model.to(device).eval()  # eval(): dropout off, BatchNorm uses its running statistics


@torch.no_grad()
def predict(model, loader, indices, device):
    """This rank's rows [index, label, predicted, p0..p9]: float64, which holds the integer columns exactly."""
    rows = []
    for images, labels in loader:
        probs = model(images.to(device)).exp()  # Net returns log-probabilities
        rows.append(torch.cat([labels.to(device)[:, None].double(), probs.argmax(1)[:, None].double(),
                               probs.double()], dim=1))
    # A DataLoader without shuffling yields the sampler's indices in order: they say which image each row is.
    return torch.cat([indices.to(device)[:, None].double(), torch.cat(rows)], dim=1)


def gather_tensor(rows, world_size):
    """all_gather_into_tensor: one collective on a raw tensor, no pickling, fast on NCCL.

    Cost: EVERY rank receives everything (world_size x its own rows), though only rank 0 uses it.
    It needs the same shape on every rank: DistributedSampler's padding guarantees that.
    """
    gathered = torch.empty((world_size * rows.shape[0], rows.shape[1]), dtype=rows.dtype, device=rows.device)
    # torch 2.14 renamed it all_gather_single (the old name warns); older torch has only the old name.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(gathered, rows)  # rank-major: rank 0's rows, then rank 1's, ...
    return gathered


def gather_objects(rows, rank, world_size):
    """gather_object: any picklable Python object (here lists of numbers), received by rank 0 only.

    Cost: every rank pickles, rank 0 unpickles (CPU time, several copies in memory), plus an extra
    collective for the sizes; ranks may send different amounts. gloo supports gather; on NCCL the
    pickled bytes travel through the CURRENT cuda device, so torch.cuda.set_device must come first.
    """
    received = [None] * world_size if rank == 0 else None
    dist.gather_object(rows.cpu().tolist(), received, dst=0)
    return torch.tensor([row for part in received for row in part], dtype=torch.float64) if rank == 0 else None


def in_dataset_order(gathered, n):
    """Sort by dataset index and keep one row per image: DistributedSampler padded the shards with
    copies of the FIRST indices, and those images would otherwise be counted twice."""
    gathered = gathered.cpu()
    order = torch.argsort(gathered[:, 0], stable=True)
    rows, index = gathered[order], gathered[order, 0].long()
    first = torch.ones(len(index), dtype=torch.bool)
    first[1:] = index[1:] != index[:-1]  # a repeated index is a padding copy: the same image predicted twice
    rows = rows[first]
    if not torch.equal(rows[:, 0].long(), torch.arange(n)):
        raise RuntimeError(f"gathered rows cover {len(rows)} of {n} images")  # a bug, not a user error
    return rows, len(gathered) - len(rows)


def write_predictions(rows, out):
    """predictions.csv for people and spreadsheets, predictions.pt (exact tensors) for code."""
    with open(out / "predictions.csv", "w", newline="") as f:
        csv.writer(f).writerows([COLUMNS] + [[int(r[0]), int(r[1]), int(r[2])] + [f"{p:.6f}" for p in r[3:].tolist()]
                                             for r in rows])
    torch.save({"index": rows[:, 0].long(), "label": rows[:, 1].long(), "predicted": rows[:, 2].long(),
                "probs": rows[:, 3:].float()}, out / "predictions.pt")


def plot_confusion(label, predicted, plt, path):
    confusion = torch.bincount(label * 10 + predicted, minlength=100).view(10, 10)  # [true, predicted]
    shade = confusion.log1p() / confusion.max().log1p()  # log scale: the few errors stay visible beside the diagonal
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.imshow(shade.numpy(), cmap="Blues", vmin=0, vmax=1)
    for t, q in confusion.nonzero().tolist():
        ax.text(q, t, int(confusion[t, q]), ha="center", va="center", fontsize=7,
                color="white" if shade[t, q] > 0.6 else "black")
    ax.set(xticks=range(10), yticks=range(10), xlabel="predicted", ylabel="true label",
           title=f"confusion matrix, {len(label)} test images")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_misclassified(rows, test_set, plt, path):
    """The first 36 mistakes in dataset order, on ONE image: 36 subplots would take seconds to lay out."""
    label, predicted = rows[:, 1].long(), rows[:, 2].long()
    wrong = (label != predicted).nonzero().flatten()
    n_rows = max(1, -(-min(len(wrong), 36) // 6))
    canvas = torch.zeros(n_rows * 44, 6 * 32)  # 6 per row: a 16-pixel caption above each 28x28 digit; 0 is white
    fig, ax = plt.subplots(figsize=(6.4, 0.4 + 1.45 * n_rows))
    for k, i in enumerate(wrong[:36].tolist()):
        r, c = divmod(k, 6)
        canvas[r * 44 + 16:r * 44 + 44, c * 32 + 2:c * 32 + 30] = test_set[i][0][0] * MNIST_STD + MNIST_MEAN
        ax.text(c * 32 + 16, r * 44 + 15, f"#{i}: {int(label[i])} -> {int(predicted[i])}\n"
                f"p={rows[i, 3 + predicted[i]]:.2f}", ha="center", va="bottom", fontsize=7)
    ax.imshow(canvas.numpy(), cmap="gray_r", vmin=0, vmax=1)
    ax.axis("off")
    ax.set_title(f"first {min(len(wrong), 36)} of {len(wrong)} misclassified (#index: true -> predicted, "
                 f"its probability)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def write_results(rows, test_set, out):
    import matplotlib
    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    write_predictions(rows, out)
    plot_confusion(rows[:, 1].long(), rows[:, 2].long(), plt, out / "confusion_matrix.png")
    plot_misclassified(rows, test_set, plt, out / "misclassified.png")


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    args = parse_args(argv)
    launch = detect_launch()  # torchrun or srun: several processes; a plain `python`: one, no process group
    distributed = launch.world_size > 1
    device = pick_device(args.device, launch)  # cuda:LOCAL_RANK, or the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # gather_object on NCCL uses the current device
    model = load_model(args.checkpoint, args.width, device)  # before the group exists: a bad file fails fast
    if distributed:
        launch_env()  # srun sets only SLURM_* names: export RANK, WORLD_SIZE, MASTER_ADDR/PORT for env://
        dist.init_process_group(dist.get_default_backend_for_device(device),  # nccl for cuda, gloo for cpu
                                device_id=device if device.type == "cuda" else None)
    rank, world_size = launch.rank, launch.world_size

    test_set = load_mnist(args.data_dir, args.data, test_samples=args.test_samples, is_main=rank == 0,
                          barrier=dist.barrier if distributed else None)[-1]  # rank 0 prepares the files, the rest wait
    # shuffle=False, drop_last=False: rank r takes r, r+W, r+2W, ... padded to ceil(n/W) with the first indices.
    sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(test_set, batch_size=args.batch_size, sampler=sampler)
    start = time.perf_counter()
    rows = predict(model, loader, torch.tensor(list(sampler)), device)
    if rank == 0:
        how = f"gather {args.gather}" if distributed else "one process, no gather"
        print(f"{world_size} rank(s), {device.type}, {how}: {len(test_set)} test images -> "
              f"{len(sampler)} per rank, {sampler.total_size} in all (padding {sampler.total_size - len(test_set)})",
              flush=True)

    if not distributed:
        gathered = rows
    elif args.gather == "tensor":
        gathered = gather_tensor(rows, world_size)
    else:
        gathered = gather_objects(rows, rank, world_size)
    if rank == 0:
        results, duplicates = in_dataset_order(gathered, len(test_set))
        correct = int((results[:, 1] == results[:, 2]).sum())
        print(f"gathered {len(gathered)} rows on rank 0, removed {duplicates} padded duplicate(s): {len(results)} "
              f"predictions in dataset order ({time.perf_counter() - start:.1f} s)")
        print(f"accuracy {correct / len(results):.4f} ({correct}/{len(results)})")
        write_results(results, test_set, Path(args.out))
        print(f"wrote predictions.csv, predictions.pt, confusion_matrix.png, misclassified.png to {args.out}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
