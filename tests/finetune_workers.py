"""Workers for tests/test_finetune_text.py: lesson 08's --clip-grad on FSDP2's sharded gradients, on CPU with gloo.

In a module so that common.launcher's spawned processes can import them."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "08_your_model"))

from hf_shards import build_model, init_weights  # noqa: E402
from schedule import clip_gradients  # noqa: E402
from text_data import next_token_loss  # noqa: E402

MAX_NORM = 0.01  # far below the norm of a random model's first gradients: every gradient is scaled


def tiny_llama():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def clip_on_shards(batch_size: int, seq_len: int):
    """One backward of the global batch split over the ranks, then clip_gradients: (the norm it returned, the
    clipped gradients gathered) on rank 0, and one process's norm and clipped gradients of the whole batch."""
    from transformers import LlamaForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = tiny_llama()
    model = build_model(config, init_device_mesh("cpu", (world,)), torch.float32)
    model.to_empty(device="cpu")
    init_weights(model, config, seed=3)
    tokens = torch.randint(config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(5))
    mine = tokens.chunk(world)[rank]
    loss, _, _ = next_token_loss(model(input_ids=mine[:, :-1], use_cache=False).logits, mine)
    loss.backward()
    norm = clip_gradients(model, MAX_NORM)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}  # a collective per tensor
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    dist.destroy_process_group()
    if rank != 0:
        return None
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(full)
    logits = plain(input_ids=tokens[:, :-1], use_cache=False).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    plain_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM).item()
    plain_grads = dict(plain.named_parameters())
    worst = max((grads[name] - plain_grads[name].grad).abs().max().item()
                for name in grads)
    return {"norm": norm, "plain_norm": plain_norm, "grad_diff": worst,
            "clipped_norm": torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()}
