"""--amp: which dtype torch.autocast uses, chosen once per run and said in one line.

bfloat16 keeps float32's exponent range, so it needs no loss scaling; GPUs older than Ampere (V100, T4) have no
native bfloat16, and their float16 needs torch.amp.GradScaler (the lessons create it when float16 is used).
"""
import torch

from common.gpus import has_native_bf16
from common.log import log0

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(mode: str | None, device: torch.device) -> torch.dtype | None:
    """None without --amp; auto: bfloat16 where `device` runs it natively, else float16. Says why (rank 0)."""
    if mode is None:
        return None
    if device.type != "cuda":  # autocast runs both on the CPU; float16 convolutions there are slow
        dtype = torch.float16 if mode == "fp16" else torch.bfloat16
        why = "--amp fp16: slow on the CPU, for trying the float16 path" if mode == "fp16" else \
            "the CPU's autocast default; --amp fp16 forces float16"
    else:
        name = torch.cuda.get_device_name(device)
        native = has_native_bf16(torch.cuda.get_device_capability(device))
        dtype = DTYPES.get(mode) or (torch.bfloat16 if native else torch.float16)
        why = f"{name} {'has' if native else 'has no'} native bfloat16"
        if mode == "auto":
            why += f"; --amp {'fp16 forces float16' if native else 'bf16 forces bfloat16'}"
        elif dtype == torch.bfloat16 and not native:
            why = f"--amp bf16, but {why}: expect it slower than float16"
        else:
            why = f"--amp {mode}; {why}"
    log0(f"amp: {'bfloat16 autocast' if dtype == torch.bfloat16 else 'float16 autocast with gradient scaling'} ({why})")
    return dtype
