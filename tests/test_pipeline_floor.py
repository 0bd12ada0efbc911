"""Lesson 07 on a torch below its floor: each script of the lesson that runs a pipeline (the commands of its README
and exercises) prints ONE line naming the torch it needs and exits 2, before it starts a process (on torch 2.9 a
pipeline's first step over gloo aborts: 07_pipeline_parallel/reference.md, "The torch floor: 2.10").

Each script runs as its command line runs it (runpy, as __main__), in this process: fast. On torch 2.9 (`make
test-floor`) the check is the real one, and the scripts' imports are checked to exist there; on a newer torch the
test gives torch.__version__ the floor's 2.9.1 first.
"""
import runpy
import sys

import pytest
import torch
from torch.torch_version import TorchVersion

from lessons import ROOT

LESSON = ROOT / "07_pipeline_parallel"
SCRIPTS = ["pp_minimal.py", "mnist_ppmodel.py", "bubble.py", "solutions/bubble_by_hand.py", "solutions/scale_grads.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_below_the_floor_one_line_names_the_torch_needed(script, capsys, monkeypatch):
    if torch.__version__ >= "2.10":
        monkeypatch.setattr(torch, "__version__", TorchVersion("2.9.1"))
    monkeypatch.chdir(ROOT)  # where the README's commands run
    monkeypatch.setattr(sys, "argv", [str(LESSON / script)])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put their folders first
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(LESSON / script), run_name="__main__")
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "", (exit_.value.code, out)
    assert err == (f"error: lesson 07 needs torch >= 2.10 (torch {torch.__version__}'s pipeline stages fail over gloo: "
                   "pytorch/pytorch#165539): pip install 'torch>=2.10'\n")
