r"""Lesson 06: tensor parallelism (TP) inside groups of --tp processes, FSDP2 across the groups: a 2-D mesh.

The model gets --blocks MLPs, Megatron pairs: `up` is cut by output columns, `down` by input rows, so each rank of a
TP group computes a slice of every block, and one all-reduce per block joins the slices. The ranks of a TP group
read the SAME batch; the groups split the data and shard the weights with fully_shard, as in lesson 05.
From the course folder:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 06_tensor_parallel/mnist_tpmodel.py --tp 2 \
        --data synthetic --train-samples 2000 --test-samples 1000 --epochs 2 --num-workers 0 --output-dir runs/06-first
A long run's extras (exact resume, signals, AMP, compile, metrics.json): trainer/README.md.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, DistributedSampler

from common.cli import lesson_parser
from common.data import load_mnist
from common.distributed import launch_env, pick_device
from common.epoch_checkpoints import EpochCheckpoints
from common.exits import run
from common.model import Net
from common.samplers import EvalSampler

LESSON = "06"


def main(argv=None):
    parser = lesson_parser(LESSON, "Lesson 06: MNIST with tensor parallelism inside FSDP2 (a 2-D mesh)")
    parser.add_argument("--tp", type=parser.positive_int, default=2,
                        help="processes per TP group; the rest is FSDP2 (default: 2)")
    parser.add_argument("--blocks", type=parser.count, default=2, help="MLP blocks, the layers TP cuts (default: 2)")
    parser.add_argument("--hidden", type=parser.positive_int, default=128, help="width of fc1 and blocks (default: 128)")
    args = parser.parse_args(argv)
    if 4 * args.hidden % args.tp:  # ColwiseParallel cuts evenly
        parser.error(f"--tp {args.tp} does not divide a block's 4 x hidden = {4 * args.hidden} features: pick a divisor")
    checkpoints = EpochCheckpoints(args.output_dir, LESSON, sharded=True, flags=args)  # DCP folders
    resume = checkpoints.resume_from(args.resume)  # first, before anything slow: a used --output-dir is refused

    env = launch_env()  # RANK, LOCAL_RANK, WORLD_SIZE from torchrun, or from srun's SLURM_* variables
    if env.world_size % args.tp:  # the mesh is a full grid; plain python is ONE process
        parser.error(f"--tp {args.tp} does not divide the {env.world_size} process(es): pick a divisor, or start a "
                     f"multiple of {args.tp} processes (torchrun --nproc_per_node={args.tp})")
    device = pick_device(args.device, env)  # cuda:LOCAL_RANK: the GPU is chosen by the rank WITHIN the node
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process uses this GPU, and only this one
    dist.init_process_group(backend=dist.get_default_backend_for_device(device),  # nccl for cuda, gloo for cpu
                            device_id=device if device.type == "cuda" else None)  # meet at MASTER_ADDR:MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # on every rank: the same initial weights and dropout masks

    train_ds, _, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples,
                                      is_main=rank == 0, barrier=dist.barrier)  # rank 0 downloads, the rest wait
    # The mesh: rows are data-parallel replicas, columns the ranks of a TP group (neighbours: inside a node).
    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp, dp_rank = mesh.size(0), mesh.get_local_rank("dp")
    # Shard by DATA-PARALLEL rank: the ranks of a TP group must see the same batch, each computing a slice of it.
    train_sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=args.seed)
    loader_options = {"num_workers": args.num_workers, "pin_memory": device.type == "cuda"}
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, **loader_options)
    # Each test image on exactly one TP group (its ranks see the same images): test() sums over the dp groups.
    test_sampler = EvalSampler(test_ds, num_replicas=dp, rank=dp_rank)
    test_loader = DataLoader(test_ds, batch_size=args.test_batch_size, sampler=test_sampler, **loader_options)

    model = TPNet(args.blocks, args.hidden).to(device)  # the same seed on every rank: the same weights
    for block in model.blocks:  # a collective: the TP group's first rank scatters the pieces (src_data_rank 0)
        parallelize_module(block, mesh["tp"], TP_PLAN)  # the block's weights become DTensors cut over "tp"
    for unit in [model.features, model.fc1, *model.blocks, model.fc2, model]:  # the units, then the root (the rest)
        fully_shard(unit, mesh=mesh["dp"])  # cut again over "dp": a block's weight in dp x tp pieces
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
    print(f"rank {rank} of {world_size} on {device}, mesh (dp {dp_rank}, tp {mesh.get_local_rank('tp')}) of "
          f"({dp}, {args.tp}), {len(train_sampler)} of {len(train_ds)} training images")

    for epoch in range(start, args.epochs + 1):
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        began = time.perf_counter()
        train(model, device, train_loader, optimizer)
        seconds = time.perf_counter() - began
        loss, correct, count = test(model, device, test_loader, mesh["dp"].get_group())
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
        loss = F.nll_loss(model(data), target)
        # FSDP all-gathers each unit again, then reduce-scatters (averages) its gradients over "dp"; in each block
        # the gradient of up's input is partial over "tp": all-reduced, as down's output was in forward
        loss.backward()
        optimizer.step()


@torch.no_grad()
def test(model, device, test_loader, dp_group):
    """The test set's mean loss, and how many images were right out of how many."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for data, target in test_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(data)  # in each block, down's partial sums are all-reduced over "tp"
        loss_sum += F.nll_loss(output, target, reduction="sum").item()  # a SUM: the mean is exact
        correct += (output.argmax(dim=1) == target).sum().item()
        count += len(data)
    for _ in range(test_loader.sampler.most_batches(test_loader.batch_size) - len(test_loader)):
        model(torch.zeros(1, 1, 28, 28, device=device))  # a group with fewer test batches joins the all-gathers
    totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64, device=device)
    dist.all_reduce(totals, group=dp_group)  # one rank per TP group (its peers counted the same images): exact
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct, count


class MLP(nn.Module):
    """x + down(relu(up(x))): a Megatron pair, hidden -> 4 x hidden -> hidden, as in a transformer's MLP."""

    def __init__(self, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(x)))


class TPNet(Net):
    """Lesson 05's Net (fc2 after fc1 and its blocks) with MLPs as its blocks: the parameter-heavy part."""

    def __init__(self, blocks: int = 0, hidden: int = 128):
        super().__init__(hidden=hidden)
        self.blocks = nn.ModuleList(MLP(hidden) for _ in range(blocks))  # drawn after Net's: blocks 0 is Net


TP_PLAN = {"up": ColwiseParallel(),  # weight cut by output features: each rank computes its slice of up(x)
           "down": RowwiseParallel()}  # cut by input features: partial sums, all-reduced into the block's output

if __name__ == "__main__":
    run(main)
