"""Lesson 08's text path (--data text): the user's text in blocks (text_data.py), the step's loss, and after
training the --prompt continuation and an --export that holds the tokenizer and checks itself (generate.py)."""
import math

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from common.errors import CourseError
from common.log import log0
from common.samplers import EvalSampler
from generate import (CHECK_PROMPT, NEW_TOKENS, check_export, eos_ids, generation_config_for, greedy, on_every_rank,
                      prompt_ids, sharded_logits)
from text_data import PaddedSampler, check_file, check_seq_len, load_tokenizer, next_token_loss, text_blocks


def check_text_args(args, config) -> None:
    """Before anything slow: the flags of the text path, one line each."""
    if args.data != "text":
        for flag in ("text", "prompt"):
            if getattr(args, flag) is not None:
                raise CourseError(f"--{flag} is for --data text: add --data text --pretrained DIR")
        return
    if args.draw:
        raise CourseError("--draw draws MNIST digits: leave it out with --data text (--prompt generates text)")
    if not args.pretrained:
        raise CourseError("--data text needs --pretrained (a folder with a tokenizer)")
    if not args.text:
        raise CourseError("--data text needs --text FILE... (.txt files, or .jsonl with a \"text\" field a line)")
    for path in args.text:
        check_file(path)  # there, and .txt or .jsonl
    check_seq_len(args.seq_len, config)
    load_tokenizer(args.pretrained)  # a folder without one: one line now, not after the process group starts


def text_loaders(args, rank: int, world_size: int):
    """(train loader, its PaddedSampler, validation loader); rank 0 prints text_blocks' summary."""
    train, val, summary = text_blocks(args.text, args.pretrained, args.seq_len, args.val_fraction,
                                      f"{args.output_dir}/text-cache", is_main=rank == 0, barrier=dist.barrier,
                                      world_size=world_size)
    log0(summary)
    sampler = PaddedSampler(train, num_replicas=world_size, rank=rank, seed=args.seed)
    return (DataLoader(train, batch_size=args.batch_size, sampler=sampler), sampler,
            DataLoader(val, batch_size=args.test_batch_size, sampler=EvalSampler(val)))


def text_loss(model, tokens):
    """(the loss to backward, this rank's loss sum, this rank's real targets) of a batch that may hold padding."""
    logits = model(input_ids=tokens.clamp(min=0)[:, :-1], use_cache=False).logits
    loss, loss_sum, _ = next_token_loss(logits, tokens)
    return loss, loss_sum, int((tokens[:, 1:] >= 0).sum())


def perplexity_line(label: str, stats: dict) -> str:
    return f"{label}: validation loss {stats['loss']:.4f}, perplexity {math.exp(stats['loss']):.2f} " \
           f"({stats['count']} tokens)"


def finish_text(model, config, args, device, export, dtypes) -> None:
    """--prompt: the sharded model's greedy continuation (every rank runs it, rank 0 prints); --export: the folder
    with its tokenizer and generation_config.json, then rank 0's from_pretrained check of it."""
    tokenizer = load_tokenizer(args.pretrained)
    generation_config = generation_config_for(args.pretrained, config)
    eos = eos_ids(generation_config)
    if args.prompt is not None:
        ids = prompt_ids(tokenizer, args.prompt)
        new = greedy(model, ids, NEW_TOKENS, eos, device)
        log0(f"--prompt {args.prompt!r} -> greedy, {len(new)} tokens: {tokenizer.decode(new)!r}")
    if not args.export:
        return

    def extras(folder):
        tokenizer.save_pretrained(folder)
        generation_config.save_pretrained(folder)

    export(model, config, args.export, dtypes[args.export_dtype], extras)
    ids = prompt_ids(tokenizer, args.prompt or CHECK_PROMPT)
    logits, tokens = sharded_logits(model, ids, device), greedy(model, ids, NEW_TOKENS, eos, device)
    lossy = args.dtype == "float32" and args.export_dtype == "bfloat16"
    log0(on_every_rank(lambda: check_export(args.export, ids, logits, tokens, dtypes[args.dtype], lossy)))
    log0(f"exported: {args.export} ({args.export_dtype}, with its tokenizer and generation_config.json; "
         f"from_pretrained loads it)")
