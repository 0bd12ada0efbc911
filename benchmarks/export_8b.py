r"""Lesson 08's export timed on a large model: load a save_pretrained folder (hf_shards.load_pretrained), train a few
steps (so the export is not the folder read), export without gathering (hf_export.export: DCP's
HuggingFaceStorageWriter, consolidated on rank 0), then check from_pretrained's logits of the export against the
sharded model's. One JSON row (rank 0): export_s, peak host RSS of each rank during the export (VmHWM, reset before
it through /proc/self/clear_refs), peak GPU memory, from_pretrained's seconds and the logits' max abs diff against
generate.py's tolerance (1e-4, or 0.02 for a bfloat16 export of float32 compute). From the course folder:
    torchrun --standalone --nproc_per_node=4 benchmarks/export_8b.py --folder /tmp/llama8b --out /tmp/llama8b_export
"""
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "08_your_model")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from benchmarks import llm  # noqa: E402
from benchmarks.load_ways import GIB, PROMPT, across_ranks, peak_rss  # noqa: E402
from common.cli import Parser, count, positive_int  # noqa: E402
from common.distributed import init_timeout, launch_env, pick_device, restart_safe_store  # noqa: E402
from common.errors import CourseError  # noqa: E402
from common.exits import run  # noqa: E402
from common.files import creatable_folder  # noqa: E402
from generate import EXACT, LOSSY  # noqa: E402
from hf_config import read_config  # noqa: E402
from hf_export import export  # noqa: E402
from hf_shards import build_model, load_pretrained  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def reset_peak_rss() -> None:
    """VmHWM := the current RSS (Linux's clear_refs 5): the peak that follows is the export's own."""
    Path("/proc/self/clear_refs").write_text("5")


def main(argv=None):
    p = Parser(description="Time lesson 08's export (no gathering) of a large model; check from_pretrained's logits")
    p.add_argument("--folder", required=True, help="a save_pretrained folder (benchmarks/llama_folder.py writes one)")
    p.add_argument("--out", required=True, metavar="DIR", help="the export's folder")
    p.add_argument("--steps", type=count, default=1, help="AdamW steps before the export (default: 1)")
    p.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence of those steps (default: 128)")
    p.add_argument("--export-dtype", choices=list(DTYPES), default="bfloat16", help="(default: bfloat16)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="(default: auto)")
    args = p.parse_args(argv)
    config = read_config(args.folder, "--folder")
    if problem := creatable_folder(args.out):
        raise CourseError(f"--out {args.out}: {problem}: pick a folder you can write to")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    env = launch_env()
    device = pick_device(args.device, env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=dist.get_default_backend_for_device(device), timeout=init_timeout(),
                            rank=env.rank, world_size=env.world_size, store=restart_safe_store(env),
                            device_id=device if device.type == "cuda" else None)
    rank = dist.get_rank()
    model = build_model(config, init_device_mesh(device.type, (dist.get_world_size(),)), torch.bfloat16)
    model.to_empty(device=device)
    began = time.perf_counter()
    load_pretrained(model, config, args.folder)
    load_s = time.perf_counter() - began
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for step in range(args.steps):  # the copy-task tokens of benchmarks/llm.py
        batch = llm.tokens(config.vocab_size, 1, args.seq, 1, step, rank, device)
        model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del optimizer
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), use_cache=False).logits.float().cpu()
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = across_ranks(peak_rss(), device)
    dist.barrier()
    began = time.perf_counter()
    export(model, config, args.out, DTYPES[args.export_dtype], extras=tokenizer.save_pretrained)
    export_s = time.perf_counter() - began
    rss = across_ranks(peak_rss(), device)
    gpu = across_ranks(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0, device)
    if rank == 0:
        began = time.perf_counter()
        theirs_model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16).to(device).eval()
        from_pretrained_s = time.perf_counter() - began
        with torch.no_grad():
            theirs = theirs_model(input_ids=ids.to(device), use_cache=False).logits.float().cpu()
        del theirs_model
        diff = (theirs - logits).abs().max().item()
        tolerance = EXACT if args.export_dtype == "bfloat16" else LOSSY  # bf16 compute: a bf16 export is exact
        files = sorted(Path(args.out).glob("*.safetensors"))
        print(json.dumps({"what": "export_8b", "ranks": dist.get_world_size(), "device": device.type,
                          "parameters": sum(q.numel() for q in model.parameters()), "load_s": round(load_s, 2),
                          "steps": args.steps, "export_dtype": args.export_dtype, "export_s": round(export_s, 2),
                          "files": len(files), "bytes": sum(f.stat().st_size for f in files),
                          "export_peak_rss_gib_per_rank": [round(r / GIB, 2) for r in rss],
                          "rss_before_export_gib_per_rank": [round(r / GIB, 2) for r in rss_before],
                          "export_peak_gpu_gib_max": round(max(gpu) / GIB, 2) if device.type == "cuda" else None,
                          "from_pretrained_s": round(from_pretrained_s, 2), "logits_max_abs_diff": diff,
                          "tolerance": tolerance, "same_model": diff <= tolerance}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
