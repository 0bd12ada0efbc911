"""GPU problems, checked on a CPU machine: check_env.py's NOT READY lines, the lessons' refusal to train
on the CPU in a Slurm GPU job (the trainer's), and --amp's choice between bfloat16 and float16 with gradient scaling.

Each GPU situation is simulated: torch's CUDA queries are patched in this process (monkeypatch), and nvidia-smi is
a stand-in script first on PATH that answers `--query-gpu=...` as a real one does (or is absent).
"""
import importlib.util
import os
import shlex
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from lessons import ROOT, metrics, trainer

from trainer.amp import autocast_dtype
from common.distributed import pick_device
from common.errors import CourseError
from common.gpus import slurm_gpus

CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.14.1+cu130's get_arch_list()
V100 = "0, Tesla V100-SXM2-32GB, {driver}, 7.0"
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="simulates a node whose GPUs torch cannot use")


def load_check_env():
    spec = importlib.util.spec_from_file_location("check_env", ROOT / "01_setup" / "check_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def no_gpu_job(monkeypatch, tmp_path):
    """Outside any Slurm job, with an empty PATH folder first: nvidia-smi is absent unless a test writes one."""
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


# ---- --amp: bfloat16 where native, else float16 with a GradScaler ------------------------------------------------
@pytest.mark.parametrize("mode, gpu, dtype, line", [
    ("auto", ("NVIDIA H100 80GB HBM3", (9, 0)), torch.bfloat16,
     "amp: bfloat16 autocast (NVIDIA H100 80GB HBM3 has native bfloat16; --amp fp16 forces float16)"),
    ("auto", ("Tesla V100-SXM2-32GB", (7, 0)), torch.float16, "amp: float16 autocast with gradient scaling "
     "(Tesla V100-SXM2-32GB has no native bfloat16; --amp bf16 forces bfloat16)"),
    ("fp16", ("NVIDIA H100 80GB HBM3", (9, 0)), torch.float16,
     "amp: float16 autocast with gradient scaling (--amp fp16; NVIDIA H100 80GB HBM3 has native bfloat16)"),
    ("bf16", ("Tesla T4", (7, 5)), torch.bfloat16,
     "amp: bfloat16 autocast (--amp bf16, but Tesla T4 has no native bfloat16: expect it slower than float16)"),
])
def test_amp_choice_on_gpus(monkeypatch, capsys, mode, gpu, dtype, line):
    torch_sees(monkeypatch, gpu)
    assert autocast_dtype(mode, torch.device("cuda", 0)) == dtype
    assert capsys.readouterr().out == line + "\n"


@pytest.mark.parametrize("argv, amp", [([], None), (["--amp"], "auto"), (["--amp", "--epochs", "2"], "auto"),
                                       (["--amp", "bf16"], "bf16"), (["--amp", "fp16"], "fp16")])
def test_amp_flag(argv, amp):
    from common.cli import base_parser, parse
    assert parse(base_parser("02", "test"), argv).amp == amp


@pytest.mark.parametrize("line, amp", [("amp: true", "auto"), ("amp: false", None), ("amp: null", None),
                                       ("amp: fp16", "fp16")])
def test_amp_in_a_config_file(tmp_path, line, amp):
    """Older runs wrote `amp: true` / `amp: false` into their config.yaml: they still replay."""
    from common.cli import base_parser, parse
    (tmp_path / "run.yaml").write_text(line + "\n")
    assert parse(base_parser("02", "test"), ["--config", str(tmp_path / "run.yaml")]).amp == amp
    (tmp_path / "bad.yaml").write_text("amp: fp8\n")
    with pytest.raises(CourseError, match="amp: 'fp8' is not one of auto, bf16, fp16"):
        parse(base_parser("02", "test"), ["--config", str(tmp_path / "bad.yaml")])


def test_amp_choice_on_the_cpu(capsys):
    assert autocast_dtype(None, torch.device("cpu")) is None and capsys.readouterr().out == ""
    assert autocast_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert autocast_dtype("fp16", torch.device("cpu")) == torch.float16
    assert capsys.readouterr().out.splitlines() == [
        "amp: bfloat16 autocast (the CPU's autocast default; --amp fp16 forces float16)",
        "amp: float16 autocast with gradient scaling (--amp fp16: slow on the CPU, for trying the float16 path)"]


def test_a_float16_step_that_overflows_is_skipped(tmp_path):
    """The trainer's loop (trainer/loop.py, as --parallel single runs it) with float16 autocast on the CPU: a loss
    scale so large that the gradients overflow skips the optimizer step (weights unchanged) and halves the scale; a
    sane one trains."""
    from types import SimpleNamespace
    from common.cli import base_parser
    from common.model import Net
    from common.position import Position
    from trainer.loop import Run
    from trainer.optim import make_optimizer, make_scheduler
    args = base_parser("02", "test").parse_args(["--optimizer", "sgd", "--lr", "0.1", "--output-dir", str(tmp_path)])
    torch.manual_seed(0)
    batches = [(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))]
    for init_scale, skipped in ((2.0 ** 40, True), (2.0 ** 10, False)):
        model = Net()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = make_optimizer(args, model.parameters())
        scheduler = make_scheduler(args, optimizer, steps_per_epoch=1)
        optimizer.step()  # no gradients yet: changes nothing, but the scheduler sees a step, as after warm_up
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        Run.train_epoch(SimpleNamespace(args=args, model=model, device=torch.device("cpu"), train_loader=batches,
                                        optimizer=optimizer, scheduler=scheduler, position=Position(), scaler=scaler,
                                        stopping=lambda: False, no_sync=None, amp_dtype=torch.float16,
                                        clip_grad_norm=torch.nn.utils.clip_grad_norm_, counted=True))
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert unchanged is skipped and scaler.get_scale() == (init_scale / 2 if skipped else init_scale)


@needs_no_gpu
def test_the_trainers_single_float16_on_the_cpu_resumes_exactly(tmp_path, synthetic_dir):
    """--amp fp16 end to end: the choice is printed, the loss scale is checkpointed, and a resumed run equals an
    uninterrupted one (float16 on the CPU is slow: a tiny run)."""
    flags = ["--data", "synthetic", "--data-dir", synthetic_dir, "--train-samples", 32, "--test-samples", 16,
             "--batch-size", 16, "--num-workers", 0, "--amp", "fp16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin"}

    def lesson(*more):
        done = subprocess.run([sys.executable, *trainer("single"), *map(str, flags + list(more))], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=300)
        assert done.returncode == 0 and "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
        return done.stdout
    out = lesson("--epochs", 2, "--output-dir", tmp_path / "whole")
    assert "amp: float16 autocast with gradient scaling (--amp fp16: slow on the CPU" in out, out
    lesson("--epochs", 1, "--output-dir", tmp_path / "cut")
    lesson("--epochs", 2, "--resume", "auto", "--output-dir", tmp_path / "cut")
    whole, cut = (torch.load(tmp_path / run / "checkpoints" / "ckpt-e0002-s0000000.pt", weights_only=True)
                  for run in ("whole", "cut"))
    assert whole["scaler"] == cut["scaler"] and whole["scaler"]["scale"] > 0, (whole["scaler"], cut["scaler"])
    assert all(torch.equal(whole["model"][k], cut["model"][k]) for k in whole["model"])
    keys = ("epoch", "train_loss", "test_loss", "test_correct")
    assert [{k: e[k] for k in keys} for e in metrics(tmp_path / "whole")["epochs"]] == \
        [{k: e[k] for k in keys} for e in metrics(tmp_path / "cut")["epochs"]]
    assert metrics(tmp_path / "whole")["args"]["amp"] == "fp16"


def test_the_trainers_dp_names_the_path_between_gpus(monkeypatch):
    """DataParallel copies through GPU 0 at every step: trainer --parallel dp says whether they go peer to peer."""
    from trainer import dp as lesson
    assert lesson.describe_gpu_paths(1) == "one device: no copies between GPUs"
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: b == 1)  # GPU 2 only through the host
    lines = lesson.describe_gpu_paths(3).splitlines()
    assert lines[0] == "GPU 0 <-> GPU 1: peer-to-peer access (NVLink or PCIe): direct copies"
    assert lines[1].startswith("warning: GPU 0 <-> GPU 2: no peer access, every copy goes through host memory")
