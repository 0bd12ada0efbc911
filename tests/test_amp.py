"""--amp, checked on a CPU machine: bfloat16 where the GPU has it natively, else float16 with gradient scaling (the
GPUs simulated: tests/gpu_fakes.py); the flag and its config-file values; float16 on the CPU, where an overflowing
step is skipped and a resumed run equals an uninterrupted one.
"""
import os
import subprocess
import sys

import pytest
import torch

from lessons import ROOT, metrics, trainer

from trainer.amp import autocast_dtype
from common.errors import CourseError
from gpu_fakes import needs_no_gpu, outside_a_gpu_job, torch_sees


@pytest.fixture(autouse=True)
def no_gpu_job(monkeypatch, tmp_path):
    outside_a_gpu_job(monkeypatch, tmp_path)


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
