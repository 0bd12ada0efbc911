"""will_it_fit.py's verdict on GPUs, at the margin: the llm_fit suite, and the batch that fills a GPU.

For each case (fsdp2, fsdp2-ac and ddp on the 1.1 B shape, fsdp2 on a 152k vocabulary) one uncapped run measures the
allowance's parts: peak allocated (the tensors), peak reserved (the caching allocator's share on top), and the context
(CUDA, cuBLAS, NCCL: the device's used memory less the reserved). Then, on one GPU, two capped runs
(torch.cuda.set_per_process_memory_fraction): at the estimate's "fits" total less the measured context (it must
train), and at 90% of the "tight" line less the context (it must run out of memory: below the tight line nothing
trains). On several GPUs the uncapped runs only: a rank that ran out of memory alone would leave the others waiting.
"""
from __future__ import annotations

import functools
import math
import sys

from benchmarks.launch import ROOT
from benchmarks.llm import QUICK_SEQ, SEQ, Setup, config, train

sys.path.insert(0, str(ROOT / "08_your_model"))
import will_it_fit  # noqa: E402

CASES = (("fsdp2", "1.1B", 4), ("fsdp2-ac", "1.1B", 8), ("ddp", "1.1B", 4), ("fsdp2", "152k", 4))
QUICK_BATCH = 2
MOST_BATCH = 64


@functools.cache
def counted(shape: str, quick: bool) -> tuple:
    """(config, will_it_fit.count's shapes and buffers): once per shape (a count builds the model on meta)."""
    cfg = config(shape, quick)
    return cfg, will_it_fit.count(cfg)


def lines(shape: str, quick: bool, strategy: str, gpus: int, batch: int) -> dict:
    """will_it_fit.price's bytes per GPU: the tensors ("estimate"), the "fits" line and the "tight" line."""
    cfg, done = counted(shape, quick)
    price = will_it_fit.price(cfg, strategy, gpus, batch, QUICK_SEQ if quick else SEQ, counted=done)
    return {"estimate": price.tensors, "fits_line": price.fits_line, "tight_line": price.tight_line,
            "moment": price.moment}


def verdict(est: dict, memory: float) -> str:
    return will_it_fit.verdict(est["fits_line"], est["tight_line"], memory)


def cap_bytes(line: float, share: float, context: float) -> int:
    """The allocator's cap of a run at `share` of a line, less the context: rounded up, so that the context plus the
    cap at 100% of the "fits" line is that line (will_it_fit.verdict: fits), not a byte under it (tight)."""
    return math.ceil(share * line - context)


def fill_batch(shape: str, gpus: int, memory: float, quick: bool) -> int:
    """The largest batch per GPU (up to 64) whose estimate fits `memory` bytes: the batch that fills the GPU."""
    if quick:
        return QUICK_BATCH
    fitting = [b for b in range(1, MOST_BATCH + 1) if lines(shape, False, "fsdp2", gpus, b)["fits_line"] <= memory]
    return max(fitting, default=1)


def fit(L, mesh) -> None:
    cuda, said = L.device.type == "cuda", False
    for strategy, shape, batch in CASES:
        batch = QUICK_BATCH if L.quick else batch
        est = lines(shape, L.quick, strategy, L.world, batch)
        setup = Setup(shape, batch, strategy=strategy, warmup=1, steps=2)
        free = train(setup, L, mesh)
        L.emit("llm_fit", program=shape, variant=f"{strategy} uncapped", **est, **free,
               verdict=verdict(est, free["total_memory"]) if "total_memory" in free else None)
        why = "no GPU" if not cuda else f"{L.world} GPUs: one GPU only" if L.world > 1 else \
            None if free["outcome"] == "trained" else "the uncapped run did not train"
        if why:
            if L.rank == 0 and not said:
                print(f"llm_fit: capped runs skipped ({why})", flush=True)
            said = True
            continue
        for line, share in (("fits", 1.0), ("tight", 0.9)):
            cap = cap_bytes(est[f"{line}_line"], share, free["context"])
            row = train(setup, L, mesh, cap_bytes=cap)
            L.emit("llm_fit", program=shape, variant=f"{strategy} capped at {share:.0%} of {line}", cap_bytes=cap,
                   verdict=verdict(est, cap + free["context"]), measured_context=free["context"], **est, **row)
