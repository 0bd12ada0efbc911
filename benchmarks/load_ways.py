r"""A save_pretrained folder into an FSDP2-sharded model, one of four ways per launch; one JSON row each.

  a  lesson 08's --pretrained loader (hf_shards.load_pretrained): the model on meta, sharded, then every rank reads
     only its own rows of each tensor (safetensors slices)
  b  DCP's HuggingFaceStorageReader: the same sharded model's get_model_state_dict(), filled by dcp.load
  c  rank 0 from_pretrained, the others nothing; set_model_state_dict(full_state_dict=True,
     broadcast_from_rank0=True) into the sharded model (accelerate's cpu_ram_efficient_loading way)
  d  as a newcomer writes it: from_pretrained on every rank, then fully_shard per decoder layer and the root
a, b and c build lesson 08's model (hf_shards.build_model: fp32 master weights, bf16 compute); d the same class
(LlamaForCausalLM, from_pretrained in float32) with the same MixedPrecisionPolicy: four ways to one trainable state.
The row: load_s (the slowest rank, from a barrier to a loaded model), peak host RSS (VmHWM) of each rank, peak GPU
memory (cuda), and the logits of a fixed prompt (the folder's tokenizer), saved as --out/logits_<way>.pt and compared
(max abs diff) with those of the ways already in --out. From the course folder, one launch per way:
    for w in a b c d; do torchrun --standalone --nproc_per_node=4 benchmarks/load_ways.py \
        --folder /tmp/llama8b --way $w --out /tmp/load_ways; done
"""
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "08_your_model")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import HuggingFaceStorageReader  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, \
    set_model_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

from common.cli import Parser  # noqa: E402
from common.distributed import init_timeout, launch_env, pick_device, restart_safe_store  # noqa: E402
from common.errors import CourseError  # noqa: E402
from common.exits import run  # noqa: E402
from hf_config import read_config  # noqa: E402
from hf_shards import build_model, decoder_layers, fill_buffers, load_pretrained, meta_model, \
    stored_tensors  # noqa: E402

WAYS = {"a": "lesson 08 load_pretrained (own rows)", "b": "DCP HuggingFaceStorageReader",
        "c": "rank 0 from_pretrained + broadcast_from_rank0", "d": "from_pretrained on every rank + fully_shard"}
PROMPT = "Distributed training splits one model over many GPUs, and each rank holds its shard."
GIB = 2 ** 30


def peak_rss() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise CourseError("no VmHWM in /proc/self/status: this script measures host memory on Linux only")


def from_pretrained(folder):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # no "Loading weights" bar
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def load(way: str, config, folder: str, mesh, device):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if way == "d":
        model = from_pretrained(folder)  # the whole model in this rank's host memory
        for parent, name in decoder_layers(model):
            fully_shard(getattr(parent, name), mesh=mesh, mp_policy=policy)  # moves it to the mesh's device
        return fully_shard(model, mesh=mesh, mp_policy=policy)
    model = build_model(config, mesh, torch.bfloat16)  # lesson 08's: meta, one unit per layer, then the root
    model.to_empty(device=device)
    if way == "a":
        load_pretrained(model, config, folder)
        return model
    if way == "b":
        state = get_model_state_dict(model)  # this rank's shards (DTensors), read into in place
        dcp.load(state, storage_reader=HuggingFaceStorageReader(folder))
        set_model_state_dict(model, state)
    else:
        full = from_pretrained(folder).state_dict() if dist.get_rank() == 0 else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
    fill_buffers(model, meta_model(config))  # RoPE's inv_freq: in no checkpoint (hf_shards.py)
    return model


def across_ranks(value: float, device) -> list[float]:
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [x.item() for x in out]


def main(argv=None):
    p = Parser(description="Load a save_pretrained folder into an FSDP2 model one of four ways: a JSON row")
    p.add_argument("--folder", required=True, help="a save_pretrained folder (benchmarks/llama_folder.py writes one)")
    p.add_argument("--way", required=True, choices=list(WAYS), help="; ".join(f"{k}: {v}" for k, v in WAYS.items()))
    p.add_argument("--out", required=True, metavar="DIR", help="logits_<way>.pt here; compared with the others there")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="(default: auto)")
    args = p.parse_args(argv)
    config = read_config(args.folder, "--folder")
    stored_tensors(Path(args.folder))  # a one-line error if it holds no safetensors
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(args.folder)(PROMPT, return_tensors="pt").input_ids
    env = launch_env()
    device = pick_device(args.device, env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=dist.get_default_backend_for_device(device), timeout=init_timeout(),
                            rank=env.rank, world_size=env.world_size, store=restart_safe_store(env),
                            device_id=device if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    rss_before = peak_rss()
    dist.barrier()
    began = time.perf_counter()
    model = load(args.way, config, args.folder, mesh, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    seconds = time.perf_counter() - began
    rss = across_ranks(peak_rss(), device)
    gpu = across_ranks(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0, device)
    model.eval()
    with torch.no_grad():  # every rank: FSDP2 gathers each unit inside forward
        logits = model(input_ids=ids.to(device), use_cache=False).logits.float().cpu()
    if dist.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(logits, out / f"logits_{args.way}.pt")
        diffs = {f.stem[-1]: (logits - torch.load(f)).abs().max().item() for f in sorted(out.glob("logits_?.pt"))
                 if f.stem[-1] != args.way}
        print(json.dumps({"what": "load_ways", "way": args.way, "how": WAYS[args.way], "ranks": dist.get_world_size(),
                          "device": device.type, "parameters": sum(p.numel() for p in model.parameters()),
                          "load_s": round(seconds, 2), "peak_rss_gib_max": round(max(rss) / GIB, 2),
                          "peak_rss_gib_per_rank": [round(r / GIB, 2) for r in rss],
                          "rss_before_gib": round(rss_before / GIB, 2),
                          "peak_gpu_gib_max": round(max(gpu) / GIB, 2) if device.type == "cuda" else None,
                          "prompt_tokens": ids.shape[1], "logits_abs_max": logits.abs().max().item(),
                          "logits_max_abs_diff": diffs}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
