"""A warm-up that keeps one-off costs (kernel loading, cuDNN autotuning, allocator growth) out of the timed epochs."""
import copy
import time

import torch
import torch.nn.functional as F


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a sharded DTensor (FSDP2), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def warm_up(model, optimizer, train_loader, device: torch.device, args, amp_dtype=None, steps: int = 2) -> float:
    """A few real training steps on random images, then weights, optimizer state and random streams restored exactly;
    returns their seconds (the caller reports them). They pay CUDA's kernel loading, cuDNN's autotuning for each
    batch shape (the epoch's last, smaller batch is a second one), the allocator's growth, NCCL's first connection."""
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
                    output = model(images)  # a collective under FSDP2: its units' all-gathers
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
