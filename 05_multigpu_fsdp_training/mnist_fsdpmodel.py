r"""Lesson 05: FSDP2 (fully_shard): each process keeps only a 1/N shard of weights, gradients and optimizer state.

A unit's weights are all-gathered for its forward and backward, then freed; its gradients are reduce-scattered:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 05_multigpu_fsdp_training/mnist_fsdpmodel.py \
        --data synthetic --train-samples 2000 --test-samples 1000 --epochs 2 --num-workers 0 --output-dir runs/05-first
Checkpoints are DCP folders, each rank writing its own shards. A long run's extras: trainer/README.md.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, DistributedSampler

from common.cli import lesson_parser
from common.data import load_mnist
from common.distributed import launch_env, pick_device
from common.epoch_checkpoints import EpochCheckpoints
from common.exits import run
from common.model import Net
from common.samplers import EvalSampler

LESSON = "05"


def main(argv=None):
    args = lesson_parser(LESSON, "Lesson 05: MNIST with FSDP2 and DCP checkpoints").parse_args(argv)
    checkpoints = EpochCheckpoints(args.output_dir, LESSON, sharded=True, flags=args)  # DCP folders
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

    model = Net().to(device)  # the same seed on every rank: the same weights, before each rank keeps its shard
    mesh = dist.init_device_mesh(device.type, (world_size,))  # 1-D: shard over all ranks
    for unit in [model.features, model.fc1, model.fc2, model]:  # the units, then the root (the rest)
        fully_shard(unit, mesh=mesh)  # a unit is all-gathered for its forward and backward, then freed again
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)  # lr x 0.7 after every epoch
    start = 1
    if resume:  # --resume auto: the newest checkpoint; the run continues with the epoch after it
        model_state, optimizer_state = get_state_dict(model, optimizer)  # this rank's shards, to be filled
        checkpoint = {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "epoch": 0}
        dcp.load(checkpoint, checkpoint_id=resume)  # a collective: in place, each rank reads the pieces of its shards
        set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optimizer"])
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
        model_state, optimizer_state = get_state_dict(model, optimizer)  # this rank's shards, as DTensors: no copies
        state = {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "epoch": epoch}
        if rank == 0:
            print(f"epoch {epoch}: test loss {loss:.4f}, accuracy {correct:.0f}/{count:.0f}, train {seconds:.1f} s")
        with checkpoints.writing(epoch) as path:  # a temporary name, renamed once complete
            dcp.save(state, checkpoint_id=path)  # a collective: every rank writes its own shards, rank 0 the index
    dist.destroy_process_group()


def train(model, device, train_loader, optimizer):
    model.train()
    for data, target in train_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)  # a collective: FSDP all-gathers each unit for its forward
        loss.backward()  # FSDP all-gathers each unit again, then reduce-scatters (averages) its gradients
        optimizer.step()


@torch.no_grad()
def test(model, device, test_loader):
    """The test set's mean loss, and how many images were right out of how many."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for data, target in test_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(data)  # a collective: FSDP all-gathers each unit's weights
        loss_sum += F.nll_loss(output, target, reduction="sum").item()  # a SUM: the mean is exact
        correct += (output.argmax(dim=1) == target).sum().item()
        count += len(data)
    for _ in range(test_loader.sampler.most_batches(test_loader.batch_size) - len(test_loader)):
        model(torch.zeros(1, 1, 28, 28, device=device))  # a rank with fewer test batches joins the all-gathers
    totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64, device=device)
    dist.all_reduce(totals)  # a collective: every rank's sums added up, on every rank
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct, count


if __name__ == "__main__":
    run(main)
