"""Lesson 07's torch floor, checked first by each of its scripts that runs a pipeline: on torch 2.9 the first step of
a pipeline over gloo aborts the process (reference.md, "The torch floor: 2.10"); the check says so in one line."""
import torch

from common.errors import CourseError


def require_torch_2_10() -> None:
    if torch.__version__ < "2.10":  # TorchVersion compares as versions
        raise CourseError(f"lesson 07 needs torch >= 2.10 (torch {torch.__version__}'s pipeline stages fail over gloo: "
                          "pytorch/pytorch#165539): pip install 'torch>=2.10'")
