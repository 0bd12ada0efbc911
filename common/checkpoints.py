"""The checkpoint folder of a run: names, which checkpoint to resume from, keep the newest N.

The lessons write and read checkpoints themselves (torch.save / dcp.save). Names (ckpt-eEEEE-sSSSSSS) count the
epochs completed and the steps done in the next one, so they sort by progress. Runs never mix: a fresh run never
writes among an earlier run's checkpoints, and a resume refuses a checkpoint of an incompatible run.
"""
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from common.distributed import barrier, is_main_process
from common.errors import CourseError, one_line
from common.files import creatable_folder, replace_folder
from common.log import log0, plural

# torch 2.9's DCP writer calls tensor.storage() and warns that TypedStorage is deprecated: nothing to act on.
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
NAME = re.compile(r"^ckpt-e(\d{4})-s(\d{7})(\.pt)?$")
FORMAT = "distributed-pytorch-course/v3"
# A checkpoint continues a run only if these agree (the rest, e.g. --epochs or the world size, may change).
# --max-steps is here because its epochs are cut short: a --max-steps run must not pass for a full one.
COMPATIBLE = ("data", "train_samples", "val_samples", "width", "blocks", "hidden", "sync_bn", "optimizer",
              "schedule", "max_steps")


def signature(args, lesson: str) -> dict:
    """What kind of run wrote a checkpoint, compared on resume. OneCycle spans exactly --epochs: those must agree."""
    onecycle = getattr(args, "schedule", None) == "onecycle"
    return {"format": FORMAT, "lesson": lesson, **{k: getattr(args, k, None) for k in COMPATIBLE},
            "onecycle_epochs": args.epochs if onecycle else None}


def read_meta(path) -> dict:
    """{"run", "position"} of a checkpoint file or DCP folder; CourseError if unreadable or not the course's."""
    path = Path(path)
    if not path.exists():
        raise CourseError(f"checkpoint {path} does not exist: check --resume")
    try:
        if path.is_dir():
            import torch.distributed.checkpoint as dcp  # here: only lessons 05, 06 write DCP folders (its import: ~1 s)
            dcp.FileSystemReader(path).read_metadata()  # a missing or cut .metadata fails here, before DCP logs it
            state = {"run": {k: None for k in signature(None, "")}, "position": {"epoch": 0, "step": 0, "rng": b""}}
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, checkpoint_id=path, no_dist=True)  # only these few values, each rank alone
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
            state = {"run": state["run"], "position": state["position"]}
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        why = one_line(str(exc).split("Traceback")[0], 200)  # DCP's messages embed whole tracebacks
        raise CourseError(f"{path} is not a readable checkpoint (truncated, or not written by this course): "
                          f"{why}") from None
    if state["run"].get("format") != FORMAT:
        raise CourseError(f"{path} was not written by this version of the course: start fresh or pass another")
    return state


class CheckpointDir:
    """OUTPUT_DIR/checkpoints: one .pt per checkpoint, or DCP folders (sharded). A --dry-run uses
    OUTPUT_DIR/dry-run-checkpoints, emptied at its start: its checkpoints never pass for, or block, a real run's."""

    def __init__(self, args, lesson: str, sharded: bool = False):
        problem = creatable_folder(args.output_dir)  # at the very start: before anything slow
        if problem:
            raise CourseError(f"--output-dir {args.output_dir}: {problem}: pick a folder you can write to")
        self.dir = Path(args.output_dir) / ("dry-run-checkpoints" if args.dry_run else "checkpoints")
        where = self.dir if args.dry_run else Path(args.output_dir)
        self.best_path = where / ("best" if sharded else "best.pt")  # the best validation epoch's checkpoint
        self.run = signature(args, lesson)
        self.keep, self.sharded, self.epochs = args.keep_checkpoints, sharded, args.epochs
        self.takes_weights = hasattr(args, "init_from")  # lesson 05: --init-from starts from another lesson's weights
        if args.dry_run and is_main_process():
            shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, position) -> Path:
        """Where the checkpoint of `position` goes: epochs completed and steps done in the next epoch."""
        return self.dir / f"ckpt-e{position.epoch - 1:04d}-s{position.step:07d}{'' if self.sharded else '.pt'}"

    def all(self) -> list[Path]:
        """The checkpoints in the folder, newest first."""
        if not self.dir.is_dir():
            return []
        return sorted((p for p in self.dir.iterdir() if NAME.match(p.name)), key=lambda p: p.name, reverse=True)

    def resume_from(self, spec: str | None) -> Path | None:
        """Every rank, before any data is read. None: a fresh run; "auto": the newest that reads back; or a path."""
        if is_main_process() and self.dir.is_dir():
            for stale in self.dir.glob("*.tmp"):  # shards of a save that was killed
                shutil.rmtree(stale, ignore_errors=True)
        barrier()
        if spec is None:
            if self.all():
                raise CourseError(f"{self.dir} holds checkpoints of an earlier run: continue it with --resume auto, "
                                  f"or start a new run with another --output-dir")
            return None
        if spec == "auto":
            for path in self.all():  # the newest that reads back: a save cut short is skipped
                try:
                    saved = read_meta(path)
                    break
                except CourseError as exc:
                    log0(f"resume: skipping {path} ({exc})")
            else:
                log0(f"resume: starting fresh (no checkpoint in {self.dir})")
                return None
        else:
            path, saved = Path(spec), read_meta(spec)
        if saved["run"].get("lesson") != self.run["lesson"]:  # the other keys would differ as noise (one lesson's flags)
            fix = f"to start from its weights, use --init-from {path} instead" if self.takes_weights and path.is_file() \
                else "continue it with that lesson's script, or start fresh with another --output-dir"
            raise CourseError(f"{path} is from another kind of run (lesson {saved['run'].get('lesson')!r} there, "
                              f"{self.run['lesson']!r} here): --resume continues a run of the same lesson; {fix}")
        differ = [f"{k} {saved['run'].get(k)!r} there, {v!r} here" for k, v in self.run.items()
                  if saved["run"].get(k) != v]
        if differ:
            raise CourseError(f"{path} is from another kind of run ({'; '.join(differ)}): use the same flags, "
                              f"or start fresh with another --output-dir")
        epoch, step = saved["position"]["epoch"], saved["position"]["step"]
        log0(f"resume: from {path}, continuing at epoch {epoch} step {step}")
        if epoch > self.epochs:
            log0(f"nothing to train: the checkpoint has finished {plural(epoch - 1, 'epoch')} and --epochs is "
                 f"{self.epochs} (raise --epochs to train more)")
        return path

    def prune(self, just_written: Path, best: bool = False) -> None:
        """After a save, on rank 0: keep the newest `keep` checkpoints, and with best=True a copy as best(.pt)."""
        if not is_main_process():
            return
        if best:  # copy, then rename into place: a crash leaves the previous best whole
            scratch = self.best_path.with_name(self.best_path.name + ".tmp")
            if just_written.is_dir():
                shutil.rmtree(scratch, ignore_errors=True)
                shutil.copytree(just_written, scratch)
                replace_folder(scratch, self.best_path)
            else:
                shutil.copyfile(just_written, scratch)
                os.replace(scratch, self.best_path)
        older = [p for p in self.all() if p != just_written]
        for old in older[self.keep - 1:]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
