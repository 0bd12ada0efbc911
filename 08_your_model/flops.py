"""The FLOPs a decoder's training step costs per token, and the model FLOPs utilisation (MFU) they make on a GPU.

    6 N + 12 L a s   per token (forward 2 N + 4 L a s, backward twice that; Kaplan et al. 2020, PaLM appendix B)
N: the parameters that multiply (each once per token, forward): all but the input embedding, a lookup (a tied
lm_head is that matrix and does multiply, so it stays), L layers, s the sequence length, a the attention width:
heads x head_dim, the width of q and of the attention's output (the scores q k^T and their product with v: 2 a s
multiply-adds a token per layer). a is the hidden size in a Llama, not in every model: Gemma-7B's 16 heads of 256
(transformers' GemmaConfig defaults) are 4096 wide in a hidden size of 3072, Mistral-Nemo-Base-2407's 32 of 128
(its config.json) 4096 in 5120. Activation checkpointing's second forward is not counted: MFU counts the model's
FLOPs, not the hardware's. Imported by digits_lm.py and by the benchmark suite.
"""

# Dense bfloat16 tensor-core peaks, TFLOP/s per GPU (NVIDIA's data sheets, without sparsity), by device name.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
                    ("GH200", 989.4), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.1))


def multiplying_parameters(model) -> int:
    """N of the formula: the model's parameters less its input embedding, unless lm_head shares it (tied)."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # a tied matrix is one parameter: counted once
    return total if embedding is head else total - embedding.numel()


def attention_width(config) -> int:
    """a of the formula: heads x head_dim, head_dim as transformers' attention layers take it (the config's
    head_dim, else hidden_size / heads)."""
    heads = config.num_attention_heads
    return heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)


def flops_per_token(parameters: int, layers: int, width: int, seq_len: int) -> float:
    """A training step's FLOPs per token: 6 N + 12 L a s."""
    return 6 * parameters + 12 * layers * width * seq_len


def peak_flops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak in FLOP/s, from its name (torch.cuda.get_device_name); None if not in the table."""
    return next((tflops * 1e12 for name, tflops in PEAK_BF16_TFLOPS if name in device_name), None)


def mfu(tokens_per_second: float, gpus: int, parameters: int, layers: int, width: int, seq_len: int,
        device_name: str) -> float | None:
    """The fraction of the GPUs' bf16 peak that the model's FLOPs use; None for a GPU not in the table."""
    peak = peak_flops(device_name)
    return tokens_per_second * flops_per_token(parameters, layers, width, seq_len) / (gpus * peak) if peak else None


def rates(tokens_per_second: float, parameters: int, config, seq_len: int, device) -> str:
    """The epoch line's end: tokens per second (all ranks), and on a GPU in the table the MFU. Both are over the
    epoch's whole time, its first step (and a compile) included: the line says so."""
    import torch
    import torch.distributed as dist
    line = f" | {tokens_per_second:,.0f} tokens/s"
    if device.type != "cuda":
        return line
    used = mfu(tokens_per_second, dist.get_world_size(), parameters, config.num_hidden_layers,
               attention_width(config), seq_len, torch.cuda.get_device_name(device))
    return line + (f" | MFU {used:.1%} (whole epoch: first step and any compile in it)" if used is not None else "")
