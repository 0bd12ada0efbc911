"""Lesson 08's learning-rate schedule and gradient clipping, for fine-tuning.

--warmup-steps N: the learning rate climbs linearly from lr/N to lr over the first N optimizer steps; --min-lr:
after the warm-up it falls along a cosine to min-lr at the run's last step. Steps are counted per rank (every rank
takes the same steps): the loader's steps per epoch x --epochs. The LambdaLR's state is saved in the DCP checkpoint,
so a resumed run goes on where the schedule was. Neither flag: no scheduler, the constant --lr.
--clip-grad MAX: torch.nn.utils.clip_grad_norm_ on FSDP2's sharded gradients. Each gradient is a DTensor holding
this rank's shard; torch._foreach_norm of a shard gives a DTensor whose value is a Partial norm, the total norm
stacks them and `.full_tensor()` reduces it over the ranks: the norm of ALL shards, the one a single process would
compute on the whole gradients (tests/test_finetune_text.py checks that on 2 and 4 ranks).
"""
import math

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from common.errors import CourseError


def lr_factor(step: int, warmup: int, total: int, floor: float) -> float:
    """The multiple of --lr at optimizer step `step` (0-based): warm-up, then a cosine from 1 to `floor`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(optimizer, args, total_steps: int) -> LambdaLR | None:
    """None for a constant --lr (neither --warmup-steps nor --min-lr); total_steps: this rank's for the whole run."""
    if not args.warmup_steps and args.min_lr is None:
        return None
    if args.warmup_steps > total_steps:
        raise CourseError(f"--warmup-steps {args.warmup_steps} is more than the run's {total_steps} steps per rank: "
                          f"at most {total_steps} (or more --epochs)")
    floor = 1.0 if args.min_lr is None else args.min_lr / args.lr  # no --min-lr: the warm-up, then a constant lr
    return LambdaLR(optimizer, lambda step: lr_factor(step, args.warmup_steps, total_steps, floor))


def check_schedule_args(args) -> None:
    if args.min_lr is not None and args.min_lr > args.lr:
        raise CourseError(f"--min-lr {args.min_lr} is above --lr {args.lr}: the cosine decays to it, pick a lower one")


def clip_gradients(model, max_norm: float) -> float:
    """Scales every gradient by min(1, max_norm / total norm); returns the total norm over all ranks' shards."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
