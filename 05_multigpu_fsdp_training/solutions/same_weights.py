"""Exercise 1 of lesson 05: a checkpoint written by 2 ranks, loaded by 3 (or any number), holds the same model.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=3 05_multigpu_fsdp_training/solutions/same_weights.py \
        runs/05-first/checkpoints/05-epoch-002 --data synthetic --test-samples 1000

Every rank shards a fresh Net the lesson's way and loads the checkpoint's "model" into its shards with dcp.load, as
--resume does; the shards are then gathered onto rank 0 (get_model_state_dict with full_state_dict=True). Rank 0
reads the same checkpoint once more without any process group (dcp.load with no_dist=True, into a plain Net), checks
that the two are equal tensor for tensor, bit for bit, and scores that plain Net on the run's test set (the same
--data, --data-dir and --test-samples as the run): what the run printed for the checkpoint's epoch. Writes nothing.
"""
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the course folder: `common`

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from common.cli import lesson_parser
from common.data import load_mnist
from common.errors import CourseError
from common.exits import run
from common.model import Net


def sharded_and_loaded(path: Path) -> Net:
    """A Net sharded over all ranks as lesson 05 shards it, its shards filled from the checkpoint (a collective)."""
    model = Net()  # random weights: the checkpoint replaces them
    mesh = dist.init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in [model.features, model.fc1, model.fc2, model]:
        fully_shard(unit, mesh=mesh)
    state = {"model": get_model_state_dict(model)}  # this rank's shards, to be filled
    dcp.load(state, checkpoint_id=path)  # each rank reads the pieces of its own rows
    set_model_state_dict(model, state["model"])
    return model


@torch.no_grad()
def score(state: dict, args) -> tuple[int, int]:
    """(right, images) of a plain Net with `state` on the run's test set."""
    model = Net()
    model.load_state_dict(state)
    model.eval()
    _, _, test = load_mnist(args.data_dir, args.data, None, args.test_samples, download=False)
    right = sum(int((model(x).argmax(dim=1) == y).sum()) for x, y in DataLoader(test, batch_size=1000))
    return right, len(test)


def main(argv=None):
    p = lesson_parser("05", __doc__.splitlines()[0])  # the run's own flags: --data, --data-dir, --test-samples
    p.add_argument("checkpoint", type=Path, help="a lesson 05 checkpoint folder, e.g. runs/05-first/checkpoints/05-epoch-002")
    args = p.parse_args(argv)
    if not (args.checkpoint / ".metadata").is_file():
        raise CourseError(f"{args.checkpoint} is not a DCP checkpoint folder (no .metadata): give a lesson 05 "
                          f"checkpoint, e.g. runs/05-first/checkpoints/05-epoch-002")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = sharded_and_loaded(args.checkpoint)
    print(f"[rank {rank}] loaded my shards: fc1.weight rows {model.fc1.weight.to_local().shape[0]} of 128", flush=True)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # a collective
    dist.destroy_process_group()
    if rank != 0:
        return
    plain = {"model": Net().state_dict()}
    with warnings.catch_warnings():  # torch 2.9 warns on every no_dist load that it assumes one process: asked for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(plain, checkpoint_id=args.checkpoint, no_dist=True)  # one process reads every piece, unsharded
    differ = sorted(k for k in plain["model"] if not torch.equal(plain["model"][k], full[k]))
    if differ or full.keys() != plain["model"].keys():
        raise CourseError(f"the weights loaded on {world} ranks differ from the checkpoint in {', '.join(differ[:4])}")
    print(f"OK: loaded on {world} ranks and gathered, the weights equal the checkpoint's: all {len(full)} tensors, "
          f"bit for bit", flush=True)
    right, images = score(full, args)
    print(f"OK: a plain Net with these weights scores {right}/{images} on the test set: the run's line for "
          f"this epoch shows the same", flush=True)


if __name__ == "__main__":
    run(main)
