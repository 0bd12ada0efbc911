"""Every rank's random state and the sums of its epoch in progress, gathered for a checkpoint and given back on resume.

A restarted run then draws the same random numbers (dropout, shuffles) and finishes the interrupted epoch's mean.
"""
import io
import json

import torch
import torch.distributed as dist

from common.distributed import get_rank, get_world_size


def all_gather_states(partial: dict) -> bytes:
    """A collective (all_gather_object): every rank's random state and `partial` sums travel to every rank (rank 0
    saves them all). One opaque value: its length depends on the number of ranks."""
    mine = {"torch": torch.get_rng_state(), "partial": json.dumps(partial)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["cuda"] = torch.cuda.get_rng_state()
    states = [mine]
    if dist.is_initialized():
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, mine)
    buffer = io.BytesIO()
    torch.save(states, buffer)
    return buffer.getvalue()


def restore_states(saved: bytes) -> dict:
    """This rank's random state back, and the sums it goes on with; with another number of ranks exact replay is
    impossible: the random state stays, rank 0 carries the sums of every old rank."""
    states = torch.load(io.BytesIO(saved), weights_only=True)
    partials = [json.loads(s["partial"]) for s in states]
    if len(states) == get_world_size():
        torch.set_rng_state(states[get_rank()]["torch"].cpu())
        if "cuda" in states[get_rank()] and torch.cuda.is_available():
            torch.cuda.set_rng_state(states[get_rank()]["cuda"].cpu())
        return partials[get_rank()]
    if get_rank() == 0 and any(partials):
        return {"loss_sum": sum(p.get("loss_sum", 0.0) for p in partials),
                "count": sum(p.get("count", 0) for p in partials),
                "seconds": max(p.get("seconds", 0.0) for p in partials)}
    return {}
