r"""The trainer's --parallel fsdp2: each process keeps a 1/N shard of weights, grads, optimizer state (lesson 05).

Before a unit of layers runs, its full weights are all-gathered; after backward, its gradients are
reduce-scattered so each rank updates only its shard: a model too big for one GPU under DDP fits. From the
course folder:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 trainer/train.py --parallel fsdp2 \
        --data synthetic --train-samples 2000 --test-samples 500 --epochs 2 --num-workers 0
"""
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common`

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

from common.checkpoints import CheckpointDir
from common.cli import base_parser, parse
from common.errors import CourseError, one_line
from common.files import work_in_course_folder
from common.log import log0
from common.model import Net, count_parameters, model_flags
from trainer.amp import autocast_dtype
from trainer.data import load_data, make_loaders
from trainer.loop import Run
from trainer.process import init_distributed
from trainer.state import DCP, export_full

LESSON = "trainer-fsdp2"  # the checkpoints' signature, and the default runs/trainer-fsdp2


@torch.no_grad()
def init_weights(model, args, model_class=Net):
    """What `torch.manual_seed(seed); model_class()` draws, one module at a time, each rank keeping its piece."""
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        twin = model_class(**model_flags(args))  # an unsharded twin, shapes only
    owners = [[m for m in net.modules() if list(m.parameters(recurse=False))] for net in (model, twin)]
    for sharded, full in zip(*owners):  # conv1, conv2, fc1, the blocks, fc2: the order Net() drew them
        full.to_empty(device="cpu", recurse=False)  # this module's full tensors for a moment, never the whole model
        full.reset_parameters()  # the module's own initialisation, as in Net()
        for shard, value in zip(sharded.parameters(recurse=False), full.parameters(recurse=False)):
            shard.to_local().copy_(distribute_tensor(value, shard.device_mesh, shard.placements,
                                                     src_data_rank=None).to_local())  # cut my piece, no messages
        full.to_empty(device="meta", recurse=False)  # and free it


def shard(model, mesh, mp_policy):
    """fully_shard each unit, then the root (the rest): one unit is all-gathered at a time, then freed."""
    for unit in [model.features, model.fc1, *model.blocks, model.fc2, model]:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy)
    return model


@contextmanager
def no_sync(model):
    """FSDP2's no_sync: no reduce-scatter of the gradients until the optimizer step's last micro-batch."""
    model.set_requires_gradient_sync(False)
    yield
    model.set_requires_gradient_sync(True)


def read_full_weights(path, model) -> dict:
    """The plain Net state dict in `path`: a lesson 02-04 checkpoint (its "model") or a model_full.pt (05)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # OSError, or whatever the unpickler meets in a file that is no checkpoint
        raise CourseError(f"--init-from {path}: not a readable weights file ({one_line(exc, 200)})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a training checkpoint of lessons 02-04
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in state.items() if isinstance(t, torch.Tensor)} \
        if isinstance(state, dict) else {}
    if found != expected:
        differ = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
        raise CourseError(f"--init-from {path}: not the weights of this Net (differ: {', '.join(differ[:4])}): "
                          f"a lesson 04 checkpoint .pt or a model_full.pt, trained with the same --width, "
                          f"--blocks and --hidden")
    return state


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    parser = base_parser(LESSON, "Lesson 05: MNIST with FSDP2 (fully_shard) and sharded DCP checkpoints")
    parser.add_argument("--hsdp", action="store_true", help="HSDP: replicate across nodes, shard within each")
    parser.add_argument("--init-from", metavar="PATH", help="start from a lesson 04 .pt or a model_full.pt")
    args = parse(parser, argv)
    checkpoints = CheckpointDir(args, LESSON, sharded=True)
    resume = checkpoints.resume_from(args.resume)  # first, before anything slow: a used --output-dir is refused

    device, env, stop_group = init_distributed(args)  # the same seed on every rank: identical initial weights
    rank, world_size = dist.get_rank(), dist.get_world_size()  # rank 0 of world_size does the writing
    # Shard by GLOBAL rank: with the local rank, every node would train on the same shard.
    loaders = make_loaders(args, device, *load_data(args), replicas=world_size, replica=rank)
    amp_dtype = autocast_dtype(args.amp, device)  # --amp: bfloat16 where the device has it natively, else float16
    with torch.device("meta"):  # shapes only, no memory and no values: no rank ever holds the whole model
        model = Net(**model_flags(args))
    nodes = world_size // env.local_world_size  # --hsdp: a 2-D mesh, replicate across the nodes, shard within each
    mesh = init_device_mesh(device.type, (nodes, world_size // nodes), mesh_dim_names=("replicate", "shard")) \
        if args.hsdp else init_device_mesh(device.type, (world_size,))  # else 1-D: shard over all ranks
    # --amp: bf16 or fp16 gathers and compute, fp32 gradient reduction and master shards. The GradScaler works on
    # the sharded gradients as they are: DTensor all-reduces its inf/NaN check, so every rank skips the same steps.
    shard(model, mesh, MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32))
    model.to_empty(device=device)  # this rank's shards, allocated, not initialised
    init_weights(model, args)  # the values Net() draws with --seed, one module at a time (above)
    if args.init_from:  # a plain Net's full weights: rank 0 reads them and broadcasts, each rank keeps its shard
        set_model_state_dict(model, read_full_weights(args.init_from, model) if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if args.compile:
        model.compile(backend=args.compile)  # torch.compile in place, after fully_shard
    torch.manual_seed(args.seed + rank)  # from here on each rank its own stream: different dropout masks
    log0(f"lesson 05: {world_size} process{'es' if world_size > 1 else ''}, mesh {tuple(mesh.shape)}, "
         f"{count_parameters(model) / 1e6:,.1f} M parameters, each rank stores ~1/{mesh.shape[-1]} of them")
    run = Run(args, LESSON, device, model, loaders, checkpoints, DCP(), resume, replicas=world_size,
              amp_dtype=amp_dtype, stop_group=stop_group, no_sync=lambda: no_sync(model), join=True)
    return run.fit(export=lambda: export_full(model, f"{args.output_dir}/model_full.pt"))
