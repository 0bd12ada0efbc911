"""Where the time goes: torch.profiler around a few steps, and a warm-up that keeps one-off costs out of the clock."""
from __future__ import annotations

import copy
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a sharded DTensor (FSDP2), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def warm_up(model, optimizer, train_loader, device: torch.device, args, steps: int = 2) -> float:
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
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
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
