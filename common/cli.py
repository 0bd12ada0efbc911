"""The command line every lesson script shares, so that `diff` between lessons shows only the new idea.

Every flag is range-checked when it is parsed; a mistake is one line (`error: ...`) and exit code 2.
"""
import argparse
import difflib
import os
import sys
from pathlib import Path

from common.config import apply_config
from common.download import default_data_dir
from common.errors import CourseError
from common.files import work_in_course_folder
from common.loaders import default_num_workers


def _number(kind, low, low_ok: bool, high=None, example=""):
    """An argparse type: a `kind` number above `low` (or equal if low_ok) and at most `high`."""
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value < low or (value == low and not low_ok) or (high is not None and value > high):
            bound = f"{'>=' if low_ok else '>'} {low}" + (f" and <= {high}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"must be {bound}{example}, got {text}")
        return value
    return check


positive_int = _number(int, 1, True)
count = _number(int, 0, True)  # zero allowed
positive_float = _number(float, 0, False)
fraction = _number(float, 0, False, 1, example=", e.g. 0.99")
decay = _number(float, 0, False, 1, example=", e.g. 0.7")


class Parser(argparse.ArgumentParser):
    """argparse with no abbreviations (--data is not --data-dir), mistakes on one line, and the range-checked types at
    hand for a script's own flags: `type=parser.positive_int` says `argument --hidden: must be >= 1, got 0`."""
    positive_int, count = staticmethod(positive_int), staticmethod(count)

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str):
        raise CourseError(f"{message} (see {Path(self.prog).name} --help)")


def lesson_parser(lesson: str, description: str) -> Parser:
    """The flags of the lesson scripts 02-07 (pytorch/examples' MNIST flags, plus data, device and checkpoints).
    Called first by a lesson: from here on, relative paths (data/, runs/, the flags') are the course folder's."""
    work_in_course_folder()
    if hasattr(sys.stdout, "reconfigure"):  # not in a notebook: there the kernel's stream writes whole lines
        # One write per printed line, even under PYTHONUNBUFFERED=1 (Slurm scripts, tests): print() writes the text
        # and its newline separately, and the ranks sharing one log would interleave between the two.
        sys.stdout.reconfigure(line_buffering=True, write_through=False)
    p = Parser(description=description)
    p.add_argument("--data", choices=["mnist", "synthetic"], default="mnist",
                   help="real MNIST, or synthetic digits written as genuine MNIST files (offline) (default: mnist)")
    p.add_argument("--data-dir", default=default_data_dir(),
                   help="folder holding MNIST/raw (default: $WORKSHOP_DATA_DIR or ./data)")
    p.add_argument("--train-samples", type=positive_int, default=None, help="use the first N training images (default: all)")
    p.add_argument("--test-samples", type=positive_int, default=None, help="use the first N test images (default: all)")
    p.add_argument("--epochs", type=positive_int, default=14, help="number of epochs to train (default: 14)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="training batch size PER PROCESS (default: 64)")
    p.add_argument("--test-batch-size", type=positive_int, default=1000, help="test batch size per process (default: 1000)")
    p.add_argument("--lr", type=positive_float, default=1.0,
                   help="learning rate of Adadelta for ONE process (default: 1.0)")
    p.add_argument("--gamma", type=decay, default=0.7, help="learning-rate decay per epoch (default: 0.7)")
    p.add_argument("--seed", type=count, default=1, help="random seed (default: 1)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto picks cuda:LOCAL_RANK if there is a GPU (default: auto)")
    p.add_argument("--num-workers", type=count, default=default_num_workers(),
                   help="DataLoader worker processes (default: from SLURM_CPUS_PER_TASK, else the usable CPUs per process - 1)")
    p.add_argument("--output-dir", default=os.path.join("runs", lesson), help=f"where checkpoints (and the trainer's metrics) go (default: runs/{lesson})")
    p.add_argument("--resume", default=None,
                   help="'auto' (the newest good checkpoint in --output-dir, else start fresh) or a checkpoint path "
                        "(default: start fresh; a folder holding checkpoints is refused)")
    return p


def base_parser(lesson: str, description: str) -> Parser:
    """The trainer's flags: the lessons' flags, then every production feature's."""
    p = lesson_parser(lesson, description)
    p.set_defaults(lr=None)  # the trainer's default depends on --optimizer
    next(a for a in p._actions if a.dest == "lr").help = ("learning rate for ONE process and one micro-batch "
                                                          "(default: 1.0 adadelta, 1e-3 adamw, 0.05 sgd)")
    p.add_argument("--config", metavar="FILE", help="YAML or TOML file of flag values; command-line flags win "
                   "(e.g. a run's own runs/X/config.yaml) (default: none)")
    p.add_argument("--val-samples", type=count, default=0,
                   help="hold N of the training images out for validation and early stopping (default: 0, none)")
    p.add_argument("--patience", type=positive_int, default=None,
                   help="early stopping: stop after N epochs without a better validation accuracy (needs "
                        "--val-samples) (default: off)")
    p.add_argument("--optimizer", choices=["adadelta", "adamw", "sgd"], default="adadelta",
                   help="adadelta is the classic recipe; adamw and sgd for large batches (default: adadelta)")
    p.add_argument("--lr-scaling", choices=["none", "linear", "sqrt"], default="none",
                   help="multiply --lr by (processes x --grad-accum), or its square root (default: none)")
    p.add_argument("--schedule", choices=["step", "onecycle"], default="step",
                   help="step: lr x gamma after every epoch; onecycle: up then down over the whole run (default: step)")
    p.add_argument("--warmup-steps", type=count, default=0,
                   help="ramp the lr up linearly over the first N optimizer steps (default: 0)")
    p.add_argument("--grad-accum", type=positive_int, default=1,
                   help="micro-batches per optimizer step (effective batch x N); DDP/FSDP sync once per step (default: 1)")
    p.add_argument("--clip-grad", type=positive_float, metavar="MAX_NORM", help="clip the gradients' norm (default: off)")
    p.add_argument("--target-accuracy", type=fraction, default=None,
                   help="stop after the first epoch whose test accuracy reaches this, e.g. 0.99 (default: run all epochs)")
    p.add_argument("--max-steps", type=positive_int, default=None, help="stop each epoch after N optimizer steps (default: no cap)")
    p.add_argument("--dry-run", action="store_true",
                   help="smoke test: 1 epoch of 2 steps; its checkpoints go to OUTPUT_DIR/dry-run-checkpoints")
    p.add_argument("--keep-checkpoints", type=positive_int, default=2, help="how many newest checkpoints to keep (default: 2)")
    p.add_argument("--data-on-device", action="store_true",
                   help="hold the whole dataset as tensors on the device instead of a DataLoader (fast)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile the model; the first steps pay for compiling (default: off; BACKEND: inductor, "
                        "or aot_eager to check the graphs quickly)")
    p.add_argument("--amp", nargs="?", const="auto", default=None, choices=["auto", "bf16", "fp16"],
                   help="autocast the forward passes: bf16 where the device runs bfloat16 natively, else fp16 with "
                        "gradient scaling (--amp alone: auto) (default: off, float32)")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files to OUTPUT_DIR/tensorboard (pip install tensorboard)")
    p.add_argument("--width", type=positive_int, default=1,
                   help="multiply the CNN's channels and hidden size: ACTIVATIONS grow with it (1: 1.2 M, 10: 120 M "
                        "parameters) (default: 1)")
    p.add_argument("--blocks", type=count, default=0,
                   help="add N hidden-to-hidden blocks after fc1: PARAMETERS grow, activations barely (default: 0)")
    p.add_argument("--hidden", type=positive_int, default=None,
                   help="width of fc1 and the blocks (default: 128 x --width, the classic 128)")
    return p


def parse(parser: Parser, argv=None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    first, _ = parser.parse_known_args(argv)  # only to find --config
    if first.config:
        apply_config(parser, first.config)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.epochs, args.max_steps = 1, 2
    if args.compile:
        from torch._dynamo import list_backends
        if args.compile not in list_backends(exclude_tags=()):
            close = difflib.get_close_matches(args.compile, list_backends(exclude_tags=()), n=1)
            raise CourseError(f"--compile {args.compile}: not a torch.compile backend"
                              f"{f'; did you mean {close[0]}?' if close else ' (try inductor or aot_eager)'}")
    if args.patience and not args.val_samples:
        raise CourseError("--patience needs a validation set: add --val-samples N (e.g. 5000)")
    return args
