"""docs/strategy.md's bytes per parameter (FSDP2 with bf16 gathers and in fp32, DDP) are what the collectives receive
in one training step of lesson 08's model on 2 gloo ranks (make test-slow: about 15 s)."""
import math
import re
import sys

import torch

from common.launcher import launch
from lessons import ROOT
from test_strategy import table


def bytes_worker() -> dict:
    """Rank r of 2: one training step of lesson 08's model (hf_shards.build_model: bf16 gathers, fp32 reduction, then
    all fp32), each collective's payload added up by lesson 06's ByteCounter; DDP's all-reduce by a comm hook."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaConfig, LlamaForCausalLM
    sys.path[:0] = [str(ROOT / "08_your_model"), str(ROOT / "06_tensor_parallel")]
    from comm_bytes import ByteCounter
    from hf_shards import build_model, init_weights

    dist.init_process_group("gloo")
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # every row count even: no padding on 2 ranks
    ids = torch.arange(2 * 16).remainder(64).reshape(2, 16)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = build_model(config, init_device_mesh("cpu", (2,)), dtype)
        model.to_empty(device="cpu")
        init_weights(model, config, seed=0)
        with ByteCounter() as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        out[str(dtype)] = counter.bytes
    ddp, buckets = DistributedDataParallel(LlamaForCausalLM(config)), []

    def counting(state, bucket):
        buckets.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting)
    with torch.autocast("cpu", torch.bfloat16):
        loss = ddp(input_ids=ids, labels=ids).loss
    loss.backward()
    names = [(n, p.numel()) for n, p in ddp.module.named_parameters()]
    dist.destroy_process_group()
    return {**out, "ddp": sum(buckets), "layers": sum(k for n, k in names if ".layers." in n),
            "root": sum(k for n, k in names if ".layers." not in n)}


def test_the_bytes_per_parameter_are_what_the_collectives_receive():
    """Each cell's factor of (N-1)/N: the payload per parameter (an all-reduce's twice: its ring sends it twice)."""
    measured = launch(bytes_worker, nprocs=2, timeout_s=240)[0]
    layer, root, ddp, fp32 = [[math.prod(int(f) for f in re.findall(r"(\d+)(?= x| \(N-1\)/N)", cell.split(":")[-1]))
                               if cell != "-" else 0 for cell in row[1:]]
                              for row in table("| per parameter | all-gather, forward | all-gather, backward | "
                                               "gradients | on the wire per rank |")]
    layers, outside = measured["layers"], measured["root"]
    total = layers + outside
    assert measured["torch.bfloat16"] == {"all_gather": (layer[0] + layer[1]) * layers + (root[0] + root[1]) * outside,
                                          "reduce_scatter": layer[2] * total} and root[2] == layer[2]
    assert measured["torch.float32"] == {"all_gather": (fp32[0] + fp32[1]) * layers + fp32[0] * outside,
                                         "reduce_scatter": fp32[2] * total}  # its root: gathered once too
    assert measured["ddp"] == ddp[2] // 2 * total
    assert all(sum(r[:3]) == r[3] for r in (layer, root, ddp, fp32)) and layer[3] == ddp[3] == 8 and fp32[3] == 12
