"""Lesson 08, exercise 2: export the sharded model in bfloat16 and in float32: what does each cost, what does each keep?

    python 08_your_model/solutions/export_dtype.py

Two gloo ranks build the lesson's model (configs/digits_lm.json, --seed 1's initial weights), sharded, and run a
fixed input through it in float32. hf_export.export then writes it twice, every rank its own part (no gather):
--export-dtype float32 and bfloat16. A plain from_pretrained of each folder, in float32, runs the same input.
float32 keeps the master weights bit for bit: the same logits. bfloat16 keeps 8 bits of mantissa (float32: 24), so
each weight moves by up to 2^-9 of itself and the logits move with them, in return for half the bytes: what a GPU
loads for inference anyway, and not what a run that continues training should start from.
"""
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

from common.launcher import launch  # noqa: E402

DTYPES = ("float32", "bfloat16")


def export_both(folder: str):
    """On each rank: the sharded model, its float32 logits, both exports; rank 0 reloads and compares."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from digits_lm import DEFAULT_CONFIG, read_config
    from hf_export import export
    from hf_shards import build_model, init_weights

    hf_logging.disable_progress_bar()
    dist.init_process_group("gloo")
    config = read_config(Path(__file__).resolve().parents[2] / DEFAULT_CONFIG, "--model-config")
    model = build_model(config, init_device_mesh("cpu", (dist.get_world_size(),)), torch.float32)
    model.to_empty(device="cpu")
    init_weights(model, config, seed=1)
    tokens = torch.arange(2 * 197).remainder(26).reshape(2, 197)
    with torch.no_grad():
        sharded = model(input_ids=tokens).logits
    for dtype in DTYPES:
        export(model, config, f"{folder}/{dtype}", getattr(torch, dtype))
    found = {}
    if dist.get_rank() == 0:
        for dtype in DTYPES:
            files = sum(p.stat().st_size for p in Path(folder, dtype).glob("*.safetensors"))
            plain = AutoModelForCausalLM.from_pretrained(f"{folder}/{dtype}", dtype=torch.float32).eval()
            with torch.no_grad():
                diff = (plain(input_ids=tokens).logits - sharded).abs().max().item()
            found[dtype] = (files, diff)
    dist.destroy_process_group()
    return found


def main():
    with tempfile.TemporaryDirectory() as folder:
        found = launch(export_both, nprocs=2, args=(folder,), timeout_s=240)[0]
    for dtype, (files, diff) in found.items():
        print(f"--export-dtype {dtype:8}: {files:,} bytes of safetensors, max |logits - the sharded model's| {diff:.1e}")
    print(f"bfloat16 / float32 bytes: {found['bfloat16'][0] / found['float32'][0]:.3f}")


if __name__ == "__main__":
    main()
