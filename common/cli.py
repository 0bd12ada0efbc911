"""The command line every lesson script shares, so that `diff` between lessons shows only the new idea."""
from __future__ import annotations

import argparse
import gc
import os
import sys

from common.data import default_data_dir
from common.errors import CourseError


def usable_cpus() -> int:
    """The CPUs this process may run on (Slurm and taskset restrict them), not every CPU of the node."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


def default_num_workers() -> int:
    """DataLoader workers per process: this process's share of the usable CPUs, minus one for the training loop.

    Slurm's SLURM_CPUS_PER_TASK counts the CPUs of the whole task; torchrun splits a task into
    LOCAL_WORLD_SIZE processes, which must share them.
    """
    cpus = int(os.environ.get("SLURM_CPUS_PER_TASK", usable_cpus()))
    return max(0, min(8, cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1))


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], e.g. 0.99, got {value}")
    return value


def base_parser(lesson: str, description: str) -> argparse.ArgumentParser:
    """Flags shared by lessons 02-05; each lesson adds its own after this."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data", choices=["mnist", "synthetic"], default="mnist",
                   help="real MNIST, or synthetic digits written as genuine MNIST files (offline) (default: mnist)")
    p.add_argument("--data-dir", default=default_data_dir(),
                   help="folder holding MNIST/raw (default: $WORKSHOP_DATA_DIR or ./data)")
    p.add_argument("--train-samples", type=positive_int, default=None, help="use the first N training images (default: all)")
    p.add_argument("--test-samples", type=positive_int, default=None, help="use the first N test images (default: all)")
    p.add_argument("--epochs", type=positive_int, default=14, help="number of epochs to train (default: 14)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="training batch size PER PROCESS (default: 64)")
    p.add_argument("--test-batch-size", type=positive_int, default=1000, help="test batch size per process (default: 1000)")
    p.add_argument("--optimizer", choices=["adadelta", "adamw", "sgd"], default="adadelta",
                   help="adadelta is the classic recipe; adamw and sgd for large batches (default: adadelta)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate for ONE process and one micro-batch (default: 1.0 adadelta, 1e-3 adamw, 0.05 sgd)")
    p.add_argument("--lr-scaling", choices=["none", "linear", "sqrt"], default="none",
                   help="multiply --lr by (processes x --grad-accum), or its square root (default: none)")
    p.add_argument("--schedule", choices=["step", "onecycle"], default="step",
                   help="step: lr x gamma after every epoch; onecycle: up then down over the whole run (default: step)")
    p.add_argument("--gamma", type=float, default=0.7, help="learning-rate decay per epoch of --schedule step (default: 0.7)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="ramp the lr up linearly over the first N optimizer steps (default: 0)")
    p.add_argument("--target-accuracy", type=fraction, default=None,
                   help="stop after the first epoch whose test accuracy reaches this, e.g. 0.99 (default: run all epochs)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default: 1)")
    p.add_argument("--max-steps", type=positive_int, default=None, help="stop each epoch after N optimizer steps (default: no cap)")
    p.add_argument("--dry-run", action="store_true", help="smoke test: 1 epoch of 2 steps")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto picks cuda:LOCAL_RANK if there is a GPU (default: auto)")
    p.add_argument("--num-workers", type=int, default=default_num_workers(),
                   help="DataLoader worker processes (default: from SLURM_CPUS_PER_TASK, else the usable CPUs per process - 1)")
    p.add_argument("--output-dir", default=os.path.join("runs", lesson), help=f"where metrics, plots and checkpoints go (default: runs/{lesson})")
    p.add_argument("--resume", default=None,
                   help="'auto' (the newest good checkpoint in --output-dir, else start fresh) or a checkpoint path "
                        "(default: start fresh)")
    p.add_argument("--keep-checkpoints", type=positive_int, default=2, help="how many newest checkpoints to keep (default: 2)")
    p.add_argument("--data-on-device", action="store_true",
                   help="hold the whole dataset as tensors on the device instead of a DataLoader (fast)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (first steps are slow)")
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast for forward passes")
    p.add_argument("--width", type=positive_int, default=1,
                   help="multiply the CNN's hidden sizes; parameters grow ~width^2 (1: 1.2 M, 10: 120 M) (default: 1)")
    return p


def args_to_dict(args) -> dict:
    """argparse Namespace (or None) -> a dict of plain values, safe for JSON and weights_only loads."""
    return {k: (str(v) if isinstance(v, os.PathLike) else v) for k, v in vars(args or argparse.Namespace()).items()}


def parse(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.dry_run:
        args.epochs, args.max_steps = 1, 2
    return args


def _port_in_use(exc: BaseException) -> bool:
    text = str(exc)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def run(main, argv=None) -> None:
    """Call main(); a problem the user can fix becomes one line on stderr and exit code 2, not a traceback wall."""
    try:
        main(argv)
        # destroy_process_group() leaves gloo's last tensors to its worker threads; freeing them now, not
        # during interpreter shutdown, avoids a "terminate called without an active exception" at exit.
        gc.collect()
    except CourseError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except RuntimeError as exc:  # torch.distributed.DistNetworkError is one
        if not _port_in_use(exc):
            raise
        port, addr = os.environ.get("MASTER_PORT"), os.environ.get("MASTER_ADDR")
        from common.distributed import free_port
        print(f"error: MASTER_PORT {port} is already in use on {addr}: pick another, e.g. MASTER_PORT={free_port()} "
              f"(torchrun: --master_port or --rdzv_endpoint)", file=sys.stderr, flush=True)
        sys.exit(2)
