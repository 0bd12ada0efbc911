r"""A random-weight Hugging Face folder of any decoder config, fast: what from_pretrained, lesson 08's --pretrained
and benchmarks/load_ways.py read, without downloading a model.

The names and shapes come from AutoModelForCausalLM.from_config on the meta device (no memory); each tensor's values
are a slice, at a random offset, of one pool of 2**26 normal(0, 0.02) bf16 numbers (norm weights are 1): a 16 GB
folder is a copy, not 8 billion draws. Each shard file (the next tensors once one passes --shard-mb) is written in
the safetensors format directly (an 8-byte header length, the JSON header, the raw bytes), one tensor at a time: no
shard is ever whole in memory. Then model.safetensors.index.json, config.json (dtype bfloat16) and a small
byte-level BPE tokenizer (08_your_model/text_model.py's, trained on the course's pages) whose ids fit the vocabulary.
    python benchmarks/llama_folder.py --config 08_your_model/configs/llama3_8b.json --out /tmp/llama8b
    python benchmarks/llama_folder.py --config benchmarks/llama3_tiny.json --out /tmp/tiny --shard-mb 0.05 --tokenizer-vocab 512
"""
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "08_your_model")]

import torch  # noqa: E402

from common.cli import Parser, count, positive_float, positive_int  # noqa: E402
from common.errors import CourseError  # noqa: E402
from common.exits import run  # noqa: E402
from common.files import creatable_folder  # noqa: E402
from hf_config import read_config  # noqa: E402
from hf_shards import meta_model  # noqa: E402

POOL = 2 ** 26  # 128 MiB of bf16 random numbers


def shapes(config) -> dict[str, torch.Size]:
    """The tensors save_pretrained would store, in the model's order: a tied lm_head once, as the embedding."""
    model = meta_model(config)
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return {name: t.shape for name, t in model.state_dict().items() if name not in tied}


def values(name: str, shape, pool: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Norm weights 1 (as transformers initialises them); else a wrap-around slice of the pool at a random offset."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    n, start = shape.numel(), int(torch.randint(0, POOL, (), generator=g))
    flat = torch.empty(n, dtype=torch.bfloat16)
    done = 0
    while done < n:
        take = min(n - done, POOL - start)
        flat[done:done + take] = pool[start:start + take]
        done, start = done + take, 0
    return flat.view(shape)


def write_shard(path: Path, group, pool: torch.Tensor, g: torch.Generator) -> None:
    """A safetensors file, as safetensors.torch.save_file writes it (header padded with spaces to 8 bytes)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in group:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + 2 * shape.numel()]}
        offset += 2 * shape.numel()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, shape in group:
            f.write(values(name, shape, pool, g).view(torch.uint8).numpy().data)


def write(config, out: Path, shard_bytes: int, seed: int, tokenizer_vocab: int) -> dict:
    began = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(POOL, generator=g).mul_(config.initializer_range).to(torch.bfloat16)
    groups, size = [[]], 0
    for name, shape in shapes(config).items():  # a new file once the current one passes shard_bytes
        if groups[-1] and size + 2 * shape.numel() > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += 2 * shape.numel()
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        write_shard(out / file, group, pool, g)
        weight_map.update({name: file for name, _ in group})
        total += sum(2 * shape.numel() for _, shape in group)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    stored = type(config).from_dict(config.to_dict())
    stored.dtype = torch.bfloat16
    stored.save_pretrained(out)
    weights_s = time.perf_counter() - began
    from text_model import course_pages, train_tokenizer
    tokenizer = train_tokenizer(course_pages(), tokenizer_vocab)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    return {"what": "llama_folder", "out": str(out), "files": len(groups), "tensors": len(weight_map),
            "bytes": total, "parameters": total // 2, "weights_s": round(weights_s, 2),
            "total_s": round(time.perf_counter() - began, 2), "tokenizer_vocab": len(tokenizer)}


def main(argv=None):
    p = Parser(description="A random-weight save_pretrained folder (bf16 safetensors shards, config, tokenizer)")
    p.add_argument("--config", required=True, help="a decoder's config.json, e.g. 08_your_model/configs/llama3_8b.json")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    p.add_argument("--shard-mb", type=positive_float, default=5000, help="most MB per safetensors file (default: 5000)")
    p.add_argument("--seed", type=count, default=0, help="(default: 0)")
    p.add_argument("--tokenizer-vocab", type=positive_int, default=4096,
                   help="the BPE's vocabulary, at most the config's (default: 4096)")
    args = p.parse_args(argv)
    config = read_config(args.config, "--config")
    if problem := creatable_folder(args.out):
        raise CourseError(f"--out {args.out}: {problem}: pick a folder you can write to")
    if not 259 <= args.tokenizer_vocab <= config.vocab_size:
        raise CourseError(f"--tokenizer-vocab {args.tokenizer_vocab}: between 259 (256 bytes, 3 special tokens) and "
                          f"the config's vocab_size {config.vocab_size}")
    print(json.dumps(write(config, Path(args.out), int(args.shard_mb * 10 ** 6), args.seed, args.tokenizer_vocab)),
          flush=True)


if __name__ == "__main__":
    run(main)
