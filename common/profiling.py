"""Where the time goes: torch.profiler around a few steps, and a warm-up that keeps one-off costs out of the clock."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile


@contextmanager
def profile_steps(device: torch.device, rows: int = 12):
    """Profile the enclosed steps, then print the top operators and the share spent waiting for data."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities, acc_events=True) as prof:
        yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(events.table(sort_by=sort_by, row_limit=rows), flush=True)
    # The DataLoader's __next__ is recorded as "enumerate(DataLoader)#...": time the loop waited for a batch.
    data_s = sum(e.cpu_time_total for e in events if e.key.startswith("enumerate(DataLoader)")) / 1e6
    print(f"profile: {wall:.2f} s in the profiled steps, {data_s:.2f} s ({100 * data_s / wall:.0f}%) "
          f"waiting for the DataLoader, the rest in forward/backward/optimizer", flush=True)


def warm_up(model, device: torch.device, args, steps: int = 3) -> float:
    """A few forward/backward passes on random images of the training batch shape; returns their seconds.

    The first steps of a fresh process pay one-off costs: cuDNN tries its convolution algorithms,
    the caching allocator grows, NCCL connects on its first all_reduce (under DDP), torch.compile
    compiles. Paying them here keeps them out of the timed epochs; the result is reported, not hidden.
    Eval mode (no dropout, BatchNorm statistics untouched) and no optimizer step: the weights and the
    random-number streams are exactly as before, so results do not change.
    """
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 1, 28, 28, generator=generator).to(device)
    for _ in range(steps):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            output = model(images)
        output.float().sum().backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
