r"""Lesson 08: a Hugging Face transformer, sharded: a Llama that draws digits, trained with FSDP2 on MNIST.

An image is 197 tokens: its class (16 + digit), then its 14x14 pixels row by row, in 16 gray levels (tokens 0-15).
`LlamaForCausalLM`, built from configs/digits_lm.json on the meta device (no download), learns p(pixels | digit):
`fully_shard` per decoder layer, then the root; bf16 compute, fp32 gradient reduction (--dtype float32: all fp32).
A DCP checkpoint every epoch resumes on any number of ranks; --export: `save_pretrained`; --draw: digits.png.
From the course folder:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 08_your_model/digits_lm.py \
        --data synthetic --train-samples 2000 --test-samples 500 --epochs 2 --export runs/08_digits_lm_hf --draw
"""
import json
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from huggingface_hub.errors import StrictDataclassError
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, \
    set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from common.checkpoints import CheckpointDir
from common.cli import Parser, count, positive_float, positive_int
from common.data import load_mnist
from common.distributed import init_timeout, launch_env, pick_device, restart_safe_store
from common.download import default_data_dir
from common.errors import CourseError, one_line
from common.exits import run
from common.files import atomic_save, creatable_folder, replace_folder, work_in_course_folder
from common.history import History
from common.log import log0, log_all
from common.position import Position
from common.samplers import EvalSampler

LESSON = "08_your_model/digits_lm"
LEVELS, PIXELS = 16, 14 * 14  # tokens 0-15: the gray levels; 16-25: the digit's class
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def read_config(path) -> LlamaConfig:
    """The model's LlamaConfig from a Hugging Face config.json: a file of our own, nothing is downloaded."""
    try:
        values = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CourseError(f"--model-config {path}: {exc.strerror}: check the path") from None
    except ValueError as exc:  # JSONDecodeError, or bytes that are not text at all
        raise CourseError(f"--model-config {path} is not JSON ({one_line(exc, 120)}): pass a config.json") from None
    if not isinstance(values, dict) or values.get("model_type") != "llama":
        raise CourseError(f'--model-config {path}: not a Llama config (it needs "model_type": "llama")')
    try:
        config = LlamaConfig.from_dict(values)
    except (StrictDataclassError, TypeError, ValueError) as exc:  # transformers checks the values' types and shapes
        raise CourseError(f"--model-config {path}: {one_line(exc, 200)}") from None
    if config.vocab_size < LEVELS + 10:
        raise CourseError(f"--model-config {path}: vocab_size {config.vocab_size} is too small for 16 gray levels "
                          f"and 10 classes: at least 26")
    return config


def pixel_tokens(dataset) -> TensorDataset:
    """MNIST images (MNISTFiles, or load_mnist's Subset of it) as rows of 197 tokens: the class, then 196 pixels."""
    indices = torch.arange(len(dataset))
    while isinstance(dataset, Subset):  # back to the raw uint8 images, not the normalised items
        indices, dataset = torch.as_tensor(dataset.indices)[indices], dataset.dataset
    images = F.avg_pool2d(dataset.data[indices].unsqueeze(1).float(), 2)  # 28x28 -> 14x14, still 0-255
    pixels = images.flatten(1).div(256 / LEVELS).long()  # 16 gray levels, 0-15
    return TensorDataset(torch.cat([LEVELS + dataset.targets[indices, None], pixels], dim=1))


def build_model(config, mesh, dtype):
    """The Llama on the meta device, sharded: still no memory and no values anywhere."""
    with torch.device("meta"):  # shapes only: no rank ever holds the whole model
        model = LlamaForCausalLM(config)
    # bfloat16: the gathered weights and the compute in bf16; gradients reduced and master shards kept in fp32.
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:  # one unit per decoder layer: all-gathered just before it runs, then freed
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)  # the root: embeddings, final norm, lm_head (tied or not)
    return model


@torch.no_grad()
def init_weights(model, config, seed: int) -> None:
    """What one process gets from to_empty, `torch.manual_seed(seed)` and the model's own init_weights(), one module
    at a time, each rank keeping its piece: the same model on any number of ranks. (DTensor's random ops on a CPU
    mesh warn, and draw the same numbers on every rank for its own piece.)"""
    with torch.device("meta"):
        twin = LlamaForCausalLM(config)  # an unsharded twin, shapes only
    names = {module: name for name, module in twin.named_modules()}
    filled = set()  # the tensors already initialised: a tied lm_head.weight IS the embedding
    torch.manual_seed(seed)

    def init(full):  # module.apply's order, children first: the order of transformers' initialize_weights
        full.to_empty(device="cpu", recurse=False)  # this module's full tensors for a moment, never the whole model
        twin._init_weights(full)  # transformers' own: normal(0, initializer_range), norms at 1, rotary frequencies
        mine = model.get_submodule(names[full])
        for key, value in [*full.named_parameters(recurse=False), *full.named_buffers(recurse=False)]:
            target = getattr(mine, key)
            if id(target) in filled:  # tied: keeps the embedding's values, as transformers' tie_weights() does
                continue
            filled.add(id(target))
            if isinstance(target, DTensor):  # a sharded parameter: cut my piece, no messages (buffers are whole)
                value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None).to_local()
                target = target.to_local()
            target.copy_(value)
        full.to_empty(device="meta", recurse=False)  # and free it

    twin.apply(init)


def next_pixel_logits(model, tokens):
    """For each of the 196 pixels, the logits from the tokens before it (the class first), in float32."""
    return model(input_ids=tokens[:, :-1], use_cache=False).logits.float()


def train(model, loader, optimizer, position, args, device) -> dict:
    model.train()
    meter = position.meter(device)
    for (tokens,) in position.remaining(loader, args):  # up to --max-steps batches
        tokens = tokens.to(device, non_blocking=True)
        loss = F.cross_entropy(next_pixel_logits(model, tokens).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()  # FSDP reduce-scatters each unit's gradients (fp32): every rank receives its shard's part
        optimizer.step()  # each rank updates its own shards
        optimizer.zero_grad(set_to_none=True)
        position.step += 1
        meter.update(loss.detach() * len(tokens), 0, len(tokens))  # a SUM over images of the loss per pixel
    return meter.all_reduce()  # every rank's sums added up (common.metrics): the epoch's exact mean


@torch.no_grad()
def test(model, loader, device) -> dict:
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct next pixels, pixel tokens
    for (tokens,) in loader:
        tokens = tokens.to(device, non_blocking=True)
        logits, targets = next_pixel_logits(model, tokens), tokens[:, 1:]
        sums[0] += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        sums[1] += (logits.argmax(-1) == targets).sum()
        sums[2] += targets.numel()  # 196 per image
    for _ in range(loader.sampler.most_batches(loader.batch_size) - len(loader)):  # FSDP gathers INSIDE forward:
        next_pixel_logits(model, torch.zeros(1, 2, dtype=torch.long, device=device))  # a rank with fewer joins in
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # SUMS over ranks: each test image counted once (EvalSampler)
    loss, correct, n = sums.tolist()
    return {"loss": loss / n, "accuracy": correct / n, "correct": int(correct), "count": int(n)}


def checkpoint_state(model, optimizer, position, history, checkpoints) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer)  # this rank's shards, as DTensors: no copies
    return {"model": model_state, "optimizer": optimizer_state,
            "position": position.state_dict(),  # all_gather_object of every rank's random state
            "history": history.state_dict(), "run": checkpoints.run}


def save_checkpoint(path, model, optimizer, position, history, checkpoints) -> None:
    scratch = path.with_name(path.name + ".tmp")
    dcp.save(checkpoint_state(model, optimizer, position, history, checkpoints), checkpoint_id=scratch)  # every rank
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        replace_folder(scratch, path)  # only a complete checkpoint gets the name
    dist.barrier()


def load_checkpoint(path, model, optimizer, position, history, checkpoints) -> None:
    state = checkpoint_state(model, optimizer, position, history, checkpoints)
    try:
        dcp.load(state, checkpoint_id=path)  # the pieces THIS rank's shards need, whatever the ranks that wrote them
    except CheckpointException as exc:  # e.g. written with another --model-config: sizes or names differ
        raise CourseError(f"{path} does not fit this model ({one_line(str(exc).strip().splitlines()[-1], 200)}): "
                          f"resume with the --model-config it was trained with") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    position.load_state_dict(state["position"])
    history.load_state_dict(state["history"], position.epoch)


@torch.no_grad()
def draw(model, temperature: float, seed: int, path: Path) -> None:
    """One digit per class, pixel after pixel from the class token, each gray level sampled at `temperature`."""
    import matplotlib
    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt

    generator = torch.Generator().manual_seed(seed)
    tokens = LEVELS + torch.arange(10)[:, None]  # the 10 class tokens
    for _ in range(PIXELS):  # the whole sequence again at each pixel: 196 small forwards, no cache to manage
        logits = model(input_ids=tokens, use_cache=False).logits[:, -1, :LEVELS].float()  # gray levels only
        level = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, level], dim=1)
    fig, axes = plt.subplots(1, 10, figsize=(10, 1.4))
    for digit, ax in enumerate(axes):
        ax.imshow(tokens[digit, 1:].reshape(14, 14), cmap="gray", vmin=0, vmax=LEVELS - 1)
        ax.set(title=str(digit), xticks=[], yticks=[])
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    log0(f"drawn: {path} (one digit per class, temperature {temperature})")


def finish(model, config, args, device) -> None:
    """After training: the reference logits, then the full weights on rank 0 for --export and --draw."""
    check = torch.cat([LEVELS + torch.arange(10)[:, None], torch.arange(PIXELS).remainder(LEVELS).expand(10, -1)], 1)
    model.eval()
    with torch.no_grad():  # a fixed input through the trained model; every rank runs it: FSDP gathers inside forward
        logits = model(input_ids=check.to(device), use_cache=False).logits.float().cpu()
    # Every rank takes part (all-gathers); rank 0 receives the full tensors, on its CPU, the others an empty dict.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return
    plain = LlamaForCausalLM(config).eval()  # a plain model on the CPU: no FSDP, no process group needed
    plain.load_state_dict(full)  # both names of the tied embedding carry the same tensor
    if args.export:
        hf_logging.disable_progress_bar()  # save_pretrained's bar over its one file: noise in a log
        plain.save_pretrained(args.export)  # config.json + model.safetensors (the tied lm_head.weight stored once)
        atomic_save({"input_ids": check, "logits": logits, "dtype": args.dtype}, f"{args.output_dir}/export_check.pt")
        log0(f"exported: {args.export} (from_pretrained loads it); {args.output_dir}/export_check.pt: its logits")
    if args.draw:
        draw(plain, args.temperature, args.seed, Path(args.output_dir) / "digits.png")


def parse_args(argv):
    p = Parser(description="Lesson 08: a Hugging Face Llama that draws digits, sharded with FSDP2")
    p.add_argument("--model-config", default="08_your_model/configs/digits_lm.json",
                   help="the model's Hugging Face config.json (default: 08_your_model/configs/digits_lm.json)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                   help="FSDP2's compute dtype; gradients are reduced and weights kept in float32 (default: bfloat16)")
    p.add_argument("--data", choices=["mnist", "synthetic"], default="mnist", help="(default: mnist)")
    p.add_argument("--data-dir", default=default_data_dir(),
                   help="folder holding MNIST/raw (default: $WORKSHOP_DATA_DIR or ./data)")
    p.add_argument("--train-samples", type=positive_int, help="the first N training images (default: all)")
    p.add_argument("--test-samples", type=positive_int, help="the first N test images (default: all)")
    p.add_argument("--epochs", type=positive_int, default=3, help="(default: 3)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="images per process and step (default: 32)")
    p.add_argument("--test-batch-size", type=positive_int, default=250, help="(default: 250)")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW's learning rate (default: 3e-3)")
    p.add_argument("--seed", type=count, default=1, help="initial weights, shuffling, drawing (default: 1)")
    p.add_argument("--max-steps", type=positive_int, help="stop each epoch after N steps (default: no cap)")
    p.add_argument("--dry-run", action="store_true", help="smoke test: 1 epoch of 2 steps")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="(default: auto)")
    p.add_argument("--output-dir", default="runs/08_digits_lm", help="(default: runs/08_digits_lm)")
    p.add_argument("--resume", help="'auto' or a checkpoint folder, written on any number of ranks")
    p.add_argument("--keep-checkpoints", type=positive_int, default=2, help="(default: 2)")
    p.add_argument("--export", metavar="DIR", help="after training, save_pretrained the model into DIR")
    p.add_argument("--draw", action="store_true", help="after training, draw one digit per class: digits.png")
    p.add_argument("--temperature", type=positive_float, default=1.0,
                   help="for --draw: 1 samples the model as it is, lower drifts to black (default: 1)")
    p.set_defaults(target_accuracy=None)  # History's early-stopping target: none for a language model
    args = p.parse_args(argv)
    if args.dry_run:
        args.epochs, args.max_steps = 1, 2
    if args.export and (problem := creatable_folder(args.export)):
        raise CourseError(f"--export {args.export}: {problem}: pick a folder you can write to")
    return args


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    args = parse_args(argv)
    config = read_config(args.model_config)  # before anything slow: a bad file is one line
    checkpoints = CheckpointDir(args, LESSON, sharded=True)
    resume = checkpoints.resume_from(args.resume)
    env = launch_env()  # RANK, LOCAL_RANK, WORLD_SIZE from torchrun, or from srun's SLURM_* variables
    device = pick_device(args.device, env)  # cuda:LOCAL_RANK, or the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this process uses this GPU, and only this one
    dist.init_process_group(backend=dist.get_default_backend_for_device(device),  # nccl for cuda, gloo for cpu
                            timeout=init_timeout(), rank=env.rank, world_size=env.world_size,
                            store=restart_safe_store(env), device_id=device if device.type == "cuda" else None)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    log_all(f"host {socket.gethostname()} rank {rank}/{world_size} device {device} backend {dist.get_backend()}")

    train_ds, _, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples,
                                      seed=args.seed, is_main=rank == 0, barrier=dist.barrier)  # rank 0 prepares
    train_ds, test_ds = pixel_tokens(train_ds), pixel_tokens(test_ds)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              generator=torch.Generator())  # its own generator: the global random stream untouched
    test_loader = DataLoader(test_ds, batch_size=args.test_batch_size, sampler=EvalSampler(test_ds))

    mesh = init_device_mesh(device.type, (world_size,))  # 1-D: shard over all ranks
    model = build_model(config, mesh, DTYPES[args.dtype])
    model.to_empty(device=device)  # this rank's shards, allocated, not initialised
    init_weights(model, config, args.seed)  # transformers' initialisation, each rank keeping its piece
    log0(f"digits_lm: {world_size} process{'es' if world_size > 1 else ''}, {config.num_hidden_layers} layers, "
         f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, each rank stores ~1/{world_size}, "
         f"{args.dtype} compute; {len(test_ds)} test images = {len(test_ds) * PIXELS} pixel tokens")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")  # on the shards
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)  # also when a resumed run has nothing left to train
    position, history = Position(), History(args, LESSON, device)
    if resume:  # --resume: the sharded checkpoint, resharded onto this run's ranks
        load_checkpoint(resume, model, optimizer, position, history, checkpoints)

    for epoch in range(position.epoch, args.epochs + 1):
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        train_stats = train(model, train_loader, optimizer, position, args, device)
        history.add(epoch, train_stats, test(model, test_loader, device), lr=args.lr)  # test_accuracy: next pixel
        position.next_epoch()
        path = checkpoints.path(position)
        save_checkpoint(path, model, optimizer, position, history, checkpoints)
        checkpoints.prune(path)
    history.close()
    if args.export or args.draw:
        finish(model, config, args, device)
    dist.destroy_process_group()
    return history.record


if __name__ == "__main__":
    run(main)
