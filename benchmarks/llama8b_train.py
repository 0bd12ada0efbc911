r"""The course's side of the 8 B benchmark: benchmarks/llm.py's run (lesson 08's model class, a LlamaForCausalLM
sharded with FSDP2 as digits_lm.py shards it, synthetic copy-task tokens) on any config.json and sequence length.

llm.py's suites train fixed shapes at 2048 tokens; this takes --config and --seq (e.g. Llama-3-8B at 8192) and the
same knobs: --ac (checkpoint_wrapper per decoder layer: will_it_fit.py's fsdp2-ac), --compile (each decoder layer and
the loss), --float8 (torchao's recipe on the Linears but lm_head). One JSON row per launch from rank 0: tokens/s per
GPU, MFU, peak allocated and reserved memory, or the out-of-memory error. From the course folder:
    torchrun --standalone --nproc_per_node=4 benchmarks/llama8b_train.py \
        --config 08_your_model/configs/llama3_8b.json --seq 8192 --batch 5 --ac --compile
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/llama8b_train.py \
        --config benchmarks/llama3_tiny.json --seq 32 --batch 2 --ac --compile --steps 2 --warmup 1
"""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "08_your_model")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from benchmarks import llm  # noqa: E402
from common.cli import Parser, positive_int  # noqa: E402
from common.distributed import init_timeout, launch_env, pick_device, restart_safe_store  # noqa: E402
from common.errors import CourseError  # noqa: E402
from common.exits import run  # noqa: E402
from hf_config import read_config  # noqa: E402


def model_config(path: str, seq: int):
    """The config.json, as llm.config() sets its shapes: sdpa attention, no KV cache, untied lm_head as given."""
    cfg = read_config(path, "--config")
    if seq > cfg.max_position_embeddings:
        raise CourseError(f"--seq {seq}: longer than the config's max_position_embeddings "
                          f"{cfg.max_position_embeddings}: lower --seq")
    cfg._attn_implementation, cfg.use_cache = "sdpa", False
    return cfg


def main(argv=None):
    p = Parser(description="Lesson 08's FSDP2 Llama on any config and sequence length: tokens/s per GPU, memory")
    p.add_argument("--config", required=True, help="a decoder's config.json, e.g. 08_your_model/configs/llama3_8b.json")
    p.add_argument("--seq", type=positive_int, default=8192, help="tokens per sequence (default: 8192)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per GPU and step (default: 1)")
    p.add_argument("--ac", action="store_true", help="checkpoint_wrapper per decoder layer (fsdp2-ac)")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer and the loss")
    p.add_argument("--float8", choices=["tensorwise", "rowwise"], help="torchao float8 Linears (H100/H200, torchao)")
    p.add_argument("--warmup", type=positive_int, default=3, help="untimed steps (default: 3)")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps (default: 10)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="(default: auto)")
    args = p.parse_args(argv)
    cfg = model_config(args.config, args.seq)
    env = launch_env()
    device = pick_device(args.device, env)
    if args.float8 and device.type != "cuda":
        raise CourseError("--float8: torchao's float8 Linears need an H100 or H200: leave it out on the CPU")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.fp32_precision = "tf32"  # as benchmarks/launch.py's runs
    dist.init_process_group(backend=dist.get_default_backend_for_device(device), timeout=init_timeout(),
                            rank=env.rank, world_size=env.world_size, store=restart_safe_store(env),
                            device_id=device if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    L = SimpleNamespace(device=device, rank=dist.get_rank(), world=dist.get_world_size(), gpu=gpu, quick=False)
    setup = llm.Setup(Path(args.config).stem, args.batch, strategy="fsdp2-ac" if args.ac else "fsdp2",
                      compile=args.compile, loss_compile=args.compile, reshard_last=False, float8=args.float8,
                      warmup=args.warmup, steps=args.steps)
    row = {"what": "llama8b_train", "config": args.config, "seq": args.seq, "gpus": L.world, "device_name": gpu,
           **{k: v for k, v in vars(setup).items() if k != "shape"}}
    llm.clean(device)
    try:  # llm.train's own catch: an out-of-memory run is a row too
        row.update(llm._run(setup, cfg, args.seq, L, mesh, 1, None, None), outcome="trained", **llm.memory(device))
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}".split("\n")[0][:300]
        row.update(outcome="out of memory" if "out of memory" in text.lower() else "failed", error=text,
                   **llm.memory(device))
    if "tokens_per_s" in row:
        per_token, peak = llm.flops_per_token(cfg, args.seq), llm.flops.peak_flops(gpu)
        row.update(flops_per_token=per_token, mfu=per_token * row["tokens_per_s"] / peak if peak else None)
    if L.rank == 0:
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
