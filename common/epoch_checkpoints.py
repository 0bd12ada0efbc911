"""The lessons' checkpoints: OUTPUT_DIR/checkpoints/LESSON-epoch-NNN, a .pt file or a DCP folder, one per epoch.

Each is written under a temporary name and renamed once complete, so a crash never leaves half a checkpoint where
--resume auto looks; the newest two are kept. Runs never mix: a fresh run refuses a folder that holds checkpoints,
and a resume refuses flags that define the run (RUN_FLAGS) other than those recorded beside its checkpoints.
(The trainer's checkpoints, which resume in the middle of an epoch, are common/checkpoints.py's.)
"""
import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from common.errors import CourseError
from common.files import atomic_write, creatable_folder, replace_folder

KEEP = 2
RECORD = "run.json"  # beside the checkpoints: the values of RUN_FLAGS the run was started with
# A resume must give the run's own values of these: its data, test set, data order, batch, model shape (06, 07), and
# --lr and --gamma, which the checkpoint's optimizer and schedule would silently override. The other flags may change:
# --epochs, --resume, --num-workers, --device, the folders, --test-batch-size, the number of processes and the mesh.
RUN_FLAGS = ("data", "train_samples", "test_samples", "seed", "batch_size", "lr", "gamma", "blocks", "hidden")
# torch 2.9's DCP writer calls tensor.storage() and warns that TypedStorage is deprecated: nothing to act on.
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)


class EpochCheckpoints:
    def __init__(self, output_dir, lesson: str, sharded: bool = False, flags=None):
        """flags: the parsed command line, whose RUN_FLAGS are recorded and checked on resume (None: neither)."""
        problem = creatable_folder(output_dir)  # at the very start: before anything slow
        if problem:
            raise CourseError(f"--output-dir {output_dir}: {problem}: pick a folder you can write to")
        self.dir, self.lesson, self.suffix = Path(output_dir) / "checkpoints", lesson, "" if sharded else ".pt"
        self.name = re.compile(rf"^{re.escape(lesson)}-epoch-\d{{3,}}{re.escape(self.suffix)}$")
        self.run = None if flags is None else {k: getattr(flags, k) for k in RUN_FLAGS if hasattr(flags, k)}

    def _found(self) -> list[Path]:
        """Every finished checkpoint in the folder, of any lesson, newest first."""
        if not self.dir.is_dir():
            return []
        done = [p for p in self.dir.iterdir() if "-epoch-" in p.name and not p.name.endswith(".tmp")]
        return sorted(done, key=lambda p: int(re.search(r"-epoch-(\d+)", p.name)[1]), reverse=True)

    def resume_from(self, spec: str | None) -> Path | None:
        """None: a fresh run (refused if the folder holds checkpoints); "auto": the newest, or None; else a path."""
        found = self._found()
        if spec is None:
            if found:
                raise CourseError(f"{self.dir} holds checkpoints of an earlier run: continue it with --resume auto, "
                                  f"or start a new run with another --output-dir")
            return None
        path = (found[0] if found else None) if spec == "auto" else Path(spec)
        if path is not None and not path.exists():
            raise CourseError(f"checkpoint {path} does not exist: check --resume")
        if path is not None and not self.name.match(path.name):
            raise CourseError(f"{path} is not a lesson {self.lesson} checkpoint ({self.lesson}-epoch-NNN{self.suffix}): "
                              f"resume with that lesson's script, or start fresh with another --output-dir")
        if path is not None:
            self._check_same_run(path)
        return path

    def _check_same_run(self, path: Path) -> None:
        """Refuse a resume whose RUN_FLAGS differ from the record beside `path` (none: checkpoints of an older course)."""
        record = path.parent / RECORD
        if self.run is None or not record.is_file():
            return
        theirs = json.loads(record.read_text())
        differ = [k for k, v in self.run.items() if theirs.get(k) != v]
        if differ:
            raise CourseError(f"{path} was written with {_shown(theirs, differ)}, this command has "
                              f"{_shown(self.run, differ)}: a resume continues that run, so give it the same values, "
                              f"or start a new run with another --output-dir")

    @contextmanager
    def writing(self, epoch: int):
        """Yield the temporary path to write epoch's checkpoint to. When the block ends (on every rank that writes),
        rank 0 renames it into place and deletes all but the newest KEEP."""
        final = self.dir / f"{self.lesson}-epoch-{epoch:03d}{self.suffix}"
        scratch = final.with_name(final.name + ".tmp")
        self.dir.mkdir(parents=True, exist_ok=True)
        yield scratch
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        if self.run is not None:  # before the checkpoint: a finished checkpoint always has its record
            with atomic_write(self.dir / RECORD, "w") as f:
                f.write(json.dumps(self.run, indent=1) + "\n")
        if self.suffix:
            os.replace(scratch, final)
        else:
            replace_folder(scratch, final)  # a DCP folder: every rank wrote its shards, the last step wrote .metadata
        for old in [p for p in self._found() if self.name.match(p.name)][KEEP:]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()


def _shown(values: dict, keys) -> str:
    """The flags as typed: `--train-samples 2000`, or `no --train-samples` for a flag left at None."""
    flags = [(f"--{k.replace('_', '-')}", values.get(k)) for k in keys]
    return ", ".join(f"{flag} {value}" if value is not None else f"no {flag}" for flag, value in flags)
