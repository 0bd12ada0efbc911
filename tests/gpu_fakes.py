"""A GPU machine as the GPU tests (test_gpu_checks.py, test_amp.py) simulate it on a CPU: torch's CUDA queries patched
in this process (monkeypatch), and nvidia-smi a stand-in script first on PATH that answers `--query-gpu=...` as a
real one does (or is absent).
"""
import os
import shlex
from types import SimpleNamespace

import pytest
import torch

CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.14.1+cu130's get_arch_list()
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="simulates a node whose GPUs torch cannot use")


def outside_a_gpu_job(monkeypatch, tmp_path) -> None:
    """Outside any Slurm job, with an empty PATH folder first: nvidia-smi is absent unless a test writes one; torch a
    CUDA 13.0 build with CU130's kernels (each test module's autouse fixture calls this)."""
    for name in list(os.environ):
        if name.startswith("SLURM_") or name == "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(name)
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # in-process: only shutil.which("nvidia-smi") reads it
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: CU130)


def fake_nvidia_smi(tmp_path, *rows, knows_compute_cap=True):
    """A stand-in nvidia-smi listing `rows` ("index, name, driver, compute capability"); an old driver's one
    refuses the compute_cap field, as real ones before it existed do, and is asked again without it.
    Shell builtins only: the in-process tests leave nothing else on PATH."""
    def listing(lines):  # printf's format is reused for every argument: one line each
        return "printf '%s\\n' " + " ".join(shlex.quote(line) for line in lines)
    refuse = "echo 'Field \"compute_cap\" is not a valid field to query.'; exit 2"
    with_cap = listing(rows) if knows_compute_cap else refuse
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\n"
                   f'case "$*" in\n  *compute_cap*) {with_cap};;\n'
                   f"  *) {listing(r.rsplit(',', 1)[0] for r in rows)};;\nesac\n")
    smi.chmod(0o755)
    return smi


def torch_sees(monkeypatch, *gpus):
    """torch.cuda answers as if these (name, (major, minor)) GPUs were usable."""
    def pick(i=0):
        return gpus[getattr(i, "index", i) or 0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(gpus))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: pick(i)[0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: pick(i)[1])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(total_memory=80 * 2**30))
