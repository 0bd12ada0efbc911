"""Where the time goes: torch.profiler around a few steps, and a warm-up that keeps one-off costs out of the clock."""
from __future__ import annotations

import copy
import os
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile


@contextmanager
def profile_steps(device: torch.device, rows: int = 12):
    """Profile the enclosed steps, then print the top operators, two totals, and the share spent waiting for data."""
    # Without this, the profiler's engine prints its start/stop lines (and, on a CUDA build of torch without a GPU,
    # a harmless "gpuGetDeviceCount failed"). Set before the profiler starts, it works even after `import torch`.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, acc_events=True) as prof:
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the GPU work these steps queued belongs to them
        wall = time.perf_counter() - start  # the steps only: starting, stopping and sorting the events excluded
    events = prof.key_averages()
    sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(events.table(sort_by=sort_by, row_limit=rows), flush=True)
    # The table's "Self CPU time total" sums every operator's self time (its own, minus the operators it calls),
    # over all operators, not only the rows shown: time inside recorded operators, never the Python between them.
    self_s = events.self_cpu_time_total / 1e6
    # The DataLoader's __next__ is recorded as "enumerate(DataLoader)#...": time the loop waited for a batch.
    data_s = sum(e.cpu_time_total for e in events if e.key.startswith("enumerate(DataLoader)")) / 1e6
    print(f"profile: the profiled steps took {wall:.2f} s of wall-clock time, the profiler's recording included; "
          f"{self_s:.2f} s were spent inside operators (the table's \"Self CPU time total\")", flush=True)
    print(f"profile: {data_s:.2f} s ({100 * data_s / wall:.0f}% of the wall-clock time) waiting for the DataLoader, "
          f"the rest in forward/backward/optimizer", flush=True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a sharded DTensor (FSDP2), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def warm_up(model, optimizer, train_loader, device: torch.device, args, amp_dtype=None, steps: int = 2) -> float:
    """A few real training steps on random images, then everything put back; returns their seconds.

    The first steps of a fresh process pay one-off costs: CUDA loads each kernel on its first use,
    cuDNN times its convolution algorithms for every new input shape (the last, smaller batch of an
    epoch is a second shape), the caching allocator grows, the optimizer creates its state, NCCL
    connects on its first all_reduce. Paying them here keeps them out of the timed epochs; the
    caller reports the seconds, they are not hidden. Weights, optimizer state and random-number
    streams are restored exactly, so the results of the run do not change.
    """
    start = time.perf_counter()
    # The weights wait on the CPU (this rank's shard of each, under FSDP): a GPU copy would add 4 bytes per
    # parameter to the peak memory, the very number lessons 04 and 05 compare.
    weights = {k: _local(v).detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    last = len(train_loader.sampler) % args.batch_size  # the epoch's last batch is smaller: another shape
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
        model.train()
        for size in {args.batch_size, last or args.batch_size}:
            for _ in range(steps):
                images = torch.randn(size, 1, 28, 28, generator=generator).to(device)
                labels = torch.randint(0, 10, (size,), generator=generator).to(device)
                # --amp: the run's autocast dtype. No GradScaler: float16 gradients that overflow here are undone too.
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    output = model(images)
                F.nll_loss(output.float(), labels).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for k, v in model.state_dict().items():  # the model's own tensors: copied back in place
            _local(v).copy_(weights[k])
    optimizer.load_state_dict(optimizer_state)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
