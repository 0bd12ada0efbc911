r"""Lesson 08: a Hugging Face transformer, sharded: a decoder that draws digits, trained with FSDP2 on MNIST.

An image is 197 tokens: its class (16 + digit), then its 14x14 pixels (digits_data.py). A Hugging Face decoder (Llama,
Qwen2, Mistral, ...), built from configs/digits_lm.json on the meta device (no download), or from a save_pretrained
folder (--pretrained, read shard by shard: hf_shards.py), learns p(pixels | digit): `fully_shard` per decoder layer,
then the root; bf16 compute, fp32 gradient reduction (--dtype float32: all fp32). A DCP checkpoint every epoch
(dcp_saver.py; --async-checkpoint: written while training goes on) resumes on any number of ranks (one a stop saved
within an epoch: on its own); --export: a from_pretrained folder that every rank writes its part of (hf_export.py);
--draw: digits.png. --data text fine-tunes a --pretrained model on your own text instead (finetune.py): blocks of
--seq-len tokens, the validation loss and perplexity each epoch, --prompt's greedy continuation, an export that holds
the tokenizer and checks itself. --warmup-steps/--min-lr and --clip-grad: schedule.py.
From the course folder:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 08_your_model/digits_lm.py \
        --data synthetic --train-samples 2000 --test-samples 500 --epochs 2 --export runs/08_digits_lm/hf --draw
"""
import signal
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install
sys.path.insert(1, str(Path(__file__).resolve().parent))  # this folder's modules, also when imported from elsewhere

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler

from common.checkpoints import CheckpointDir
from common.data import load_mnist
from common.distributed import init_timeout, launch_env, pick_device, restart_safe_store
from common.errors import CourseError, one_line
from common.exits import run
from common.files import atomic_save, work_in_course_folder
from common.history import History
from common.log import log0, log_all, plural
from common.position import Position, steps_per_epoch
from common.samplers import EvalSampler
from common.signals import StopSignals
from dcp_saver import Saver
from digits_args import DEFAULT_CONFIG, DTYPES, parse_args
from finetune import check_text_args, finish_text, perplexity_line, text_loaders, text_loss
from digits_data import LEVELS, PIXELS, draw, pixel_tokens, what_it_learns
from flops import multiplying_parameters, rates
from hf_export import export
from hf_config import read_config as read_decoder_config
from hf_shards import build_model, init_weights, load_pretrained, stored_tensors
from schedule import clip_gradients, make_scheduler

LESSON = "08_your_model/digits_lm"


def read_config(path, flag: str):
    """The decoder's config (hf_config.py, the lesson's one reader), with room for 16 gray levels and 10 classes."""
    config = read_decoder_config(path, flag)
    if config.vocab_size < LEVELS + 10:
        raise CourseError(f"{flag} {path}: vocab_size {config.vocab_size} is too small for 16 gray levels "
                          f"and 10 classes: at least 26")
    return config


def next_pixel_logits(model, tokens):
    """For each of the 196 pixels, the logits from the tokens before it (the class first), in float32."""
    return model(input_ids=tokens[:, :-1], use_cache=False).logits.float()


def train(model, loader, optimizer, scheduler, position, args, device, stop, stop_group) -> dict:
    model.train()
    meter = position.meter(device)
    for (tokens,) in position.remaining(loader, args):  # up to --max-steps batches
        if position.step % 10 == 0 and stop.agreed(stop_group):  # every 10 steps, all ranks: a stop was requested
            break  # between two steps; the caller saves a checkpoint here
        tokens = tokens.to(device, non_blocking=True)
        if args.data == "text":  # a SUM over this rank's real next tokens (a padding block has none)
            loss, loss_sum, count = text_loss(model, tokens)
        else:
            loss = F.cross_entropy(next_pixel_logits(model, tokens).flatten(0, 1), tokens[:, 1:].flatten())
            loss_sum, count = loss.detach() * len(tokens), len(tokens)  # a SUM over images of the loss per pixel
        loss.backward()  # FSDP reduce-scatters each unit's gradients (fp32): every rank receives its shard's part
        if args.clip_grad:
            clip_gradients(model, args.clip_grad)  # the norm over every rank's shards (schedule.py)
        optimizer.step()  # each rank updates its own shards
        optimizer.zero_grad(set_to_none=True)
        if scheduler:
            scheduler.step()
        position.step += 1
        meter.update(loss_sum, 0, count)
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


def checkpoint_state(model, optimizer, scheduler, position, history, checkpoints) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer)  # this rank's shards, as DTensors: no copies
    return {"model": model_state, "optimizer": optimizer_state,
            "position": position.state_dict(),  # all_gather_object of every rank's random state
            "history": history.state_dict(), "run": checkpoints.run,
            **({"scheduler": scheduler.state_dict()} if scheduler else {})}


def load_checkpoint(path, model, optimizer, scheduler, position, history, checkpoints) -> None:
    state = checkpoint_state(model, optimizer, scheduler, position, history, checkpoints)
    try:
        dcp.load(state, checkpoint_id=path)  # the pieces THIS rank's shards need, whatever the ranks that wrote them
    except CheckpointException as exc:  # e.g. written with another --model-config: sizes or names differ
        raise CourseError(f"{path} does not fit this model ({one_line(str(exc).strip().splitlines()[-1], 200)}): "
                          f"resume with the --model-config it was trained with") from None
    position.load_state_dict(state["position"])
    ranks = position.saved_ranks
    if position.step and ranks != dist.get_world_size():  # the rest of its epoch was cut for that many ranks
        raise CourseError(f"{path} stopped at step {position.step} of epoch {position.epoch} on "
                          f"{plural(ranks, 'rank')}: finish that epoch on {ranks} (torchrun --nproc_per_node={ranks}); "
                          f"a checkpoint between epochs (step 0) resumes on any number")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    history.load_state_dict(state["history"], position.epoch)
    if scheduler:
        scheduler.load_state_dict(state["scheduler"])


def finish(model, config, args, device) -> None:
    """After training: the reference logits, then --export (every rank writes its part) and --draw (sharded)."""
    check = torch.cat([LEVELS + torch.arange(10)[:, None], torch.arange(PIXELS).remainder(LEVELS).expand(10, -1)], 1)
    model.eval()
    with torch.no_grad():  # a fixed input through the trained model; every rank runs it: FSDP gathers inside forward
        logits = model(input_ids=check.to(device), use_cache=False).logits.float().cpu()
    if args.data == "text":
        return finish_text(model, config, args, device, export, DTYPES)
    if args.export:
        export(model, config, args.export, DTYPES[args.export_dtype])  # no rank gathers the model
        if dist.get_rank() == 0:
            atomic_save({"input_ids": check, "logits": logits, "dtype": args.dtype, "export_dtype": args.export_dtype},
                        f"{args.output_dir}/export_check.pt")
        log0(f"exported: {args.export} ({args.export_dtype}; from_pretrained loads it); "
             f"{args.output_dir}/export_check.pt: its logits")
    if args.draw:
        draw(model, args.temperature, args.seed, Path(args.output_dir) / "digits.png", device)


def main(argv=None):
    work_in_course_folder()  # relative paths (data/, runs/, --config) are the course folder's
    args = parse_args(argv)
    # before anything slow: a bad file is one line
    config = read_config(args.pretrained, "--pretrained") if args.pretrained else \
        read_config(args.model_config or DEFAULT_CONFIG, "--model-config")
    if args.pretrained:
        stored_tensors(Path(args.pretrained))  # its safetensors are there (a look at the index or header)
    check_text_args(args, config)
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

    if args.data == "text":
        train_loader, train_sampler, test_loader = text_loaders(args, rank, world_size)
    else:
        train_ds, _, test_ds = load_mnist(args.data_dir, args.data, args.train_samples, args.test_samples,
                                          seed=args.seed, is_main=rank == 0, barrier=dist.barrier)  # rank 0 prepares
        train_ds, test_ds = pixel_tokens(train_ds), pixel_tokens(test_ds)
        train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
        train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                                  generator=torch.Generator())  # its own generator: the global random stream untouched
        test_loader = DataLoader(test_ds, batch_size=args.test_batch_size, sampler=EvalSampler(test_ds))
    tokens_per_item = args.seq_len - 1 if args.data == "text" else PIXELS  # next tokens predicted per block/image

    mesh = init_device_mesh(device.type, (world_size,))  # 1-D: shard over all ranks
    model = build_model(config, mesh, DTYPES[args.dtype], ac=args.ac, compile_backend=args.compile)
    model.to_empty(device=device)  # this rank's shards, allocated, not initialised
    if args.pretrained:  # each rank reads its own rows of each tensor: no rank holds the whole model
        read = load_pretrained(model, config, args.pretrained)
        log0(f"pretrained: {args.pretrained}: each rank read its own rows of {read}")
    else:
        init_weights(model, config, args.seed)  # transformers' initialisation, each rank keeping its piece
    parameters = sum(p.numel() for p in model.parameters())
    log0(f"digits_lm: {world_size} process{'es' if world_size > 1 else ''}, {config.model_type}, "
         f"{config.num_hidden_layers} layers, {parameters / 1e6:.2f} M parameters, each rank stores ~1/{world_size}, "
         f"{args.dtype} compute{', --ac' if args.ac else ''}{f', compiled ({args.compile})' if args.compile else ''}"
         + ("" if args.data == "text" else f"; {len(test_ds)} test images = {len(test_ds) * PIXELS} pixel tokens"))
    if args.data != "text" and (learns := what_it_learns(config, args.pretrained)):
        log0(learns)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")  # on the shards
    scheduler = make_scheduler(optimizer, args, steps_per_epoch(train_loader, args) * args.epochs)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)  # also when a resumed run has nothing left to train
    position, history = Position(), History(args, LESSON, device, unit=None if args.data == "text" else "img")
    if resume:  # --resume: the sharded checkpoint, resharded onto this run's ranks
        load_checkpoint(resume, model, optimizer, scheduler, position, history, checkpoints)
    elif args.pretrained:  # the model as it arrives: the loss a fine-tuning run starts from
        before = test(model, test_loader, device)
        log0(perplexity_line("before training", before) if args.data == "text" else
             f"before training | test_loss {before['loss']:.4f} | test_accuracy {before['accuracy']:.4f} "
             f"({before['correct']}/{before['count']})")

    saver, stop_group = Saver(checkpoints, args.async_checkpoint), dist.new_group(backend="gloo")  # stop votes: CPU
    with StopSignals(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1) as stop:  # Ctrl-C, Slurm's warning and its end
        for epoch in range(position.epoch, args.epochs + 1):
            train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            train_stats = train(model, train_loader, optimizer, scheduler, position, args, device, stop, stop_group)
            if stop.agreed(stop_group, now=True):  # also a request after the epoch's last check: all ranks save here
                state = checkpoint_state(model, optimizer, scheduler, position, history, checkpoints)
                saver.save(checkpoints.path(position), state)
                saver.wait()  # on disk and named before the report
                stop.report(position.epoch, position.step)
                break
            tokens_per_s = train_stats["images_per_second"] * (1 if args.data == "text" else PIXELS)  # text: tokens
            lr, tested = optimizer.param_groups[0]["lr"], test(model, test_loader, device)  # the next step's lr
            history.add(epoch, train_stats, tested, lr=lr,  # test_accuracy: the next pixel / token right
                        rates=rates(tokens_per_s, multiplying_parameters(model), config, tokens_per_item, device))
            if args.data == "text":
                log0(perplexity_line(f"after epoch {epoch}", tested))
            position.next_epoch()
            saver.save(checkpoints.path(position), checkpoint_state(model, optimizer, scheduler, position, history, checkpoints))
        saver.wait()  # an async checkpoint still being written: finished and named before anything else
        history.close()
        # a collective (all_reduce): one more vote, so a request after the last one (in the last test or save) stops
        # every rank or none: a rank that skipped finish() alone would leave the others waiting in its all-gathers
        if stop.agreed(stop_group, now=True):
            stop.report(position.epoch, position.step)  # the last epoch's checkpoint is on disk; said once
        elif args.export or args.draw or args.prompt is not None:
            finish(model, config, args, device)  # collectives: FSDP's all-gathers in forward, the export's DCP save
        dist.destroy_process_group()  # inside the `with`: a late SIGUSR1 is written down, not the end of the process
    return history.record


if __name__ == "__main__":
    run(main)
