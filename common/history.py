"""What a run measured, epoch by epoch: the epoch line, metrics.json, curves.png and, with --tensorboard, event files.

Every rank calls add() with the same (all-reduced) numbers; rank 0 alone prints and writes. The rows travel inside
each checkpoint too, so a run resumed into another --output-dir keeps its history.
One job, the record of the epochs, written to each place a learner reads it (curves.png: common/curves.py).
"""
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.config import args_to_dict
from common.curves import plot_curves
from common.distributed import get_world_size, is_main_process
from common.early_stopping import best_epoch, time_to_target
from common.files import atomic_write

PLOT_EVERY_S = 30  # matplotlib takes ~1 s a figure (its import included): redraw curves.png at most this often, and when the run ends


class History:
    def __init__(self, args, lesson: str, device: torch.device, warmup_seconds: float = 0.0, unit: str | None = "img"):
        self.args, self.device, self.dir = args, device, Path(args.output_dir)
        self.unit = unit  # the epoch line's "N img/s"; None: left to `rates` (lesson 08's text counts tokens)
        self.record = {
            "lesson": lesson, "world_size": get_world_size(),
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "device": device.type, "torch_version": torch.__version__, "args": args_to_dict(args),
            "warmup_seconds": warmup_seconds, "time_to_target_seconds": None, "best_epoch": None,
            "peak_memory_bytes": None, "epochs": [],
        }
        self._tensorboard = None
        self._plotted = (time.monotonic(), 0)  # when curves.png was last drawn, and with how many rows

    @property
    def rows(self) -> list[dict]:
        return self.record["epochs"]

    def _per_second(self, row: dict) -> str:
        return f" | {row['train_images_per_second']:,.0f} {self.unit}/s" if self.unit else ""

    def add(self, epoch: int, train: dict, test: dict, val: dict | None = None, lr: float | None = None,
            rates: str = "") -> dict:
        """One epoch's row from the train/test (/validation) sums that every rank reduced the same way; `rates`: more
        of the epoch line (lesson 08's tokens/s and MFU)."""
        row = {"epoch": epoch, "train_loss": train["loss"], "test_loss": test["loss"], "test_accuracy": test["accuracy"],
               "test_correct": test["correct"], "test_samples": test["count"], "epoch_seconds": train["seconds"],
               "train_images_per_second": train["images_per_second"], "lr": lr}
        if val is not None:
            row.update(val_loss=val["loss"], val_accuracy=val["accuracy"], val_samples=val["count"])
        self.rows.append(row)
        reached_before = self.record["time_to_target_seconds"] is not None
        self._update_record()
        if not is_main_process():
            return row
        val = f" | val_accuracy {row['val_accuracy']:.4f}" if "val_accuracy" in row else ""
        print(f"epoch {row['epoch']} | train_loss {row['train_loss']:.4f} | test_loss {row['test_loss']:.4f} | "
              f"test_accuracy {row['test_accuracy']:.4f} ({test['correct']}/{test['count']}){val} | "
              f"{row['epoch_seconds']:.2f} s{self._per_second(row)}{rates}", flush=True)
        if self.record["time_to_target_seconds"] is not None and not reached_before:
            print(f"target accuracy {self.args.target_accuracy} reached after "
                  f"{self.record['time_to_target_seconds']:.2f} s of training "
                  f"(warm-up before the clock: {self.record['warmup_seconds']:.2f} s)", flush=True)
        self.save()
        return row

    @property
    def best_epoch(self) -> int | None:
        return self.record["best_epoch"]

    def _update_record(self) -> None:
        self.record["time_to_target_seconds"] = time_to_target(self.rows, self.args.target_accuracy)
        self.record["best_epoch"] = best_epoch(self.rows)
        if self.device.type == "cuda":
            self.record["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)

    def save(self) -> None:
        with atomic_write(self.dir / "metrics.json", "w") as f:
            json.dump(self.record, f, indent=2)
        if time.monotonic() - self._plotted[0] > PLOT_EVERY_S:
            self._plot()
        if getattr(self.args, "tensorboard", False):
            self._write_tensorboard(self.rows[-1])

    def _write_tensorboard(self, row: dict) -> None:
        """Event files in OUTPUT_DIR/tensorboard: view them with `tensorboard --logdir runs` (pip install tensorboard)."""
        if self._tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter  # an extra: only runs that ask for it need it
            self._tensorboard = SummaryWriter(log_dir=str(self.dir / "tensorboard"))
        names = {"train_loss": "loss/train", "test_loss": "loss/test", "val_loss": "loss/val",
                 "test_accuracy": "accuracy/test", "val_accuracy": "accuracy/val", "lr": "lr",
                 "train_images_per_second": "images_per_second"}
        for key, tag in names.items():
            if row.get(key) is not None:
                self._tensorboard.add_scalar(tag, row[key], global_step=row["epoch"])
        self._tensorboard.flush()

    def _plot(self) -> None:
        plot_curves(self.record, self.dir / "curves.png")
        self._plotted = (time.monotonic(), len(self.rows))

    def close(self) -> None:
        """The end of the run: the last curves.png; with validation, the test accuracy of the model kept as best."""
        if is_main_process() and self.rows and self._plotted[1] != len(self.rows):
            self._plot()
        if self._tensorboard is not None:
            self._tensorboard.close()
        best = next((r for r in self.rows if r["epoch"] == self.best_epoch), None)
        if best and is_main_process():
            print(f"best epoch {best['epoch']} (val_accuracy {best['val_accuracy']:.4f}): test_accuracy "
                  f"{best['test_accuracy']:.4f} ({best['test_correct']}/{best['test_samples']}), "
                  f"its checkpoint kept as best in {self.dir}", flush=True)

    def state_dict(self) -> dict:
        return {"rows": json.dumps(self.rows)}  # one string: a DCP checkpoint stores it as it is

    def load_state_dict(self, state: dict, epoch: int) -> None:
        """The rows of the epochs before `epoch` (the one the resumed run does next); each epoch appears once."""
        self.record["epochs"] = [r for r in json.loads(state["rows"]) if r["epoch"] < epoch]
        self._update_record()
