"""Lesson 08's text: the user's documents, tokenized once with the model's own tokenizer, packed into blocks of
seq_len tokens, and a training sampler that gives every block to exactly one rank per epoch.

text_blocks() tokenizes on the main rank only (each document followed by the tokenizer's EOS), caches the blocks in
a file named by a hash of the texts, the tokenizer's files and seq_len, and every rank reads that file after the
barrier. PaddedSampler's batches may hold a padding block of -100s: next_token_loss ignores it.
"""
import hashlib
import itertools
import json
import math
from pathlib import Path
from typing import Iterator, Sized

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Sampler, TensorDataset

from common.distributed import get_rank, get_world_size
from common.errors import CourseError, one_line
from common.files import atomic_save
from common.log import progress_bar

IGNORE = -100  # F.cross_entropy's default ignore_index: the padding block's targets add no loss and no count
SUFFIXES = (".txt", ".jsonl")
CHUNK_CHARS = 1_000_000  # characters per tokenizer call: the progress bar's step; a longer document is cut at lines
JSONL = 'write one JSON object a line, e.g. {"text": "..."}'
FORMAT = "text_data 1"  # part of the cache's hash: a change in how blocks are made invalidates old caches


def check_file(path) -> Path:
    """A .txt or .jsonl file that is there, or the one-line error that says so."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise CourseError(f"{path}: a {path.suffix or 'suffix-less'} file: give .txt files (one document each) "
                          f"or .jsonl files (one JSON object a line, its text in \"text\")")
    if not path.is_file():
        raise CourseError(f"{path}: no such file: check the path (relative paths are the course folder's)")
    return path


def read_documents(path) -> list[str]:
    """A .txt file is one document; a .jsonl file one document per line, its "text" field (blank lines skipped)."""
    path = check_file(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CourseError(f"{path}: {one_line(getattr(exc, 'strerror', None) or exc, 120)}: give a readable "
                          f"UTF-8 text file") from None
    if not text.strip():
        raise CourseError(f"{path} is empty: give a file with text in it, or leave it out")
    if path.suffix == ".txt":
        return [text]
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise CourseError(f"{path} line {number} is not JSON ({one_line(exc, 80)}): {JSONL}") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise CourseError(f"{path} line {number} has no string \"text\" field: {JSONL}")
        documents.append(record["text"])
    return documents


def read_texts(paths) -> list[str]:
    """The documents of every file, in the order given."""
    return [document for path in paths for document in read_documents(path)]


def load_tokenizer(folder):
    """The tokenizer saved beside the model (local files only), which must have an EOS token to separate documents."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise CourseError(f"{folder} has no tokenizer (tokenizer.json / tokenizer_config.json): save one beside the "
                          f"model with tokenizer.save_pretrained")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise CourseError(f"{folder}: AutoTokenizer cannot load it ({one_line(exc, 160)}): save the tokenizer "
                          f"again with tokenizer.save_pretrained") from None
    if tokenizer.eos_token_id is None:
        raise CourseError(f"{folder}: its tokenizer has no eos token, which separates documents: set one "
                          f"(tokenizer.eos_token = ...) and save it with tokenizer.save_pretrained")
    return tokenizer


def check_seq_len(seq_len: int, config) -> None:
    """Blocks no longer than the positions the model was built for."""
    if seq_len > config.max_position_embeddings:
        raise CourseError(f"--seq-len {seq_len} is above the model's max_position_embeddings "
                          f"({config.max_position_embeddings}): at most {config.max_position_embeddings}")


def cache_key(paths, folder, tokenizer, seq_len: int) -> str:
    """sha256 of the files' bytes (in order), the tokenizer's files and seq_len: a change in any, a new cache."""
    digest = hashlib.sha256(f"{FORMAT} seq_len {seq_len}".encode())
    names = sorted({"tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    *tokenizer.vocab_files_names.values()})  # what AutoTokenizer reads from the folder
    for path in [*map(check_file, paths), *(Path(folder, name) for name in names if Path(folder, name).is_file())]:
        digest.update(f"{path.stat().st_size} bytes:".encode())
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()[:20]


def pieces(document: str) -> list[str]:
    """The document cut at the first line end after every CHUNK_CHARS characters ([""] for an empty one)."""
    cuts = [0]
    while cuts[-1] < len(document):
        cuts.append(document.find("\n", cuts[-1] + CHUNK_CHARS) + 1 or len(document))
    return [document[a:b] for a, b in zip(cuts, cuts[1:])] or [""]


def chunks(documents: list[str]) -> Iterator[list[tuple[str, bool]]]:
    """Lists of (piece, whether it ends its document) of about CHUNK_CHARS characters, a tokenizer call each. A
    tokenizer may split the first word of a document's later pieces unlike in one call."""
    chunk, size = [], 0
    for document in documents:
        cut = pieces(document)
        for i, piece in enumerate(cut):
            chunk.append((piece, i == len(cut) - 1))
            size += len(piece)
            if size >= CHUNK_CHARS:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def tokenize(paths, tokenizer) -> tuple[torch.Tensor, int]:
    """(every token, each document followed by EOS, as one LongTensor; the number of documents)."""
    parts, documents = [], 0
    for path in paths:
        texts = read_documents(path)
        documents += len(texts)
        steps = list(chunks(texts))
        for chunk in progress_bar(steps, f"tokenizing {Path(path).name}"):
            encoded = tokenizer([piece for piece, _ in chunk], add_special_tokens=False, verbose=False)["input_ids"]
            ids = []
            for piece_ids, (_, ends) in zip(encoded, chunk):
                ids += piece_ids + [tokenizer.eos_token_id] * ends
            parts.append(torch.tensor(ids, dtype=torch.long))
    return torch.cat(parts), documents


def next_token_loss(logits, tokens) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the loss to backward, this rank's loss sum, the global count of real targets) of logits [b, seq_len - 1, V]
    from `tokens.clamp(min=0)[:, :-1]`. The sum ignores the padding's -100s; the count is all_reduced (a collective,
    every step on every rank) and the loss is the sum x W / count, as FSDP2 averages gradients over the W ranks
    (ReduceOp.AVG: torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): the gradient of the step's mean over
    every rank's real targets. An all-padding batch adds 0 (a mean over its zero targets would be nan)."""
    targets = tokens[:, 1:]
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    count = (targets != IGNORE).sum()
    dist.all_reduce(count)  # every rank's real targets this step
    return loss_sum * dist.get_world_size() / count, loss_sum.detach(), count


class TrainBlocks(TensorDataset):
    """The training blocks, and one index more, len(self): PaddedSampler's padding, a block of IGNORE (-100)."""

    def __getitem__(self, index):
        if index == len(self):
            return (torch.full_like(self.tensors[0][0], IGNORE),)
        return super().__getitem__(index)


def text_blocks(paths, folder, seq_len: int, val_fraction: float, cache_dir, is_main: bool, barrier,
                world_size: int):
    """(train TrainBlocks, validation TensorDataset, a summary line). Each yields (tokens,), a LongTensor [seq_len]
    per block; validation is the last val_fraction of the blocks (at least one). `barrier` (dist.barrier, or None
    in one process) lets the main rank write the cache before the others read it: cache_dir must be shared."""
    if seq_len < 2:
        raise CourseError(f"seq_len {seq_len}: at least 2 (a block holds inputs and their next tokens)")
    if not 0 < val_fraction < 1:
        raise CourseError(f"val_fraction {val_fraction}: between 0 and 1 (the share of blocks held out)")
    tokenizer = load_tokenizer(folder)  # on every rank: a bad folder is one line everywhere
    cache = Path(cache_dir) / f"text-{cache_key(paths, folder, tokenizer, seq_len)}.pt"
    cached, failure = cache.is_file(), None
    if barrier:
        barrier()  # every rank has looked for the cache before the main rank writes it
    if is_main and not cached:
        try:
            ids, documents = tokenize(paths, tokenizer)
            blocks = len(ids) // seq_len  # the remainder, shorter than a block, is dropped
            atomic_save({"blocks": ids[:blocks * seq_len].view(blocks, seq_len).clone(), "documents": documents,
                         "tokens": len(ids)}, cache)
        except Exception as exc:  # the others must not wait for a file that never comes: raised after the barrier
            failure = exc
    if barrier:
        barrier()
    if failure is not None:
        raise failure
    if not cache.is_file():
        raise CourseError(f"{cache} is missing after the main rank tokenized: see its error; the cache folder must "
                          f"be one that every rank sees (a shared file system)")
    data = torch.load(cache, weights_only=True, mmap=True)  # mapped: the ranks of a node share its pages
    blocks = data["blocks"]
    n = len(blocks)
    held_out = max(1, int(n * val_fraction))
    if n - held_out < world_size:
        need = next(k for k in itertools.count(world_size + 1) if k - max(1, int(k * val_fraction)) >= world_size)
        raise CourseError(f"{', '.join(map(str, paths))}: {data['tokens']} tokens make {n} blocks of {seq_len}, "
                          f"{max(0, n - held_out)} for training: fewer than one per rank ({world_size}); give at "
                          f"least {need * seq_len} tokens (more text, a shorter seq_len or fewer ranks)")
    train, val = TrainBlocks(blocks[:n - held_out]), TensorDataset(blocks[n - held_out:])
    dropped = data["tokens"] - n * seq_len
    summary = (f"text: {data['documents']} documents, {data['tokens']} tokens (an EOS after each) -> {n} blocks of "
               f"{seq_len} ({len(train)} train / {len(val)} validation), the last {dropped} tokens dropped"
               f"{' (cached)' if cached else ''}: {cache}")
    return train, val, summary


class PaddedSampler(Sampler[int]):
    """Every training block exactly once per epoch, to one rank, and the same number of items on every rank (FSDP2
    runs each forward on all ranks): shuffled by (seed, epoch), rank r takes items r, r + W, ...; shards one short
    get the padding index n, whose block (TrainBlocks) is all IGNORE. The loop feeds `tokens.clamp(min=0)[:, :-1]`
    as input_ids and takes its loss from next_token_loss, which ignores the padding's targets."""

    def __init__(self, data_source: Sized | int, num_replicas: int | None = None, rank: int | None = None,
                 seed: int = 0):
        self.n = data_source if isinstance(data_source, int) else len(data_source)
        self.num_replicas = get_world_size() if num_replicas is None else num_replicas
        self.rank = get_rank() if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is outside 0..{self.num_replicas - 1}")
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        order += [self.n] * (len(self) * self.num_replicas - self.n)  # the padding, at the end: the last ranks'
        return iter(order[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return math.ceil(self.n / self.num_replicas)
