"""The training recipe as flags: optimizer, learning-rate scaling with the number of processes, schedule.

N processes x G accumulation steps take N x G times fewer steps per epoch: the linear scaling rule (Goyal et al.,
2017) multiplies the lr by N x G, with a warm-up because a large lr at the start diverges; "sqrt" is the gentler
rule often used with Adam-type optimizers. The schedule steps once per OPTIMIZER STEP.
"""
import torch
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR

from common.errors import CourseError

DEFAULT_LR = {"adadelta": 1.0, "adamw": 1e-3, "sgd": 0.05}


def scaled_lr(args, world_size: int = 1) -> float:
    """--lr (or the optimizer's default) times the --lr-scaling factor of processes x accumulation steps."""
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    factor = world_size * getattr(args, "grad_accum", 1)
    return lr * {"none": 1.0, "linear": factor, "sqrt": factor ** 0.5}[args.lr_scaling]


def make_optimizer(args, params, world_size: int = 1) -> torch.optim.Optimizer:
    params, lr = list(params), scaled_lr(args, world_size)
    fused = params[0].is_cuda  # on GPUs: one kernel updates every parameter (Adadelta has no fused version)
    if args.optimizer == "adadelta":
        return torch.optim.Adadelta(params, lr=lr)  # the classic MNIST example's choice
    if args.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=fused)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, fused=fused)


def make_scheduler(args, optimizer, steps_per_epoch: int):
    """Per step: "step" decays by --gamma every epoch after --warmup-steps' linear ramp; "onecycle" rises (over
    --warmup-steps, else a quarter of the run) then anneals."""
    total = args.epochs * steps_per_epoch
    if args.schedule == "onecycle":
        if total < 4:
            raise CourseError(f"--schedule onecycle over {total} optimizer steps: it needs at least 4 (more "
                              f"--epochs or --train-samples, a smaller --batch-size), or --schedule step")
        rise = args.warmup_steps / total if args.warmup_steps else 0.25
        return OneCycleLR(optimizer, max_lr=[g["lr"] for g in optimizer.param_groups], total_steps=total,
                          pct_start=min(max(rise, 2 / total), 0.99),  # its rise must span 2 steps or more
                          cycle_momentum=args.optimizer == "sgd")  # Adam's beta1 stays 0.9 (Adadelta has none)
    warmup = max(args.warmup_steps, 0)

    def factor(step: int) -> float:  # step = optimizer steps taken so far
        ramp = min(1.0, (step + 1) / warmup) if warmup else 1.0
        return ramp * args.gamma ** (step // steps_per_epoch)
    return LambdaLR(optimizer, factor)
