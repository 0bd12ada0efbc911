"""Metrics across ranks: every rank sums loss, correct and count, one all_reduce adds the sums, then divide once.

Why SUM and divide, not ReduceOp.AVG: 01_setup/reference.md#why-sum-and-divide-not-reduceopavg.
"""
import time

import torch
import torch.distributed as dist


def all_reduce_sum(values, device: torch.device | str = "cpu") -> list[float]:
    """Sum a list of numbers over all ranks (float64, so counts stay exact)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_initialized():  # in a single process the same code runs, without the all_reduce
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(value: float, device: torch.device | str = "cpu") -> float:
    """The largest value over all ranks, e.g. the slowest rank's epoch time."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


class EpochMeter:
    """Loss sum, correct predictions and count of one epoch, kept on the device so update() never forces a GPU sync.
    loss_sum, count, seconds: what an interrupted epoch had measured before the restart."""

    def __init__(self, device: torch.device | str = "cpu", loss_sum: float = 0.0, count: int = 0,
                 seconds: float = 0.0):
        self.device = torch.device(device)
        self.resumed_loss_sum = loss_sum
        # One tensor per batch, added up when asked: update() launches no GPU kernel. On a fast GPU the training
        # step waits for the CPU, and each small kernel launched costs it about 10 us (an H100 host, no profiler).
        self.loss_sums = []
        self.correct = torch.zeros((), dtype=torch.int64, device=self.device)
        self.count = count
        self.start = time.perf_counter() - seconds
        self.seconds = None  # set by stop_clock(); until then all_reduce() measures up to its own call

    @property
    def loss_sum(self) -> torch.Tensor:
        """The sum so far, in float64 (exact enough for 60,000 per-example losses)."""
        total = torch.tensor(self.resumed_loss_sum, dtype=torch.float64, device=self.device)
        return total + torch.stack(self.loss_sums).double().sum() if self.loss_sums else total

    def update(self, loss_sum: torch.Tensor, correct: torch.Tensor | int, count: int) -> None:
        """loss_sum: the SUM of per-example losses of a batch (not the mean)."""
        self.loss_sums.append(loss_sum.detach())
        if not isinstance(correct, int) or correct:  # training passes 0: skip a pointless GPU kernel
            self.correct += correct
        self.count += count

    def partial(self) -> dict:
        """This rank's sums so far, for a checkpoint in the middle of an epoch (waits for the GPU)."""
        return {"loss_sum": self.loss_sum.item(), "count": self.count, "seconds": time.perf_counter() - self.start}

    def stop_clock(self) -> None:
        """End the timed part here (e.g. before evaluation); waits for the GPU so the time is real."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self.start

    def all_reduce(self) -> dict:
        """Global loss, accuracy, count and images/s over all ranks: a collective, every rank must call it."""
        if self.seconds is None:
            self.stop_clock()
        seconds = all_reduce_max(self.seconds, self.device)  # the slowest rank sets the pace
        loss_sum, correct, count = all_reduce_sum(
            [self.loss_sum.item(), self.correct.item(), self.count], self.device)
        count = int(count)
        return {
            "loss": loss_sum / max(count, 1),
            "accuracy": correct / max(count, 1),
            "correct": int(correct),
            "count": count,
            "seconds": seconds,
            "images_per_second": count / seconds if seconds > 0 else 0.0,
        }
