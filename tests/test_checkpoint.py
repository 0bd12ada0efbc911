"""Checkpoints: full contents, DDP <-> plain round trips, atomic writes, clear errors."""
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import workers
from common.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from common.errors import CourseError
from common.launcher import launch
from common.model import Net


def _trained(seed=0):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adadelta(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def test_contents_and_plain_round_trip(tmp_path):
    model, opt, sched = _trained()
    path = tmp_path / "ck.pt"
    save_checkpoint(path, model, opt, sched, epoch=2, step=40, args=None, lesson="02")
    raw = read_checkpoint(path)
    assert {"model", "optimizer", "scheduler", "epoch", "step", "rng", "args", "lesson"} <= raw.keys()
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in raw["model"])
    assert raw["optimizer"]["state"], "optimizer state (Adadelta's running averages) must be saved"
    fresh, fopt, fsched = Net(), None, None
    fopt = torch.optim.Adadelta(fresh.parameters())
    fsched = torch.optim.lr_scheduler.StepLR(fopt, 1, gamma=0.7)
    ckpt = load_checkpoint(path, fresh, fopt, fsched)
    assert (ckpt["epoch"], ckpt["step"]) == (2, 40)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    assert fsched.get_last_lr() == sched.get_last_lr()
    torch.testing.assert_close(fopt.state_dict()["state"][0]["square_avg"], opt.state_dict()["state"][0]["square_avg"])


def test_compiled_wrapper_saves_plain_keys(tmp_path):
    model, _, _ = _trained()
    wrapped = torch.nn.DataParallel(model)  # on CPU a plain wrapper, but it adds 'module.'
    save_checkpoint(tmp_path / "dp.pt", wrapped, epoch=1, step=1)
    assert "conv1.weight" in read_checkpoint(tmp_path / "dp.pt")["model"]


def test_ddp_to_plain_to_ddp(tmp_path):
    model, _, _ = _trained(seed=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "ddp.pt"
    results = launch(workers.ddp_checkpoint_roundtrip, nprocs=2, args=(str(path), state), timeout_s=120)
    plain = Net()
    load_checkpoint(path, plain)  # saved under DDP, loads into a plain model
    for epoch, loaded in results:  # and back into DDP on every rank
        assert epoch == 3
        for k, v in state.items():
            assert torch.equal(loaded[k], v) and torch.equal(plain.state_dict()[k], v)


def test_truncated_and_foreign_files_are_one_line_errors(tmp_path):
    model, opt, _ = _trained()
    good = tmp_path / "good.pt"
    save_checkpoint(good, model, opt, epoch=1, step=1)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    for path, message in [(truncated, "not a readable checkpoint"), (junk, "not a readable checkpoint"),
                          (foreign, "not written by this course"), (tmp_path, "is a folder"),
                          (tmp_path / "missing.pt", "does not exist")]:
        with pytest.raises(CourseError, match=message) as info:
            load_checkpoint(path, Net())
        assert "\n" not in str(info.value) and str(path) in str(info.value)
    with pytest.raises(CourseError, match="model of another shape.*--width"):
        load_checkpoint(good, Net(width=2))


WRITER = textwrap.dedent("""
    import sys, torch
    from common.checkpoint import save_checkpoint
    from common.model import Net
    # A big model makes the write slow enough to be killed in the middle.
    save_checkpoint(sys.argv[1], Net(width=12), epoch=9, step=9)
""")


def test_writer_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    model, opt, _ = _trained()
    save_checkpoint(path, model, opt, epoch=1, step=10)
    before = path.read_bytes()
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".checkpoint.pt.tmp-*")):  # wait until the temp file is being written
        assert proc.poll() is None and time.monotonic() < deadline, "writer finished before it could be killed"
        time.sleep(0.01)
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert path.read_bytes() == before
    assert load_checkpoint(path, Net())["epoch"] == 1
