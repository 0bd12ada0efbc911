"""Lesson 08's notebook (your_model.ipynb): what each rank does and sees when a Hugging Face folder is loaded into
an FSDP2 model shard by shard. The workers live here because the notebook's launcher (common/launcher.py) starts
fresh processes, which cannot import a function defined in a notebook.

    write_folder(folder)      a small random Qwen2 (q/k/v biases, tied embeddings), save_pretrained in 3 files
    shards(folder)            on each rank: built on meta, fully_shard per decoder layer, this rank's shapes
    load_and_compare(folder)  on each rank: read its own rows (hf_shards.load_pretrained), logits vs from_pretrained
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common`
sys.path.insert(1, str(Path(__file__).resolve().parent))  # this folder: hf_shards, digits_lm

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.utils import logging as hf_logging

from hf_shards import build_model, load_pretrained

SHAPE = dict(vocab_size=43, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
SHOWN = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
         "model.layers.0.self_attn.k_proj.weight", "model.norm.weight")
INPUT = torch.arange(2 * 24).remainder(43).reshape(2, 24)  # 2 sequences of 24 tokens


def write_folder(folder) -> list[str]:
    """A random Qwen2, every tensor moved off its initial value, written by save_pretrained in files of <= 20 KB."""
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, max_shard_size="20KB")
    return sorted(p.name for p in Path(folder).iterdir())


def sharded(folder):
    """This rank's process group and its model: on meta, one FSDP2 unit per decoder layer, then the root."""
    dist.init_process_group("gloo")
    config = Qwen2Config.from_pretrained(folder)
    return config, build_model(config, init_device_mesh("cpu", (dist.get_world_size(),)), torch.float32)


def shards(folder) -> None:
    config, model = sharded(folder)
    rank, world = dist.get_rank(), dist.get_world_size()
    units = [name or "(the root)" for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    print(f"rank {rank}/{world}: {type(model).__name__} on the {next(model.parameters()).device} device, "
          f"FSDP2 units: {', '.join(units)}")
    params = dict(model.named_parameters())
    for name in SHOWN:
        p = params[name]
        print(f"  {name}: full {list(p.shape)}, mine {list(p.to_local().shape)}")
    mine = sum(p.to_local().numel() for p in model.parameters())
    print(f"  parameters: {sum(p.numel() for p in model.parameters()):,} in all, {mine:,} stored here; "
          f"lm_head is embed_tokens: {model.lm_head.weight is model.model.embed_tokens.weight}")
    dist.destroy_process_group()


def load_and_compare(folder) -> float:
    """Each rank reads its rows; the sharded model's logits against a plain from_pretrained model's (float32)."""
    hf_logging.disable_progress_bar()  # no "Loading weights" bar
    config, model = sharded(folder)
    model.to_empty(device="cpu")  # this rank's shards allocated, their values garbage
    print(f"rank {dist.get_rank()}: read {load_pretrained(model, config, folder)}")
    inv_freq = model.model.rotary_emb.inv_freq  # a non-persistent buffer: in no file, computed again
    with torch.no_grad():
        logits = model(input_ids=INPUT).logits  # every rank runs it: FSDP gathers each unit in turn
        plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        expected = plain(input_ids=INPUT).logits
    diff = (logits - expected).abs().max().item()
    print(f"rank {dist.get_rank()}: logits {list(logits.shape)}, max |sharded - from_pretrained| = {diff:.1e}; "
          f"RoPE inv_freq equal: {torch.equal(inv_freq, plain.model.rotary_emb.inv_freq)}")
    dist.destroy_process_group()
    return diff
