"""GPU problems, checked on a CPU machine: check_env.py's NOT READY lines, the lessons' refusal to train
on the CPU in a Slurm GPU job (the trainer's), and the trainer's dp naming the path between GPUs (--amp:
test_amp.py).

Each GPU situation is simulated (tests/gpu_fakes.py): torch's CUDA queries are patched in this process, and
nvidia-smi is a stand-in script first on PATH that answers `--query-gpu=...` as a real one does (or is absent).
"""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from lessons import ROOT, trainer

from common.distributed import pick_device
from common.errors import CourseError
from common.gpus import slurm_gpus
from gpu_fakes import CU130, fake_nvidia_smi, needs_no_gpu, outside_a_gpu_job, torch_sees

V100 = "0, Tesla V100-SXM2-32GB, {driver}, 7.0"


def load_check_env():
    spec = importlib.util.spec_from_file_location("check_env", ROOT / "01_setup" / "check_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def no_gpu_job(monkeypatch, tmp_path):
    outside_a_gpu_job(monkeypatch, tmp_path)


def check_env(capsys, *argv):
    code = load_check_env().main(list(argv))
    out = capsys.readouterr().out
    return code, out, [line for line in out.splitlines() if line.startswith("NOT READY: ")]


# ---- which variables mean "Slurm gave this job GPUs" -----------------------------------------------------------
@pytest.mark.parametrize("env, found", [
    ({"SLURM_JOB_ID": "1", "SLURM_GPUS_ON_NODE": "1", "CUDA_VISIBLE_DEVICES": "0"}, "SLURM_GPUS_ON_NODE=1"),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_GPUS": "2,3"}, "SLURM_JOB_GPUS=2,3"),
    ({"SLURM_STEP_GPUS": "0"}, "SLURM_STEP_GPUS=0"),
    ({"SLURM_JOB_ID": "1", "CUDA_VISIBLE_DEVICES": "0"}, "CUDA_VISIBLE_DEVICES=0"),
    ({"CUDA_VISIBLE_DEVICES": "0"}, None),  # outside a job: the user's own choice
    ({"SLURM_JOB_ID": "1", "SLURM_GPUS_ON_NODE": "0", "CUDA_VISIBLE_DEVICES": "NoDevFiles"}, None),
    ({"SLURM_JOB_ID": "1", "CUDA_VISIBLE_DEVICES": ""}, None),
])
def test_slurm_gpu_variables(env, found):
    assert slurm_gpus(env) == found


# ---- check_env.py: one NOT READY line per problem, with its fix, and exit code 1 ------------------------------
def test_laptop_without_gpus_is_ready(capsys):
    code, out, problems = check_env(capsys)
    assert code == 0 and not problems and "verdict: READY - CPU only" in out, out
    assert "driver       none (nvidia-smi not found)\n" in out and "kernels for sm_75 sm_80" in out, out


def test_driver_too_old_for_the_wheels_cuda(capsys, monkeypatch, tmp_path):
    fake_nvidia_smi(tmp_path, "0, NVIDIA A100-SXM4-40GB, 535.104.05, 8.0")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "1")
    code, out, problems = check_env(capsys)
    assert code == 1 and "verdict: NOT READY (1 problem above)" in out, out
    torchvision = importlib.import_module("torchvision").__version__.split("+")[0]
    assert problems == ["NOT READY: Slurm gave this job GPUs (SLURM_GPUS_ON_NODE=1) but torch sees none: the NVIDIA "
                        "driver 535.104.05 is too old for this torch's CUDA 13.0, which needs 580 or newer: install "
                        "the CUDA 12.6 wheel, which runs on drivers >= 525: pip install --force-reinstall "
                        f"torch=={torch.__version__.split('+')[0]} torchvision=={torchvision} "
                        "--index-url https://download.pytorch.org/whl/cu126"], out
    assert "  gpu 0      NVIDIA A100-SXM4-40GB (torch cannot use it), sm_80, bfloat16 native: yes, driver 535.104.05" \
        in out, out


def test_driver_older_than_any_wheel_and_too_old_to_report_compute_capability(capsys, tmp_path):
    fake_nvidia_smi(tmp_path, "0, Tesla P100-PCIE-16GB, 470.82.01, 6.0", knows_compute_cap=False)
    code, out, problems = check_env(capsys)
    assert code == 1 and len(problems) == 1, out
    assert problems[0].startswith("NOT READY: nvidia-smi lists 1 GPU(s) but torch sees none: the NVIDIA driver "
                                  "470.82.01 is too old") and problems[0].endswith("ask the admins for a newer driver")
    assert "Tesla P100-PCIE-16GB (torch cannot use it), compute capability unknown, driver 470.82.01" in out, out


def test_volta_has_no_kernels_in_a_cuda_13_wheel(capsys, monkeypatch, tmp_path):
    fake_nvidia_smi(tmp_path, V100.format(driver="580.95.05"))
    torch_sees(monkeypatch, ("Tesla V100-SXM2-32GB", (7, 0)))
    code, out, problems = check_env(capsys)
    assert code == 1 and len(problems) == 1, out
    line = problems[0]
    assert line.startswith("NOT READY: GPU 0 (Tesla V100-SXM2-32GB) is sm_70, but this torch has kernels for "
                           "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 only: install the CUDA 12.6 wheel, the last for "
                           "GPUs older than Turing: pip install --force-reinstall"), line
    assert "--index-url https://download.pytorch.org/whl/cu126; no PyTorch after 2.14 will have one " \
           "(pytorch/pytorch#190385)" in line, line
    assert "  cuda:0     Tesla V100-SXM2-32GB, 80 GiB, sm_70, bfloat16 native: no, driver 580.95.05" in out, out


def test_old_driver_and_volta_get_a_line_each(capsys, tmp_path):
    fake_nvidia_smi(tmp_path, V100.format(driver="535.104.05"))
    code, out, problems = check_env(capsys)
    assert code == 1 and "verdict: NOT READY (2 problems above)" in out, out
    assert "is too old for this torch's CUDA 13.0" in problems[0] and "is sm_70, but" in problems[1], problems


def test_cpu_only_build_on_a_gpu_node(capsys, monkeypatch, tmp_path):
    fake_nvidia_smi(tmp_path, "0, NVIDIA H100 80GB HBM3, 570.124.06, 9.0")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch, "__version__", "2.14.1+cpu")  # as the CPU-only wheel calls itself
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: [])
    code, out, problems = check_env(capsys)
    assert code == 1 and "CUDA build   none (CPU-only build)\n" in out, out
    assert problems == ["NOT READY: nvidia-smi lists 1 GPU(s) but torch sees none: torch 2.14.1+cpu is a "
                        "CPU-only build (torch.version.cuda is None): install a CUDA wheel (docs/install.md)"], out


def test_slurm_gpus_but_no_driver_at_all(capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    code, out, problems = check_env(capsys)
    assert code == 1 and problems == [
        "NOT READY: Slurm gave this job GPUs (CUDA_VISIBLE_DEVICES=0,1) but torch sees none: no NVIDIA driver answers "
        "here (nvidia-smi not found): a node without GPUs, or a container started without --nv"], out
    code, out, problems = check_env(capsys, "--device", "cpu")  # CPU on purpose: a note, and READY
    assert code == 0 and not problems and "verdict: READY - CPU only" in out, out
    assert "note (--device cpu): Slurm gave this job GPUs (CUDA_VISIBLE_DEVICES=0,1) but torch sees none" in out, out


def test_gpus_without_native_bfloat16_are_ready(capsys, monkeypatch, tmp_path):
    fake_nvidia_smi(tmp_path, "0, Tesla T4, 580.95.05, 7.5", "1, NVIDIA H100 80GB HBM3, 580.95.05, 9.0")
    torch_sees(monkeypatch, ("Tesla T4", (7, 5)), ("NVIDIA H100 80GB HBM3", (9, 0)))
    code, out, problems = check_env(capsys)
    assert code == 0 and "verdict: READY - 2 GPU(s) with NCCL" in out, out
    assert "  cuda:0     Tesla T4, 80 GiB, sm_75, bfloat16 native: no, driver 580.95.05" in out, out
    assert "  cuda:1     NVIDIA H100 80GB HBM3, 80 GiB, sm_90, bfloat16 native: yes, driver 580.95.05" in out, out


@pytest.mark.parametrize("cap, runs", [((9, 0), True), ((8, 9), True), ((12, 1), True), ((10, 3), True),
                                       ((7, 0), False), ((6, 1), False), ((11, 0), False)])
def test_kernels_run_on_the_same_major_version(cap, runs):
    has_kernels = load_check_env().has_kernels
    assert has_kernels(cap, CU130) is runs
    assert has_kernels(cap, ["sm_80", "compute_80"]) is (cap >= (8, 0))  # PTX: compiled for any newer GPU


def test_blackwell_on_the_cuda_12_6_wheel_is_sent_to_cuda_13():
    wheel_for = load_check_env().wheel_for
    assert wheel_for((12, 0)).startswith("install a CUDA 13 wheel (needs driver >= 580)")
    assert "download.pytorch.org/whl/cu130" in wheel_for((10, 0))


# ---- the lessons: no silent CPU training in a GPU job ------------------------------------------------------------
def test_pick_device_refuses_the_cpu_in_a_gpu_job(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    with pytest.raises(CourseError) as info:
        pick_device("auto")
    assert str(info.value) == ("Slurm gave this job GPUs (SLURM_GPUS_ON_NODE=4) but torch cannot use them: no NVIDIA "
                               "driver answers here (nvidia-smi not found): a node without GPUs, or a container "
                               "started without --nv; details: python 01_setup/check_env.py (--device cpu runs on "
                               "the CPU anyway)")
    fake_nvidia_smi(tmp_path, V100.format(driver="550.54.15"))
    with pytest.raises(CourseError, match=r"but torch cannot use them: the NVIDIA driver 550\.54\.15 is too old"):
        pick_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(CourseError, match=r"cannot use them: torch \S+ is a CPU-only build"):
        pick_device("auto")
    assert pick_device("cpu").type == "cpu"  # asked for: still allowed


@needs_no_gpu
def test_the_trainer_in_a_gpu_job_stops_before_training(tmp_path):
    """The bug this guards against: lesson 02 (now trainer --parallel single) in a job with SLURM_GPUS_ON_NODE=1
    trained on the CPU, silently."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="1", SLURM_GPUS_ON_NODE="1", CUDA_VISIBLE_DEVICES="0", OMP_NUM_THREADS="1",
               PATH=f"{tmp_path / 'bin'}:{os.path.dirname(sys.executable)}:/usr/bin:/bin")
    fake_nvidia_smi(tmp_path, V100.format(driver="535.104.05"))
    done = subprocess.run([sys.executable, *trainer("single"), "--data", "synthetic", "--data-dir", tmp_path / "data",
                           "--epochs", "1", "--output-dir", tmp_path / "out"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(
        "error: Slurm gave this job GPUs (SLURM_GPUS_ON_NODE=1) but torch cannot use them: the NVIDIA driver "
        "535.104.05 is too old for this torch's CUDA"), done.stderr
    assert "details: python 01_setup/check_env.py" in done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()  # nothing made, nothing trained
    done = subprocess.run([sys.executable, str(ROOT / "01_setup" / "check_env.py")], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 1 and "verdict: NOT READY (2 problems above)" in done.stdout, done.stdout + done.stderr


def test_the_trainers_dp_names_the_path_between_gpus(monkeypatch):
    """DataParallel copies through GPU 0 at every step: trainer --parallel dp says whether they go peer to peer."""
    from trainer import dp as lesson
    assert lesson.describe_gpu_paths(1) == "one device: no copies between GPUs"
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: b == 1)  # GPU 2 only through the host
    lines = lesson.describe_gpu_paths(3).splitlines()
    assert lines[0] == "GPU 0 <-> GPU 1: peer-to-peer access (NVLink or PCIe): direct copies"
    assert lines[1].startswith("warning: GPU 0 <-> GPU 2: no peer access, every copy goes through host memory")
