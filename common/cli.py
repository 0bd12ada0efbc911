"""The command line every lesson script shares, so that `diff` between lessons shows only the new idea.

Every flag is range-checked when it is parsed; a mistake is one line (`error: ...`) and exit code 2.
`--config FILE` (YAML or TOML, keys = flag names) sets defaults that flags on the command line override;
every run writes its resolved config.yaml, so `--config runs/X/config.yaml` replays it.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

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


def course_folder() -> Path | None:
    """The course folder of the lesson script that runs (COURSE/NN_lesson/...), or None for anything else."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)  # none in a notebook or an interactive session
    path = Path(script).resolve() if script else None
    course = next((p for p in path.parents if (p / "common").is_dir() and (p / "01_setup").is_dir()), None) \
        if path else None
    lesson = path.relative_to(course).parts[0] if course else ""
    return course if lesson[:2].isdigit() and lesson[2:3] == "_" else None  # not pytest in COURSE/.venv, say


def work_in_course_folder() -> None:
    """Make every relative path (data/, runs/, and those given in flags or --config) the course folder's.

    A lesson started from inside its own folder, or from anywhere else, then reads and writes where the
    pages say, and never creates a second data/ or runs/ beside the script. The folder is the script's own
    course, not the one `common` happens to be imported from (another clone may be pip-installed).
    """
    course = course_folder()
    try:
        here = Path.cwd()
    except FileNotFoundError:  # the folder was deleted under the shell
        here = None
    if course is None or here == course:  # not a course script (e.g. a test calling main()), or already there
        return
    os.chdir(course)
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(f"working in the course folder {course}: relative paths (data/, runs/, yours) are read there",
              flush=True)


class Parser(argparse.ArgumentParser):
    """argparse, with no abbreviations (--data is not --data-dir) and mistakes reported on one line.

    Relative paths mean the course folder's, whatever the working directory (work_in_course_folder).
    """

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        work_in_course_folder()  # before any path is read, --config FILE included
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        raise CourseError(f"{message} (see {Path(self.prog).name} --help)")


def base_parser(lesson: str, description: str) -> Parser:
    """Flags shared by lessons 02-05; each lesson adds its own after this."""
    p = Parser(description=description)
    p.add_argument("--config", metavar="FILE", help="YAML or TOML file of flag values; command-line flags win "
                   "(e.g. a run's own runs/X/config.yaml) (default: none)")
    p.add_argument("--data", choices=["mnist", "synthetic"], default="mnist",
                   help="real MNIST, or synthetic digits written as genuine MNIST files (offline) (default: mnist)")
    p.add_argument("--data-dir", default=default_data_dir(),
                   help="folder holding MNIST/raw (default: $WORKSHOP_DATA_DIR or ./data)")
    p.add_argument("--train-samples", type=positive_int, default=None, help="use the first N training images (default: all)")
    p.add_argument("--val-samples", type=count, default=0,
                   help="hold N of the training images out for validation and early stopping (default: 0, none)")
    p.add_argument("--test-samples", type=positive_int, default=None, help="use the first N test images (default: all)")
    p.add_argument("--epochs", type=positive_int, default=14, help="number of epochs to train (default: 14)")
    p.add_argument("--patience", type=positive_int, default=None,
                   help="early stopping: stop after N epochs without a better validation accuracy (needs "
                        "--val-samples) (default: off)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="training batch size PER PROCESS (default: 64)")
    p.add_argument("--test-batch-size", type=positive_int, default=1000, help="test batch size per process (default: 1000)")
    p.add_argument("--optimizer", choices=["adadelta", "adamw", "sgd"], default="adadelta",
                   help="adadelta is the classic recipe; adamw and sgd for large batches (default: adadelta)")
    p.add_argument("--lr", type=positive_float, default=None,
                   help="learning rate for ONE process and one micro-batch (default: 1.0 adadelta, 1e-3 adamw, 0.05 sgd)")
    p.add_argument("--lr-scaling", choices=["none", "linear", "sqrt"], default="none",
                   help="multiply --lr by (processes x --grad-accum), or its square root (default: none)")
    p.add_argument("--schedule", choices=["step", "onecycle"], default="step",
                   help="step: lr x gamma after every epoch; onecycle: up then down over the whole run (default: step)")
    p.add_argument("--gamma", type=decay, default=0.7, help="learning-rate decay per epoch of --schedule step (default: 0.7)")
    p.add_argument("--warmup-steps", type=count, default=0,
                   help="ramp the lr up linearly over the first N optimizer steps (default: 0)")
    p.add_argument("--grad-accum", type=positive_int, default=1,
                   help="micro-batches per optimizer step (effective batch x N); DDP/FSDP sync once per step (default: 1)")
    p.add_argument("--clip-grad", type=positive_float, metavar="MAX_NORM", help="clip the gradients' norm (default: off)")
    p.add_argument("--target-accuracy", type=fraction, default=None,
                   help="stop after the first epoch whose test accuracy reaches this, e.g. 0.99 (default: run all epochs)")
    p.add_argument("--seed", type=count, default=1, help="random seed (default: 1)")
    p.add_argument("--max-steps", type=positive_int, default=None, help="stop each epoch after N optimizer steps (default: no cap)")
    p.add_argument("--dry-run", action="store_true",
                   help="smoke test: 1 epoch of 2 steps; its checkpoints go to OUTPUT_DIR/dry-run-checkpoints")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto picks cuda:LOCAL_RANK if there is a GPU (default: auto)")
    p.add_argument("--num-workers", type=count, default=default_num_workers(),
                   help="DataLoader worker processes (default: from SLURM_CPUS_PER_TASK, else the usable CPUs per process - 1)")
    p.add_argument("--output-dir", default=os.path.join("runs", lesson), help=f"where metrics, plots and checkpoints go (default: runs/{lesson})")
    p.add_argument("--resume", default=None,
                   help="'auto' (the newest good checkpoint in --output-dir, else start fresh) or a checkpoint path "
                        "(default: start fresh)")
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


def _read_config(path: str) -> dict:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CourseError(f"--config {path}: {exc.strerror}: check the path") from None
    try:
        if path.endswith(".toml"):
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise CourseError(f"--config {path}: TOML needs Python 3.11 or newer: write it as YAML") from None
            values = tomllib.loads(text)
        else:
            import yaml
            values = yaml.safe_load(text) or {}
    except Exception as exc:  # the parsers' own error types differ
        raise CourseError(f"--config {path} is not valid {'TOML' if path.endswith('.toml') else 'YAML'}: "
                          f"{' '.join(str(exc).split())[:200]}") from None
    if not isinstance(values, dict):
        raise CourseError(f"--config {path}: expected `flag: value` lines, e.g. `epochs: 3`")
    return values


def _apply_config(parser: Parser, path: str) -> None:
    """Make the file's values the parser's defaults, each checked by its flag's own type and choices."""
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    defaults = {}
    for key, value in _read_config(path).items():
        dest = str(key).replace("-", "_")
        if dest not in actions:
            close = difflib.get_close_matches(dest, actions, n=1)
            hint = f": did you mean {close[0].replace('_', '-')}?" if close else ": see --help for the flags"
            raise CourseError(f"--config {path}: unknown key {key!r}{hint}")
        action = actions[dest]
        if isinstance(value, bool) and action.nargs == "?":  # `amp: true`: the bare flag; `amp: false`: not given
            value = action.const if value else action.default
        if value is not None and action.type is not None and not isinstance(value, bool):
            try:
                value = action.type(str(value))
            except argparse.ArgumentTypeError as exc:
                raise CourseError(f"--config {path}: {key}: {exc}") from None
        if action.choices is not None and value not in action.choices and value != action.default:  # amp: null
            raise CourseError(f"--config {path}: {key}: {value!r} is not one of {', '.join(map(str, action.choices))}")
        defaults[dest] = value
    parser.set_defaults(**defaults)


def parse(parser: Parser, argv=None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    first, _ = parser.parse_known_args(argv)  # only to find --config
    if first.config:
        _apply_config(parser, first.config)
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


def args_to_dict(args) -> dict:
    """argparse Namespace (or None) -> a dict of plain values, safe for JSON and weights_only loads."""
    return {k: (str(v) if isinstance(v, os.PathLike) else v) for k, v in vars(args or argparse.Namespace()).items()}


def save_config(args, path) -> None:
    """The resolved flags as YAML (one `flag: value` line each): `--config PATH` runs the same again."""
    from common.files import atomic_write
    skip = {"config", "resume", "dry_run"}  # how THIS run was started, not what it trains
    lines = [f"{k.replace('_', '-')}: {json.dumps(v)}" for k, v in args_to_dict(args).items() if k not in skip]
    with atomic_write(path, "w") as f:
        f.write("# written by the run itself: replay it with --config this-file (and another --output-dir)\n")
        f.write("\n".join(lines) + "\n")
