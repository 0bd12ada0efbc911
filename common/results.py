"""What a run leaves behind: one line per epoch, metrics.json and a loss/accuracy plot (main process only)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from common.cli import args_to_dict
from common.distributed import DistContext
from common.files import atomic_write


class RunRecorder:
    """Collects per-epoch numbers and rewrites OUTPUT_DIR/metrics.json and curves.png after each epoch."""

    def __init__(self, output_dir, lesson: str, ctx: DistContext, args, start_epoch: int = 1):
        self.dir = Path(output_dir)
        self.ctx = ctx
        earlier = []  # a resumed run keeps the epochs it did not redo, so each epoch appears once
        if start_epoch > 1 and (self.dir / "metrics.json").exists():
            earlier = [e for e in json.loads((self.dir / "metrics.json").read_text())["epochs"]
                       if e["epoch"] < start_epoch]
        self.record = {
            "lesson": lesson,
            "world_size": ctx.world_size,
            "backend": ctx.backend,
            "device": ctx.device.type,
            "torch_version": torch.__version__,
            "args": args_to_dict(args),
            "epochs": earlier,
            "peak_memory_bytes": None,
        }

    def add_epoch(self, epoch: int, train: dict, test: dict) -> dict:
        """train/test: the dicts of EpochMeter.reduce(), already global. Every rank may call this."""
        row = {
            "epoch": epoch,
            "train_loss": train["loss"],
            "test_loss": test["loss"],
            "test_accuracy": test["accuracy"],
            "test_samples": test["count"],
            "epoch_seconds": train["seconds"],
            "train_images_per_second": train["images_per_second"],
        }
        self.record["epochs"].append(row)
        if self.ctx.device.type == "cuda":
            self.record["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.ctx.device)
        if self.ctx.master_process:
            print(f"epoch {epoch} | train_loss {row['train_loss']:.4f} | test_loss {row['test_loss']:.4f} | "
                  f"test_accuracy {row['test_accuracy']:.4f} ({test['correct']}/{test['count']}) | "
                  f"{row['epoch_seconds']:.1f} s | {row['train_images_per_second']:,.0f} img/s", flush=True)
            self.save()
        return row

    def save(self) -> None:
        with atomic_write(self.dir / "metrics.json", "w") as f:
            json.dump(self.record, f, indent=2)
        self.plot()

    def plot(self) -> None:
        import matplotlib
        matplotlib.use("Agg")  # no display on compute nodes
        import matplotlib.pyplot as plt

        rows = self.record["epochs"]
        epochs = [r["epoch"] for r in rows]
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.5))
        ax_loss.plot(epochs, [r["train_loss"] for r in rows], "o-", label="train")
        ax_loss.plot(epochs, [r["test_loss"] for r in rows], "o-", label="test")
        ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
        ax_loss.legend()
        ax_acc.plot(epochs, [100 * r["test_accuracy"] for r in rows], "o-", color="tab:green")
        ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
        fig.suptitle(f"{self.record['lesson']}: {self.record['world_size']} process(es), {self.record['device']}")
        fig.tight_layout()
        fig.savefig(self.dir / "curves.png", dpi=100)
        plt.close(fig)
