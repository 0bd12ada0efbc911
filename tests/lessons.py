"""Run lesson scripts and the trainer the way a learner does (python or torchrun) and read what they leave behind."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "01": ROOT / "01_setup" / "hello_distributed.py",
    "02": ROOT / "02_singlegpu_training" / "mnist_singlegpu.py",
    "03": ROOT / "03_dp_training" / "mnist_dpmodel.py",
    "04": ROOT / "04_ddp_training" / "mnist_ddpmodel.py",
    "05": ROOT / "05_multigpu_fsdp_training" / "mnist_fsdpmodel.py",
    "06": ROOT / "06_tensor_parallel" / "mnist_tpmodel.py",
    "07": ROOT / "07_pipeline_parallel" / "mnist_ppmodel.py",
}
TRAINER = ROOT / "trainer" / "train.py"  # the production trainer, built from the lesson scripts 02-07
PARALLEL = {"02": "single", "03": "dp", "04": "ddp", "05": "fsdp2", "06": "2d", "07": "pp"}  # its strategy per lesson

INJECT = {"PYTHONPATH": str(ROOT / "tests" / "inject")}  # with FAIL_AT_STEP: tests/inject/sitecustomize.py


def run_script(lesson: str, *args, nproc: int | None = None, timeout: int = 300, env=None, cwd=None, extra=()):
    """python SCRIPT ARGS, or torchrun --standalone --nproc_per_node=N [EXTRA] SCRIPT ARGS when nproc is given."""
    launcher = [sys.executable] if nproc is None else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *extra]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    script = TRAINER if lesson == "trainer" else SCRIPTS[lesson]  # "trainer": see run_trainer
    return subprocess.run(launcher + [str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd or ROOT)


def trainer(parallel: str) -> list[str]:
    """The command line's start for a strategy of the trainer: trainer/train.py --parallel PARALLEL."""
    return [str(TRAINER), "--parallel", parallel]


def run_trainer(parallel: str, *args, **kwargs):
    """run_script for the production trainer: trainer/train.py --parallel PARALLEL ARGS (same keywords)."""
    return run_script("trainer", "--parallel", parallel, *args, **kwargs)


def metrics(output_dir) -> dict:
    return json.loads((Path(output_dir) / "metrics.json").read_text())


def assert_clean(proc) -> None:
    """Exit 0 and no Python warning anywhere in the output."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Warning" not in out, out[-3000:]
