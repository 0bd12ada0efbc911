"""Lesson 06, exercise 2: what breaks when TP peers disagree, and a gradient norm that counts pieces twice.

    python 06_tensor_parallel/solutions/peers_must_agree.py

Two gloo processes (common.launcher) as a 1 x 2 mesh, the lesson's TPNet (--blocks 2, hidden 16), dropout off.
1. Each rank feeds its OWN batch (what a sampler by global rank does): the all-reduce in each block adds the
   partial sums of two different batches, so the output equals the plain model's on neither batch.
2. With the same batch, the gradient norm from every rank's local squares, summed over the ranks, counts twice
   every piece both ranks hold (the FSDP2-only units, and down.bias, which RowwiseParallel replicates);
   the trainer's clip_grad_norm (trainer/tp.py, behind --clip-grad) divides each by copies() and equals the plain
   model's norm.
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.launcher import launch  # noqa: E402

import tp_workers  # noqa: E402
from trainer.tp import clip_grad_norm, copies  # noqa: E402


def probe() -> dict:
    mesh = tp_workers.start(2)
    model, plain = tp_workers.build(mesh, blocks=2, hidden=16)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 1, 28, 28, generator=g) for _ in range(2)]
    labels = torch.randint(0, 10, (4,), generator=g)
    with torch.no_grad():
        mixed = model(batches[dist.get_rank()])  # each TP rank its own batch: wrong
        wrong = [(mixed - plain(b)).abs().max().item() for b in batches]
        right = (model(batches[0]) - plain(batches[0])).abs().max().item()  # the same batch on both: right
    F.nll_loss(model(batches[0]), labels).backward()
    F.nll_loss(plain(batches[0]), labels).backward()
    naive = sum(p.grad.to_local().square().sum() for p in model.parameters())
    dist.all_reduce(naive)
    twice = [name for name, p in model.named_parameters() if copies(p.grad) > 1]
    return {"wrong": wrong, "right": right, "naive": naive.sqrt().item(), "twice": twice,
            "trainer": clip_grad_norm(model.parameters(), 1e9).item(),
            "plain": torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()]).item()}


def main():
    r = launch(probe, nprocs=2, timeout_s=240)[0]
    print(f"different batches on the TP peers: output differs from the plain model's by {r['wrong'][0]:.3f} "
          f"(batch 0) and {r['wrong'][1]:.3f} (batch 1); the same batch: {r['right']:.1e}")
    print(f"gradient norm: plain model {r['plain']:.4f}, trainer's clip_grad_norm {r['trainer']:.4f}, "
          f"local squares summed over ranks {r['naive']:.4f} ({r['naive'] / r['plain']:.2f}x)")
    print(f"held whole by both TP ranks, so counted twice: {', '.join(r['twice'])}")


if __name__ == "__main__":
    main()
