r"""Lesson 04: DistributedDataParallel (DDP), one process per GPU (or per CPU slot), any number of nodes.

Every process holds a full replica and trains on its own shard of the data; in backward DDP all_reduces (averages)
the gradients, so every replica takes the same optimizer step. From the course folder:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 04_ddp_training/mnist_ddpmodel.py --data synthetic \
        --train-samples 2000 --test-samples 1000 --epochs 2 --num-workers 0 --output-dir runs/04-first
A long run's extras (exact resume, signals, AMP, compile, metrics.json): trainer/README.md.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, DistributedSampler

from common.cli import lesson_parser
from common.data import load_mnist
from common.distributed import launch_env, pick_device
from common.epoch_checkpoints import EpochCheckpoints
from common.exits import run
from common.model import Net
from common.samplers import EvalSampler

LESSON = "04"


def main(argv=None):
    args = lesson_parser(LESSON, "Lesson 04: MNIST with DistributedDataParallel (torchrun or srun)").parse_args(argv)
    checkpoints = EpochCheckpoints(args.output_dir, LESSON, flags=args)
    resume = checkpoints.resume_from(args.resume)  # first, before anything slow: a used --output-dir is refused

    env = launch_env()  # RANK, LOCAL_RANK, WORLD_SIZE from torchrun, or from srun's SLURM_* variables
    device = pick_device(args.device, env)  # cuda:LOCAL_RANK: the GPU is chosen by the rank WITHIN the node
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process uses this GPU, and only this one
    dist.init_process_group(backend=dist.get_default_backend_for_device(device),  # nccl for cuda, gloo for cpu
                            device_id=device if device.type == "cuda" else None)  # meet at MASTER_ADDR:MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    train_ds, _, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples,
                                      is_main=rank == 0, barrier=dist.barrier)  # rank 0 downloads, the rest wait
    # Shard by GLOBAL rank: with the local rank, every node would train on the same shard.
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader_options = {"num_workers": args.num_workers, "pin_memory": device.type == "cuda"}
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, **loader_options)
    # Each test image on exactly one rank (DistributedSampler would pad with duplicates): test() sums over ranks.
    test_loader = DataLoader(test_ds, batch_size=args.test_batch_size, sampler=EvalSampler(test_ds), **loader_options)

    model = Net().to(device)
    # DDP broadcasts rank 0's weights at construction, then all_reduces (averages) the gradients in backward.
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)  # lr x 0.7 after every epoch
    start = 1
    if resume:  # --resume auto: the newest checkpoint; the run continues with the epoch after it
        checkpoint = torch.load(resume, map_location=device, weights_only=True)  # onto `device`; tensors, no code
        model.module.load_state_dict(checkpoint["model"])  # .module: the Net inside
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start = checkpoint["epoch"] + 1
        print(f"resumed from {resume}")
    print(f"rank {rank} of {world_size} on {device}, {len(train_sampler)} of {len(train_ds)} training images")

    for epoch in range(start, args.epochs + 1):
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        began = time.perf_counter()
        train(model, device, train_loader, optimizer)
        seconds = time.perf_counter() - began
        loss, correct, count = test(model, device, test_loader)
        scheduler.step()
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "epoch": epoch}
        if rank == 0:  # the replicas are identical: rank 0 reports and saves
            print(f"epoch {epoch}: test loss {loss:.4f}, accuracy {correct:.0f}/{count:.0f}, train {seconds:.1f} s")
            with checkpoints.writing(epoch) as path:  # a temporary name, renamed once complete
                torch.save(state, path)
    dist.destroy_process_group()


def train(model, device, train_loader, optimizer):
    model.train()
    for data, target in train_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()  # DDP all_reduces (averages) the gradients here, bucket by bucket
        optimizer.step()


@torch.no_grad()
def test(model, device, test_loader):
    """The test set's mean loss, and how many images were right out of how many."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for data, target in test_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(data)
        loss_sum += F.nll_loss(output, target, reduction="sum").item()  # a SUM: the mean is exact
        correct += (output.argmax(dim=1) == target).sum().item()
        count += len(data)
    totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64, device=device)
    dist.all_reduce(totals)  # a collective: every rank's sums added up, on every rank
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct, count


if __name__ == "__main__":
    run(main)
