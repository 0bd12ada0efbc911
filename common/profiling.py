"""Where does a training step spend its time? torch.profiler around a few steps, summarised for humans."""
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
