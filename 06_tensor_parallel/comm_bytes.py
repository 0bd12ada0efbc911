"""Bytes each rank communicates per training step under DDP, FSDP2, TP and 2-D, for lesson 06's TPNet.

    python 06_tensor_parallel/comm_bytes.py --blocks 4 --hidden 1024 --batch-size 64 --gpus 4

prints, per strategy, each collective's payload (the tensor handed to it) and the bytes a ring algorithm
puts on each rank's link: 2(n-1)/n x payload for an all-reduce, (n-1)/n x payload for an all-gather or a
reduce-scatter (payload: the full, gathered size). docs/communication.md derives each line; the payloads
are checked on CPU against what the collectives really received (ByteCounter below, tests/test_tensor_parallel.py).
No process group is started: the model is built on the meta device, shapes only.
"""
import argparse
import math
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install

from common.model import Net  # noqa: E402

EXPAND = 4  # up is 4 x hidden wide, as mnist_tpmodel.py's MLP
FP32 = 4  # bytes per element: weights, gradients and activations in float32


def shapes(blocks: int, hidden: int) -> dict:
    """{unit: [parameter shapes]} of TPNet, in FSDP2's units: features, fc1, each block, fc2."""
    with torch.device("meta"):
        net = Net(hidden=hidden)
    units = {"features": [p.shape for p in net.features.parameters()], "fc1": [p.shape for p in net.fc1.parameters()]}
    for i in range(blocks):
        units[f"blocks.{i}"] = [(EXPAND * hidden, hidden), (EXPAND * hidden,), (hidden, EXPAND * hidden), (hidden,)]
    units["fc2"] = [p.shape for p in net.fc2.parameters()]
    return units


def local_shape(unit: str, index: int, shape, tp: int) -> list:
    """A parameter's shape on one rank of a TP group: up cut by rows (ColwiseParallel), down.weight by columns."""
    local = list(shape)
    if unit.startswith("blocks.") and tp > 1 and index < 2:
        local[0] //= tp  # up.weight, up.bias: output features cut over tp
    elif unit.startswith("blocks.") and tp > 1 and index == 2:
        local[1] //= tp  # down.weight: input features cut over tp (down.bias stays whole)
    return local


def predict(strategy: str, blocks: int, hidden: int, batch: int, dp: int = 1, tp: int = 1) -> dict:
    """Payload bytes per rank per step: {collective: bytes}. batch: images per TP group (per DDP/FSDP2 rank)."""
    units, out = shapes(blocks, hidden), {}
    params = sum(math.prod(s) for shapes_ in units.values() for s in shapes_)
    if strategy == "ddp":
        return {"all_reduce": FP32 * params} if dp > 1 else {}
    if dp > 1:  # FSDP2 over dp: each parameter (its TP piece) padded to a multiple of dp rows, gathered twice
        gathered = sum(math.ceil(local[0] / dp) * dp * math.prod(local[1:])
                       for unit, unit_shapes in units.items() for i, shape in enumerate(unit_shapes)
                       for local in [local_shape(unit, i, shape, tp)])
        out["all_gather"] = 2 * FP32 * gathered  # forward, and again in backward
        out["reduce_scatter"] = FP32 * gathered  # the gradients, once
    if tp > 1:  # per block: down's partial sums in forward, up's input gradient in backward, batch x hidden each
        out["all_reduce"] = 2 * blocks * FP32 * batch * hidden
    return out


def held(strategy: str, blocks: int, hidden: int, dp: int = 1, tp: int = 1) -> dict:
    """Bytes rank 0 holds (docs/memory.md): weights, gradients, AdamW's two moments, fp32. DDP: all of it.
    FSDP2 gives rank 0 ceil(rows / dp) rows of each parameter (of its TP piece under 2-D)."""
    elements = sum(math.prod(shape) if strategy == "ddp" else
                   math.ceil(local[0] / dp) * math.prod(local[1:])
                   for unit, unit_shapes in shapes(blocks, hidden).items() for i, shape in enumerate(unit_shapes)
                   for local in [local_shape(unit, i, shape, tp)])
    return {"weights": FP32 * elements, "gradients": FP32 * elements, "adamw": 2 * FP32 * elements}


def wire(collective: str, payload: int, n: int) -> float:
    """Bytes a ring sends from each rank for this payload among n ranks."""
    return payload * (2 if collective == "all_reduce" else 1) * (n - 1) / n


class ByteCounter(TorchDispatchMode):
    """Adds up the payload of every collective that passes through PyTorch's dispatcher (FSDP2's and DTensor's)."""

    OPS = {"allreduce_": "all_reduce", "all_reduce": "all_reduce", "_allgather_base_": "all_gather",
           "_reduce_scatter_base_": "reduce_scatter"}

    def __init__(self):
        super().__init__()
        self.bytes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = self.OPS.get(func._overloadpacket.__name__) if func.namespace in ("c10d", "_c10d_functional") else None
        if name:
            # all_reduce: the tensor(s); all-gather: its output (args[0]); reduce-scatter: its input (args[1])
            tensor = args[1] if name == "reduce_scatter" else args[0]
            tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
            self.bytes[name] = self.bytes.get(name, 0) + sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64, help="images per rank (per TP group under TP)")
    p.add_argument("--gpus", type=int, default=4, help="ranks; TP and 2-D use tp 2")
    a = p.parse_args(argv)
    n = a.gpus
    rows = [("DDP", "ddp", n, 1), ("FSDP2", "fsdp", n, 1), ("TP", "tp", 1, n), ("2-D", "2d", n // 2, 2)]
    print(f"TPNet --blocks {a.blocks} --hidden {a.hidden}, batch {a.batch_size} per group, {n} ranks: "
          f"MB per rank per step (payload -> on the wire)")
    for label, strategy, dp, tp in rows:
        payloads = predict(strategy, a.blocks, a.hidden, a.batch_size, dp, tp)
        parts = [f"{c} {b / 1e6:,.2f} -> {wire(c, b, dp if c != 'all_reduce' or strategy == 'ddp' else tp) / 1e6:,.2f}"
                 for c, b in payloads.items()]
        print(f"{label:6} dp {dp} x tp {tp}: " + ("; ".join(parts) or "none"))


if __name__ == "__main__":
    main()
