r"""Lesson 08: the course's own small text model, no download: a BPE tokenizer trained on the course's Markdown pages
and a random decoder beside it, one save_pretrained folder that --pretrained and text_data.py read.

These files prove the mechanics (a tokenizer that AutoTokenizer loads, weights in several safetensors files that
hf_shards.py reads shard by shard, generate), not quality: the decoder is random and small, the tokenizer has seen
a few hundred kilobytes of text. Deterministic: the same pages and --seed give the same files.
From the course folder:
    python 08_your_model/text_model.py --out runs/08_text_model
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

from common.cli import Parser, count, positive_int
from common.errors import CourseError
from common.exits import run
from common.files import creatable_folder, work_in_course_folder

COURSE = Path(__file__).resolve().parents[1]
SKIP = {".venv", ".venv-floor", "runs", "data", "build", "node_modules"}  # not the course's own pages
SPECIAL = {"pad_token": "<|pad|>", "bos_token": "<|bos|>", "eos_token": "<|eos|>"}
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
SHARD = "1MB"  # save_pretrained's max_shard_size: the embedding and lm_head (~1 MB each) land in files of their own


def course_pages() -> list[Path]:
    """Every Markdown page of the course, in a fixed order (the tokenizer depends on it)."""
    return sorted(p for p in COURSE.rglob("*.md")
                  if not SKIP.intersection(p.relative_to(COURSE).parts[:-1])
                  and not any(part.startswith(".") for part in p.relative_to(COURSE).parts))


def train_tokenizer(pages: list[Path], vocab_size: int):
    """A byte-level BPE (GPT-2's scheme: any text encodes, nothing is unknown), as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator((p.read_text(encoding="utf-8") for p in pages), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=SHAPE["max_position_embeddings"],
                                   **SPECIAL)


def write(out, vocab_size: int = 4096, seed: int = 0) -> str:
    """Tokenizer and random decoder into `out`; returns the line that says what was written."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar
    pages = course_pages()
    tokenizer = train_tokenizer(pages, vocab_size)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SHAPE)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # transformers' random initialisation, from the seed
    Path(out).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, max_shard_size=SHARD)
    files = len(list(Path(out).glob("*.safetensors")))
    parameters = sum(p.numel() for p in model.parameters())
    return (f"wrote {out}: a BPE tokenizer of {len(tokenizer)} tokens trained on the course's {len(pages)} Markdown "
            f"pages, and a random llama decoder ({parameters / 1e6:.2f} M parameters, {SHAPE['num_hidden_layers']} "
            f"layers, {SHAPE['max_position_embeddings']} positions) in {files} safetensors files: mechanics, not "
            f"quality")


def main(argv=None):
    work_in_course_folder()  # a relative --out is the course folder's
    p = Parser(description="Lesson 08: a small tokenizer and a random decoder from the course's own pages")
    p.add_argument("--out", required=True, metavar="DIR", help="the save_pretrained folder to write")
    p.add_argument("--vocab-size", type=positive_int, default=4096, help="BPE's vocabulary (default: 4096)")
    p.add_argument("--seed", type=count, default=0, help="the decoder's random weights (default: 0)")
    args = p.parse_args(argv)
    if problem := creatable_folder(args.out):
        raise CourseError(f"--out {args.out}: {problem}: pick a folder you can write to")
    if args.vocab_size < 256 + len(SPECIAL):
        raise CourseError(f"--vocab-size {args.vocab_size}: a byte-level BPE needs at least {256 + len(SPECIAL)} "
                          f"(256 bytes and {len(SPECIAL)} special tokens)")
    print(write(args.out, args.vocab_size, args.seed), flush=True)


if __name__ == "__main__":
    run(main)
