"""Lesson 03, exercise 2 (a solution): without GPUs, nn.DataParallel is the plain module, device_ids or not.

From the course folder:
    python 03_dp_training/solutions/cpu_is_plain_module.py

Wraps a Net in nn.DataParallel(..., device_ids=[0, 1]), which on a GPU node means "split every batch over GPUs
0 and 1", and runs one training forward and backward through the wrapper and through the same Net unwrapped.
DataParallel's constructor finds no GPU (torch/nn/parallel/data_parallel.py), keeps the module, sets device_ids
to [] and its forward then calls the module directly: same output, same gradients, bit for bit.
"""
import copy
import os
import sys
from pathlib import Path

# The question is what happens without GPUs: hide any this machine has, before torch first looks for them.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the course folder: `common`

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.model import Net


def step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One training forward and backward; dropout draws from the same seed for both models."""
    torch.manual_seed(1)
    output = model(images)
    F.nll_loss(output, labels).backward()
    return output


def main():
    torch.manual_seed(0)
    plain = Net()
    wrapped = nn.DataParallel(copy.deepcopy(plain), device_ids=[0, 1])  # the same weights, wrapped
    print(f"device_ids asked for: [0, 1]; DataParallel kept: {wrapped.device_ids}")
    images, labels = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    same_output = torch.equal(step(plain, images, labels), step(wrapped, images, labels))
    same_grads = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), wrapped.module.parameters()))
    print(f"a batch of {len(images)}: same output {same_output}, same gradients {same_grads}")


if __name__ == "__main__":
    main()
