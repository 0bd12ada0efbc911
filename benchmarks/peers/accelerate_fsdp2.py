r"""Peer: Hugging Face accelerate's FSDP2 on the same LlamaForCausalLM, shape, data, batch and AC as
benchmarks/llama8b_train.py; one JSON row (rank 0): tokens/s per GPU and peak memory.

FullyShardedDataParallelPlugin(fsdp_version=2): a unit per LlamaDecoderLayer (transformer_based_wrap), the embedding
and the tail (final norm, lm_head) units of their own, the root; the same MixedPrecisionPolicy (bf16 params, fp32
reduce); --ac: its activation_checkpointing (checkpoint_wrapper per layer); --compile: TorchDynamoPlugin with
use_regional_compilation (each decoder layer; inductor on GPUs, aot_eager on the CPU). The data: llm.py's copy-task
tokens, the same per (seed, step, rank). Needs accelerate (python3 -m pip install --no-deps accelerate-*.whl).
    torchrun --standalone --nproc_per_node=4 benchmarks/peers/accelerate_fsdp2.py \
        --config 08_your_model/configs/llama3_8b.json --seq 8192 --batch 5 --ac --compile
"""
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "08_your_model")]

import torch  # noqa: E402

from benchmarks import llm  # noqa: E402
from benchmarks.llama8b_train import model_config  # noqa: E402
from common.cli import Parser, positive_int  # noqa: E402
from common.errors import CourseError  # noqa: E402
from common.exits import run  # noqa: E402


def main(argv=None):
    p = Parser(description="accelerate's FSDP2 on the HF LlamaForCausalLM: tokens/s per GPU and peak memory")
    p.add_argument("--config", required=True, help="a decoder's config.json, e.g. 08_your_model/configs/llama3_8b.json")
    p.add_argument("--seq", type=positive_int, default=8192, help="tokens per sequence (default: 8192)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per GPU and step (default: 1)")
    p.add_argument("--ac", action="store_true", help="the plugin's activation_checkpointing")
    p.add_argument("--compile", action="store_true", help="regional compilation of each decoder layer")
    p.add_argument("--warmup", type=positive_int, default=3, help="untimed steps (default: 3)")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps (default: 10)")
    args = p.parse_args(argv)
    cfg = model_config(args.config, args.seq)
    try:
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin, TorchDynamoPlugin
    except ImportError:
        raise CourseError("accelerate is not installed: python3 -m pip install --no-deps "
                          "benchmarks/peers/wheels/accelerate-*.whl") from None
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import LlamaForCausalLM
    cuda = torch.cuda.is_available()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        activation_checkpointing=args.ac, reshard_after_forward=True, state_dict_type="SHARDED_STATE_DICT")
    dynamo = TorchDynamoPlugin(backend="inductor" if cuda else "aot_eager", use_regional_compilation=True) \
        if args.compile else None
    acc = Accelerator(fsdp_plugin=plugin, dynamo_plugin=dynamo, cpu=not cuda)
    device = acc.device
    if cuda:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.manual_seed(0)
    with torch.device(device):  # as llm.build: the whole fp32 model on each device, then sharded by prepare
        model = LlamaForCausalLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                  **({"fused": True} if cuda else {"foreach": True}))
    model, optimizer = acc.prepare(model, optimizer)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    rank, losses = acc.process_index, []

    def step(i):
        ids = llm.tokens(cfg.vocab_size, args.batch, args.seq, 1, i, rank, device)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    began = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    llm.sync(device)
    warmup_s, began = time.perf_counter() - began, time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        step(i)
    llm.sync(device)
    seconds = time.perf_counter() - began
    row = {"what": "peer_accelerate_fsdp2", "config": args.config, "seq": args.seq, "batch": args.batch,
           "ac": args.ac, "compile": args.compile, "gpus": acc.num_processes,
           "device_name": torch.cuda.get_device_name(device) if cuda else "CPU",
           "parameters": sum(q.numel() for q in model.parameters()), "warmup_s": warmup_s,
           "step_s": seconds / args.steps, "tokens_per_s": args.batch * args.seq * args.steps / seconds,
           "losses": [float(x) for x in torch.stack(losses)], **llm.memory(device)}
    per_token, peak = llm.flops_per_token(cfg, args.seq), llm.flops.peak_flops(row["device_name"])
    row.update(flops_per_token=per_token, mfu=per_token * row["tokens_per_s"] / peak if peak else None)
    if acc.is_main_process:
        print(json.dumps(row), flush=True)
    acc.end_training()


if __name__ == "__main__":
    run(main)
