r"""Lesson 07: pipeline parallelism (PP), stages on the ranks of a pipeline, FSDP2 across --dp pipelines (torch 2.10+).

A stage sends its activations to the next one and gets their gradients back (point-to-point send and recv); the
schedule (--pp-schedule) orders the --microbatches' forwards and backwards; ranks idle while the pipeline fills.
From the course folder:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 07_pipeline_parallel/mnist_ppmodel.py \
        --data synthetic --train-samples 2000 --test-samples 1000 --epochs 2 --num-workers 0 --output-dir runs/07-first
A long run's extras (exact resume, signals, AMP, compile, metrics.json): trainer/README.md.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install
sys.path.insert(1, str(Path(__file__).resolve().parent))  # this folder: stages.py, torch_floor.py

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, DistributedSampler

from common.cli import lesson_parser
from common.data import load_mnist
from common.distributed import launch_env, pick_device
from common.epoch_checkpoints import EpochCheckpoints
from common.exits import run
from common.model import Net
from common.samplers import EvalSampler
from stages import Stage, stage_blocks
from torch_floor import require_torch_2_10

LESSON = "07"


def main(argv=None):
    parser = lesson_parser(LESSON, "Lesson 07: MNIST with pipeline parallelism (x FSDP2: a 2-D mesh)")
    parser.add_argument("--dp", type=parser.positive_int, default=1,
                        help="pipelines (FSDP2 across them): stages = processes / dp (default: 1)")
    parser.add_argument("--pp-schedule", choices=["gpipe", "1f1b"], default="1f1b", help="gpipe: all forwards, then "
                        "all backwards; 1f1b: a backward as soon as it can run, fewer activations (default: 1f1b)")
    parser.add_argument("--microbatches", type=parser.positive_int, default=4, help="how many per batch (default: 4)")
    parser.add_argument("--blocks", type=parser.count, default=4, help="MLP blocks, what the stages split (default: 4)")
    parser.add_argument("--hidden", type=parser.positive_int, default=128, help="width of fc1 and blocks (default: 128)")
    args = parser.parse_args(argv)
    if args.batch_size % args.microbatches or args.test_batch_size % args.microbatches:  # equal micro-batches
        parser.error(f"--microbatches {args.microbatches} must divide --batch-size and --test-batch-size")
    require_torch_2_10()  # torch 2.9's pipeline stages fail over gloo (torch_floor.py)
    checkpoints = EpochCheckpoints(args.output_dir, LESSON, sharded=True, flags=args)  # DCP folders
    resume = checkpoints.resume_from(args.resume)  # first, before anything slow: a used --output-dir is refused

    env = launch_env()  # RANK, LOCAL_RANK, WORLD_SIZE from torchrun, or from srun's SLURM_* variables
    pp = env.world_size // args.dp  # the stages of a pipeline
    if env.world_size % args.dp or pp < 2:  # plain python is ONE process: no pipeline
        parser.error(f"--dp {args.dp} on {env.world_size} process(es) leaves no pipeline of 2 stages or more: "
                     f"start 2 x dp processes (torchrun --nproc_per_node={2 * args.dp})")
    if pp > 2 and args.blocks < pp - 1:  # a middle stage holds blocks only
        parser.error(f"--blocks {args.blocks} leaves a middle stage of {pp} empty: use --blocks {pp - 1} or more")
    device = pick_device(args.device, env)  # cuda:LOCAL_RANK: the GPU is chosen by the rank WITHIN the node
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process uses this GPU, and only this one
    dist.init_process_group(backend=dist.get_default_backend_for_device(device),  # nccl for cuda, gloo for cpu
                            device_id=device if device.type == "cuda" else None)  # meet at MASTER_ADDR:MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # on every rank: the same initial weights and dropout masks

    train_ds, _, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples,
                                      is_main=rank == 0, barrier=dist.barrier)  # rank 0 downloads, the rest wait
    # The mesh: rows are the stages of a pipeline, columns the data-parallel replicas of a stage (inside a node).
    mesh = init_device_mesh(device.type, (pp, args.dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp, dp_rank = mesh.get_local_rank("pp"), args.dp, mesh.get_local_rank("dp")
    # Shard by DATA-PARALLEL rank: the stages of a pipeline must see the same batch, and only full ones (drop_last).
    train_sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=args.seed)
    loader_options = {"num_workers": args.num_workers, "pin_memory": device.type == "cuda"}
    train_loader = DataLoader(train_ds, args.batch_size, sampler=train_sampler, drop_last=True, **loader_options)
    # Each test image on exactly one pipeline (its stages see the same images): test() sums over the pipelines.
    test_sampler = EvalSampler(test_ds, num_replicas=dp, rank=dp_rank)
    test_loader = DataLoader(test_ds, batch_size=args.test_batch_size, sampler=test_sampler, **loader_options)

    net = TPNet(args.blocks, args.hidden)  # lesson 06's model, whole on every rank for a moment: the same weights
    model = Stage(net, stage_blocks(args.blocks, pp)[pp_rank], first=pp_rank == 0, last=pp_rank == pp - 1).to(device)
    for unit in [*model.units(), model]:  # FSDP2 over "dp": the stage's layers, then the stage (the root)
        fully_shard(unit, mesh=mesh["dp"], reshard_after_forward=False)  # gathered once a step, not per micro-batch
    stages = [PipelineStage(model, pp_rank, pp, device, group=mesh["pp"].get_group()) for _ in range(2)]
    # A PipelineStage sends its outputs on and their gradients back (send and recv in the "pp" group), in buffers
    # sized by the first batch it runs: evaluation's batches differ, so they get a stage of their own.
    pipeline = ScheduleGPipe if args.pp_schedule == "gpipe" else Schedule1F1B
    schedule = pipeline(stages[0], args.microbatches, loss_fn=F.nll_loss)  # the mean loss of each micro-batch
    evaluation = pipeline(stages[1], args.microbatches)  # forwards only
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)  # lr x 0.7 after every epoch
    start = 1
    if resume:  # --resume auto: the newest checkpoint; the run continues with the epoch after it
        model_state, optimizer_state = get_state_dict(model, optimizer, options=FLAT)  # my layers' shards, to fill
        checkpoint = {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "epoch": 0}
        dcp.load(checkpoint, checkpoint_id=resume)  # a collective: in place, each rank reads the pieces of its shards
        set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optimizer"],
                       options=FLAT)
        scheduler.load_state_dict(checkpoint["scheduler"])
        start = checkpoint["epoch"] + 1
        print(f"resumed from {resume}")
    print(f"rank {rank} of {world_size} on {device}, mesh (pp {pp_rank}, dp {dp_rank}) of ({pp}, {dp}): blocks "
          f"{list(model.blocks)}, {len(train_sampler)} of {len(train_ds)} training images")

    for epoch in range(start, args.epochs + 1):
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        began = time.perf_counter()
        train(model, schedule, device, train_loader, optimizer)
        seconds = time.perf_counter() - began
        loss, correct, count = test(model, evaluation, device, test_loader)
        scheduler.step()
        model_state, optimizer_state = get_state_dict(model, optimizer, options=FLAT)  # my shards, as DTensors
        state = {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "epoch": epoch}
        if rank == 0:
            print(f"epoch {epoch}: test loss {loss:.4f}, accuracy {correct:.0f}/{count:.0f}, train {seconds:.1f} s")
        with checkpoints.writing(epoch) as path:  # a temporary name, renamed once complete
            dcp.save(state, checkpoint_id=path)  # a collective: every rank writes its own shards, rank 0 the index
    dist.destroy_process_group()


def train(model, schedule, device, train_loader, optimizer):
    model.train()
    for data, target in train_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        optimizer.zero_grad()
        # Every micro-batch's forward and backward, in the schedule's order (stage 0 gets the images, the last stage
        # the labels); FSDP2 all-gathers each layer over "dp" and reduce-scatters its gradient after the last backward.
        schedule.step(*[data] * model.first, target=target if model.last else None)  # gradients: micro-batches' mean
        optimizer.step()


@torch.no_grad()
def test(model, evaluation, device, test_loader):
    """The test set's mean loss, and how many images were right out of how many."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for data, target in test_loader:
        data, target = data.to(device, non_blocking=True), target.to(device, non_blocking=True)
        padded = F.pad(data, (0, 0, 0, 0, 0, 0, 0, test_loader.batch_size - len(data)))  # zeros fill a last batch
        output = evaluation.eval(*[padded] * model.first)  # forwards only, through the stages; the output on the last
        if model.last:  # only the last stage has the output, and only the real images count
            output = output[:len(data)]
            loss_sum += F.nll_loss(output, target, reduction="sum").item()  # a SUM: the mean is exact
            correct += (output.argmax(dim=1) == target).sum().item()
            count += len(data)
    for _ in range(test_loader.sampler.most_batches(test_loader.batch_size) - len(test_loader)):
        evaluation.eval(*[torch.zeros(test_loader.batch_size, 1, 28, 28, device=device)] * model.first)  # all-gathers
    totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64, device=device)
    dist.all_reduce(totals)  # over ALL ranks: the last stage of each pipeline counted its images, the others zeros
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


# The stages hold different layers: optimizer state by parameter name, not in param_groups (DCP keeps ONE rank's)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

if __name__ == "__main__":
    run(main)
