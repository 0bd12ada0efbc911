"""Progress: where a run is (epoch, step), what it measured, and whether the cluster asked it to stop.

One object per run, and the only state besides model, optimizer and scheduler that a checkpoint holds:
  epochs() / batches()   the epochs and batches still to do: a restarted run skips what it already did
  add_loss() / end_epoch()  the training loss, one line per epoch, metrics.json and curves.png
  stop_on(signals)       (cluster lessons) Slurm's SIGUSR1 / SIGTERM become a stop that EVERY rank agrees on
  state_dict()           position and every rank's random-number state, so a resume is exact
"""
from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist

from common.cli import args_to_dict
from common.distributed import get_rank, get_world_size, is_main_process
from common.files import atomic_write
from common.loaders import steps_per_epoch
from common.log import progress_bar
from common.metrics import EpochMeter

FORMAT = "distributed-pytorch-course/v2"
# A checkpoint continues a run only if these agree (the rest, e.g. --epochs or the world size, may change).
COMPATIBLE = ("data", "train_samples", "width", "sync_bn", "optimizer", "schedule")


def compatibility(args, lesson: str) -> dict:
    return {"lesson": lesson, **{k: getattr(args, k, None) for k in COMPATIBLE}}


class Progress:
    CHECK_EVERY = 10  # optimizer steps between the all_reduces that agree on a stop

    def __init__(self, args, lesson: str, device: torch.device, world_size: int = 1, warmup_seconds: float = 0.0):
        self.args, self.lesson, self.device = args, lesson, device
        self.dir = Path(args.output_dir)
        self.epoch, self.step = 1, 0  # the epoch to run next, and the optimizer steps already done in it
        self.stopped = False  # True once every rank agreed to stop (a signal)
        self.signal = 0  # this rank's signal: 0 none, 1 SIGTERM, 2 SIGUSR1 (MAX over ranks: SIGUSR1 wins)
        self._saved_handlers: dict = {}
        self._meter = None
        # For tests and exercises: FAIL_AT_STEP=RANK:STEP makes one rank raise at that step of the first epoch
        # it trains; RANK:STEP:USR1 (TERM, KILL) makes it send itself that signal there instead, as Slurm would.
        rank, step, sig = (os.environ.get("FAIL_AT_STEP", "").split(":") + ["", ""])[:3]
        once = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # not again after torchrun restarts us
        self.fail_at = (int(rank), int(step), sig) if step and once else None
        self.record = {
            "lesson": lesson, "world_size": world_size, "backend": dist.get_backend() if dist.is_initialized() else None,
            "device": device.type, "torch_version": torch.__version__, "args": args_to_dict(args),
            "warmup_seconds": warmup_seconds, "time_to_target_seconds": None, "epochs": [], "peak_memory_bytes": None,
        }

    # ---- where we are ---------------------------------------------------------------------------
    def epochs(self, last: int):
        """The epochs still to run; ends early once --target-accuracy is reached (or a stop was agreed)."""
        if self.epoch > last and is_main_process():
            print(f"nothing to train: the checkpoint has finished {self.epoch - 1} epochs and --epochs is {last} "
                  f"(raise --epochs to train more)", flush=True)
        try:
            while self.epoch <= last and not self.stopped and self.record["time_to_target_seconds"] is None:
                yield self.epoch
        finally:
            for sig, handler in self._saved_handlers.items():  # leave a notebook's kernel as we found it
                signal.signal(sig, handler)

    def batches(self, loader, per_step: int = 1):
        """This epoch's batches, minus those done before a restart; ends early if every rank agreed to stop.

        per_step: micro-batches per optimizer step (--grad-accum). --max-steps caps the steps.
        """
        steps = steps_per_epoch(loader, self.args)
        self._meter = EpochMeter(self.device)
        first = self.step * per_step
        batches = itertools.islice(loader, first, steps * per_step)
        for i, batch in enumerate(progress_bar(batches, f"epoch {self.epoch}", steps * per_step - first), first):
            if i % per_step == 0:
                self.step = i // per_step
                if self._stop_agreed():
                    self.stopped = True
                    return
            yield batch
        self.step = steps
        self._meter.stop_clock()

    def add_loss(self, loss: torch.Tensor, count: int) -> None:
        self._meter.update(loss.detach() * count, 0, count)  # a SUM, so the epoch's mean is exact

    def end_epoch(self, test: dict) -> dict:
        """Every rank calls it after test(); rank 0 prints the epoch line and rewrites metrics.json."""
        train = self._meter.reduce()  # sums over all ranks
        row = {"epoch": self.epoch, "train_loss": train["loss"], "test_loss": test["loss"],
               "test_accuracy": test["accuracy"], "test_samples": test["count"], "epoch_seconds": train["seconds"],
               "train_images_per_second": train["images_per_second"]}
        rows = self.record["epochs"]
        rows.append(row)
        target = self.args.target_accuracy
        if target is not None and row["test_accuracy"] >= target:
            self.record["time_to_target_seconds"] = sum(r["epoch_seconds"] for r in rows)
        if self.device.type == "cuda":
            self.record["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
        if is_main_process():
            print(f"epoch {row['epoch']} | train_loss {row['train_loss']:.4f} | test_loss {row['test_loss']:.4f} | "
                  f"test_accuracy {row['test_accuracy']:.4f} ({test['correct']}/{test['count']}) | "
                  f"{row['epoch_seconds']:.2f} s | {row['train_images_per_second']:,.0f} img/s", flush=True)
            if self.record["time_to_target_seconds"] is not None:
                print(f"target accuracy {target} reached after {self.record['time_to_target_seconds']:.2f} s of "
                      f"training (warm-up before the clock: {self.record['warmup_seconds']:.2f} s)", flush=True)
            self.save()
        self.epoch, self.step = self.epoch + 1, 0
        return row

    # ---- stopping when the cluster asks ------------------------------------------------------------
    def stop_on(self, *signals: int) -> None:
        """A signal only sets a flag; ranks compare flags every CHECK_EVERY steps and stop at the same step."""
        for sig in signals:
            self._saved_handlers[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.signal = max(self.signal, 2 if signum == signal.SIGUSR1 else 1)

    def _stop_agreed(self) -> bool:
        if self.fail_at and self.fail_at[:2] == (get_rank(), self.step):
            if not self.fail_at[2]:
                raise RuntimeError(f"FAIL_AT_STEP: rank {get_rank()} fails at step {self.step} on purpose")
            os.kill(os.getpid(), getattr(signal, "SIG" + self.fail_at[2]))
            self.fail_at = None
        if not self._saved_handlers or self.step % self.CHECK_EVERY:
            return False
        flag = torch.tensor([float(self.signal)], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # a signal at ANY rank stops ALL of them here
        self.signal = int(flag.item())
        return self.signal > 0

    def requeue(self) -> None:
        """After the checkpoint: say what happened and, for SIGUSR1, ask Slurm to run the job again."""
        if is_main_process():
            name = {1: "SIGTERM", 2: "SIGUSR1"}[self.signal]
            then = requeue_slurm_job() if name == "SIGUSR1" else "not requeueing (Slurm decides after a SIGTERM)"
            print(f"preempted: {name} at epoch {self.epoch} step {self.step}, checkpoint saved; {then}", flush=True)

    # ---- checkpoints and metrics.json ---------------------------------------------------------
    def state_dict(self) -> dict:
        """A collective: every rank's RNG state travels to every rank, rank 0 saves them all."""
        mine = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            mine["cuda"] = torch.cuda.get_rng_state()
        states = [mine]
        if dist.is_initialized():
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, mine)
        buffer = io.BytesIO()
        torch.save(states, buffer)  # one opaque value: its length depends on the number of ranks
        return {"format": FORMAT, "epoch": self.epoch, "step": self.step, "rng": buffer.getvalue(),
                "run": compatibility(self.args, self.lesson)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = state["epoch"], state["step"]
        states = torch.load(io.BytesIO(state["rng"]), weights_only=True)
        if len(states) == get_world_size():  # with another number of ranks, exact replay is impossible anyway
            torch.set_rng_state(states[get_rank()]["torch"].cpu())
            if "cuda" in states[get_rank()] and torch.cuda.is_available():
                torch.cuda.set_rng_state(states[get_rank()]["cuda"].cpu())
        metrics = self.dir / "metrics.json"  # the epochs already done keep their rows, each epoch appears once
        if metrics.exists():
            earlier = json.loads(metrics.read_text())["epochs"]
            self.record["epochs"] = [r for r in earlier if r["epoch"] < self.epoch]

    def save(self) -> None:
        with atomic_write(self.dir / "metrics.json", "w") as f:
            json.dump(self.record, f, indent=2)
        plot_curves(self.record, self.dir / "curves.png")


def plot_curves(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt

    rows = record["epochs"]
    epochs = [r["epoch"] for r in rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax_loss.plot(epochs, [r["train_loss"] for r in rows], "o-", label="train")
    ax_loss.plot(epochs, [r["test_loss"] for r in rows], "o-", label="test")
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_acc.plot(epochs, [100 * r["test_accuracy"] for r in rows], "o-", color="tab:green")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    fig.suptitle(f"{record['lesson']}: {record['world_size']} process(es), {record['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def requeue_slurm_job() -> str:
    """Ask Slurm to put this job back in the queue (it restarts with the same job id)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or not shutil.which("scontrol"):
        return "not a Slurm job: restart it yourself with --resume auto"
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if result.returncode != 0:
        return f"scontrol requeue {job} failed: {result.stderr.strip()} (is the job submitted with --requeue?)"
    return f"requeued Slurm job {job}"
