"""Lesson 08's own text model (08_your_model/text_model.py): a BPE tokenizer trained on the course's pages and a
random decoder in several safetensors files, which AutoTokenizer and AutoModelForCausalLM load and `generate` runs
on; the same files again from the same seed; a bad --out is one line."""
import subprocess
import sys
from pathlib import Path

import torch

from lessons import ROOT, assert_clean

SCRIPT = ROOT / "08_your_model" / "text_model.py"


def make(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=300)


def test_the_folder_loads_and_generates_and_is_the_same_from_the_same_seed(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    proc = make("--out", tmp_path / "a")
    assert_clean(proc)
    assert proc.stdout.startswith(f"wrote {tmp_path / 'a'}: a BPE tokenizer of 4096 tokens") and \
        proc.stdout.count("\n") == 1 and proc.stderr == "", proc.stdout + proc.stderr
    files = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert len(files) > 1 and f"in {len(files)} safetensors files" in proc.stdout  # read shard by shard
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a", local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a", local_files_only=True).eval()
    assert len(tokenizer) == model.config.vocab_size == 4096
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    text = "FSDP2 shards each decoder layer"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert tokenizer.decode(ids[0]) == text  # byte-level: nothing is unknown
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 5) and torch.equal(out[0, :ids.shape[1]], ids[0])
    assert_clean(make("--out", tmp_path / "b"))
    for path in (tmp_path / "a").iterdir():
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name


def test_an_out_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    proc = make("--out", tmp_path / "file")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "is a file, not a folder: pick a folder you can write to" in proc.stderr
