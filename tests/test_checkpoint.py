"""The checkpoint folder: atomic writes, which checkpoint resumes, keep-last-N, refusing to mix runs."""
import io
import json
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

from common.checkpoints import CheckpointDir, read_meta
from common.errors import CourseError
from common.files import atomic_save
from common.position import Position


def run_args(tmp_path, **changes):
    args = dict(output_dir=str(tmp_path), keep_checkpoints=2, data="synthetic", train_samples=None, val_samples=0,
                width=1, blocks=0, hidden=None, optimizer="adadelta", schedule="step", max_steps=None,
                target_accuracy=None, epochs=14, dry_run=False)
    return SimpleNamespace(**{**args, **changes})


def write(folder: CheckpointDir, args, epoch: int, step: int = 0, best: bool = False):
    """A checkpoint as lessons 02-04 write it, with a Position at (epoch + 1, step)."""
    position = Position(epoch + 1, step)
    path = folder.path(position)
    atomic_save({"model": {"w": torch.full((2,), float(epoch))}, "position": position.state_dict(),
                 "run": folder.run}, path)
    folder.prune(path, best=best)
    return path


def names(folder):
    return [p.name for p in folder.all()]


def test_names_sort_by_progress_and_keep_last_n(tmp_path):
    args = run_args(tmp_path)
    folder = CheckpointDir(args, "02")
    for epoch in (1, 2, 3):
        write(folder, args, epoch, best=epoch == 2)
    write(folder, args, 3, step=40)  # a mid-epoch save after a signal
    assert names(folder) == ["ckpt-e0003-s0000040.pt", "ckpt-e0003-s0000000.pt"]
    state = read_meta(folder.all()[0])
    assert (state["position"]["epoch"], state["position"]["step"], state["run"]["width"]) == (4, 40, 1)
    best = torch.load(tmp_path / "best.pt", weights_only=True)  # epoch 2's, although pruned from checkpoints/
    assert best["model"]["w"].tolist() == [2.0, 2.0] and best["position"]["epoch"] == 3


def test_dry_run_checkpoints_never_block_or_feed_a_real_run(tmp_path):
    dry = run_args(tmp_path, dry_run=True, max_steps=2, epochs=1)
    write(CheckpointDir(dry, "02"), dry, 1)
    assert (tmp_path / "dry-run-checkpoints").is_dir()
    real = CheckpointDir(run_args(tmp_path), "02")
    assert real.resume_from(None) is None and real.resume_from("auto") is None  # not refused, not resumed


def test_max_steps_checkpoints_are_refused_by_a_full_run(tmp_path):
    capped = run_args(tmp_path, max_steps=5)
    write(CheckpointDir(capped, "02"), capped, 1)
    with pytest.raises(CourseError, match="max_steps 5 there, None here"):
        CheckpointDir(run_args(tmp_path), "02").resume_from("auto")


def test_keep_last_n_never_deletes_the_checkpoint_just_written(tmp_path):
    args = run_args(tmp_path)
    folder = CheckpointDir(args, "02")
    for epoch in (5, 6):
        write(folder, args, epoch)
    just = write(folder, args, 2)  # resumed from an explicit older checkpoint into the same folder
    assert just.exists() and names(folder) == ["ckpt-e0006-s0000000.pt", "ckpt-e0002-s0000000.pt"]


def test_a_fresh_run_refuses_an_earlier_runs_checkpoints(tmp_path):
    args = run_args(tmp_path)
    folder = CheckpointDir(args, "02")
    assert folder.resume_from(None) is None  # empty: a fresh run is fine
    write(folder, args, 14)
    with pytest.raises(CourseError, match="earlier run: continue it with --resume auto, or .* another --output-dir"):
        folder.resume_from(None)


def test_resume_refuses_an_incompatible_run_naming_what_differs(tmp_path):
    args = run_args(tmp_path)
    write(CheckpointDir(args, "02"), args, 1)
    other = run_args(tmp_path, width=2, train_samples=1000)
    with pytest.raises(CourseError) as info:
        CheckpointDir(other, "02").resume_from("auto")
    message = str(info.value)
    assert "width 1 there, 2 here" in message and "train_samples None there, 1000 here" in message
    assert "\n" not in message
    with pytest.raises(CourseError, match="lesson '02' there, '04' here"):
        CheckpointDir(args, "04").resume_from("auto")


def test_resume_of_another_lessons_checkpoint_names_the_fix_not_the_flags(tmp_path):
    lesson04 = run_args(tmp_path, sync_bn=False)
    path = write(CheckpointDir(lesson04, "04_ddp_training"), lesson04, 1)
    lesson05 = run_args(tmp_path / "05", init_from=None)  # only lesson 05 has --init-from, only 04 --sync-bn
    with pytest.raises(CourseError) as info:
        CheckpointDir(lesson05, "05_multigpu_fsdp_training", sharded=True).resume_from(str(path))
    assert str(info.value) == (f"{path} is from another kind of run (lesson '04_ddp_training' there, "
                               f"'05_multigpu_fsdp_training' here): --resume continues a run of the same lesson; "
                               f"to start from its weights, use --init-from {path} instead")
    with pytest.raises(CourseError, match="here\\): --resume continues a run of the same lesson; continue it with "
                                          "that lesson's script, or start fresh with another --output-dir$"):
        CheckpointDir(run_args(tmp_path / "02"), "02_singlegpu_training").resume_from(str(path))


def test_resume_auto_skips_a_broken_newest_and_starts_fresh_when_empty(tmp_path, capsys):
    args = run_args(tmp_path)
    folder = CheckpointDir(args, "02")
    assert folder.resume_from("auto") is None and "starting fresh" in capsys.readouterr().out
    good = write(folder, args, 3)
    broken = write(folder, args, 4)
    broken.write_bytes(broken.read_bytes()[:1000])  # as if the disk filled up mid-write
    assert folder.resume_from("auto") == good
    assert "skipping" in capsys.readouterr().out


def test_unreadable_checkpoints_are_one_line_errors(tmp_path):
    args = run_args(tmp_path)
    good = write(CheckpointDir(run_args(tmp_path / "run"), "02"), args, 1)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    for path, message in [(truncated, "not a readable checkpoint"), (junk, "not a readable checkpoint"),
                          (foreign, "not a readable checkpoint"), (tmp_path / "missing.pt", "does not exist")]:
        with pytest.raises(CourseError, match=message) as info:
            read_meta(path)
        assert "\n" not in str(info.value) and str(path) in str(info.value)


WRITER = textwrap.dedent("""
    import sys, torch
    from common.files import atomic_save
    from common.model import Net
    # A big model makes the write slow enough to be killed in the middle.
    atomic_save({"model": Net(width=12).state_dict()}, sys.argv[1])
""")


def test_writer_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    atomic_save({"epoch": 1}, path)
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
    assert torch.load(path, weights_only=True) == {"epoch": 1}


def test_a_mid_epoch_checkpoint_of_2_ranks_resumed_by_1_keeps_every_ranks_loss_sums():
    """Exact replay needs the same ranks; on another number, rank 0 carries the old ranks' sums of the epoch."""
    states = [{"torch": torch.get_rng_state(), "partial": json.dumps({"loss_sum": 3.0, "count": 10, "seconds": 1.5})},
              {"torch": torch.get_rng_state(), "partial": json.dumps({"loss_sum": 5.0, "count": 12, "seconds": 2.5})}]
    buffer = io.BytesIO()
    torch.save(states, buffer)
    position = Position()
    position.load_state_dict({"epoch": 1, "step": 11, "rng": buffer.getvalue()})  # one process, no group
    meter = position.meter("cpu")
    assert (meter.loss_sum.item(), meter.count) == (8.0, 22)
