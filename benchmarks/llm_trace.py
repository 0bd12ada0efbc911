"""Where a training step's GPU time goes, from a torch.profiler trace (Chrome JSON): kernels classified by name.

Classes, first match wins: communication (NCCL kernels), attention (flash / fused attention kernels), loss (softmax,
log-softmax, NLL or cross-entropy kernels, eager or Triton: Inductor names its kernels after the ops they fuse),
optimizer (AdamW's fused kernel; foreach kernels other than copies), matmul (cuBLAS / CUTLASS GEMMs, `nvjet` on
Hopper, float8's scaled GEMMs), other (norms, activations, casts, FSDP2's copies). Per step: each compute class's
kernel time; communication's total and its exposed part (NCCL kernel time under no compute kernel on any stream);
idle (no kernel at all). All in ms per step, the step being the traced window over the steps traced.
"""
from __future__ import annotations

import json

from benchmarks.overlap import _both, _length

CLASSES = (("communication", ("nccl",)),
           ("attention", ("flash", "fmha", "attention", "sdpa")),
           ("loss", ("softmax", "nll_loss", "cross_entropy", "crossentropy")),
           ("optimizer", ("adam",)),
           ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "wgmma", "scaled_mm", "matmul")))
COMPUTE = ("matmul", "attention", "loss", "optimizer", "other")


def classify(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    if "multi_tensor_apply" in low and "copy" not in low:  # foreach AdamW's ops (FSDP2's foreach copies: other)
        return "optimizer"
    return "other"


def kernels(trace: str) -> list[tuple[str, float, float]]:
    """(class, start, end) of every GPU kernel in the trace, in ms."""
    events = json.loads(open(trace).read())["traceEvents"]
    return [(classify(e["name"]), e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in events
            if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"]


def shares(trace: str, steps: int) -> dict:
    """{class_ms, communication_ms, exposed_communication_ms, idle_ms, step_ms}: per step."""
    ks = kernels(trace)
    if not ks:
        return {}
    spans = {c: [(s, e) for k, s, e in ks if k == c] for c in COMPUTE + ("communication",)}
    compute = [span for c in COMPUTE for span in spans[c]]
    window = max(e for _, _, e in ks) - min(s for _, s, _ in ks)
    comm = spans["communication"]
    out = {f"{c}_ms": sum(e - s for s, e in spans[c]) / steps for c in COMPUTE}
    out.update(communication_ms=_length(comm) / steps, exposed_communication_ms=(_length(comm) - _both(comm, compute))
               / steps, idle_ms=(window - _length([(s, e) for _, s, e in ks])) / steps, step_ms=window / steps,
               kernels=len(ks))
    return out


def busiest(trace: str, top: int = 5) -> list[list]:
    """The kernels that took the most time in the trace: [name (120 chars), class, ms]."""
    events = json.loads(open(trace).read())["traceEvents"]
    total: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel":
            total[e["name"]] = total.get(e["name"], 0.0) + e["dur"] / 1e3
    return [[n[:120], classify(n), ms] for n, ms in sorted(total.items(), key=lambda x: -x[1])[:top]]

