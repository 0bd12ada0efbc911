"""A learner's mistakes with the six teaching scripts (lessons 02-07's mnist_*.py), judged as the trainer's rows are
(tests/bad_input_runs.py; the trainer's table: tests/bad_inputs.py):

  values    zero (where a count may not be zero), a negative and a non-number for EVERY numeric flag of each
            script's own parser (bad_inputs.lesson_parser), a typo'd flag, --data, --device and 07's --pp-schedule
            out of range; 06's --tp that cuts no block evenly or does not divide the processes, 07's
            --microbatches that do not divide the batch and a --dp that leaves no 2-stage pipeline
  paths     a typo'd --data-dir (real MNIST, offline), an --output-dir under a regular file, a fresh run into a
            used folder, --resume of a missing path or another lesson's checkpoint, --resume auto in an empty folder,
            --resume auto with flags other than the run's (02's --train-samples, 05's --data and --seed, 06's --hidden)
  launches  04 and 05 under plain python (exit 0, no Python warning) and under torchrun with 2 ranks (rank 0
            without the data while rank 1 waits; Ctrl-C); Ctrl-C inside lesson 05's dcp.save

Value and path rows run in this process (bad_input_runs.run_in_process: main() under common.exits.run, as the
script's __main__ runs it); the launches are real processes, all started at once in the background.
"""
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from bad_input_runs import Context, prepare, problems, run_in_process, torchrun_report_problems
from bad_inputs import NO_NETWORK, ZERO_ALLOWED, Case, lesson_parser, numeric_flags
from common.epoch_checkpoints import RECORD, EpochCheckpoints
from lessons import ROOT, SCRIPTS, assert_clean

pytestmark = pytest.mark.timeout(300)
TEACHING = ("02", "03", "04", "05", "06", "07")
SMALL = ("--data", "synthetic", "--data-dir", "{data}", "--num-workers", "0", "--train-samples", "64",
         "--test-samples", "16", "--batch-size", "32", "--epochs", "1", "--output-dir", "{out}")
OWN = {"06": ("--tp", "1")}  # after SMALL: ONE process is a 1 x 1 mesh
DEADLINE_S = 180  # seconds from a launch's start: far above its ~10 s, for a loaded machine
INTERRUPTED = "interrupted (Ctrl-C)"


def key(lesson):
    return f"teach{lesson}"  # bad_inputs.SCRIPTS's name of the teaching script


def row(lesson, name, argv, needles=(), **kwargs):
    return Case(f"{lesson}-{name}", key(lesson), name, (*SMALL, *OWN.get(lesson, ()), *argv), needles=needles,
                **kwargs)


def value_rows(lesson):
    rows = []
    for flag, kind in numeric_flags(lesson_parser(key(lesson))):
        if flag not in ZERO_ALLOWED:
            rows.append(row(lesson, f"{flag[2:]}-zero", (flag, "0"), (f"argument {flag}: must be ", "got 0")))
        rows.append(row(lesson, f"{flag[2:]}-negative", (flag, "-1"), (f"argument {flag}: must be ", "got -1")))
        rows.append(row(lesson, f"{flag[2:]}-not-a-number", (flag, "ten"), (f"argument {flag}:", "'ten'")))
    return rows


def lesson_rows(lesson):
    rows = [*value_rows(lesson),
            row(lesson, "typo-flag", ("--epoch", "1"), ("unrecognized arguments: --epoch 1",)),
            row(lesson, "data-foo", ("--data", "foo"), ("argument --data: invalid choice: 'foo'",)),
            row(lesson, "device-tpu", ("--device", "tpu"), ("argument --device: invalid choice: 'tpu'",)),
            row(lesson, "output-dir-under-a-file", ("--output-dir", "{case}/afile/out"), ("{case}/afile/out",),
                setup="file-in-the-way"),
            row(lesson, "resume-missing", ("--resume", "{case}/ckpt.pt"),
                ("checkpoint {case}/ckpt.pt does not exist", "check --resume"))]
    if lesson != "07":  # 07 under plain python stops at its launch check (its own row), before the data
        rows.append(row(lesson, "data-dir-typo", ("--data", "mnist", "--data-dir", "{case}/dta"),
                        ("MNIST not found in {case}/dta/MNIST/raw", "check --data-dir"), env=NO_NETWORK,
                        absent=("{case}/dta",)))
    return rows


def checkpoint(lesson):
    """Where the fixture leaves lesson 02's and 05's checkpoints, under their own names (prepare()'s layout)."""
    return f"{{art}}/runs/artifact-{key(lesson)}/out/checkpoints/{lesson}-epoch-001{'.pt' if lesson == '02' else ''}"


def other_flags(lesson, name, flags, there, here):
    """--resume auto in the fixture's resumable-teachNN (a checkpoint and its run.json) with flags of another run."""
    folder = f"{{art}}/resumable-{key(lesson)}"
    return row(lesson, name, ("--output-dir", folder, "--resume", "auto", *flags),
               (f"{folder}/checkpoints/{lesson}-epoch-001", f"was written with {there}, this command has {here}: "
                "a resume continues that run, so give it the same values"),
               max_seconds=2.0, forbid=("resumed", "epoch ", "rank "))


def table():
    rows = [r for lesson in TEACHING for r in lesson_rows(lesson)] + [
        *[row(lesson, "used-output-dir", (), ("{out}/checkpoints holds checkpoints of an earlier run", "--resume auto"),
              setup="used-output-dir", max_seconds=2.0, forbid=("epoch ", "rank ")) for lesson in ("02", "05")],
        *[row(lesson, f"resume-{other}", ("--resume", checkpoint(other)),  # a .pt, DCP folders
              (f"{checkpoint(other)} is not a lesson {lesson} checkpoint",))
          for lesson, other in (("04", "02"), ("04", "05"), ("06", "05"))],
        other_flags("02", "resume-other-train-samples", ("--train-samples", "128"), "--train-samples 64",
                    "--train-samples 128"),
        other_flags("05", "resume-other-data-and-seed", ("--data", "mnist", "--seed", "2"), "--data synthetic, --seed 1",
                    "--data mnist, --seed 2"),
        other_flags("06", "resume-other-hidden", ("--hidden", "64"), "--hidden 128", "--hidden 64"),
        row("06", "tp-not-a-divisor", ("--tp", "3"), ("--tp 3 does not divide a block's 4 x hidden = 512 features",)),
        row("06", "tp-2-under-plain-python", ("--tp", "2"), ("--tp 2 does not divide the 1 process", "torchrun")),
        row("07", "microbatches-not-a-divisor", ("--microbatches", "3"), ("--microbatches 3 must divide",)),
        row("07", "pp-schedule-x", ("--pp-schedule", "x"), ("argument --pp-schedule: invalid choice: 'x'",)),
        row("07", "under-plain-python", (), ("--dp 1 on 1 process(es) leaves no pipeline of 2 stages",
                                             "--nproc_per_node=2"))]
    assert len({r.id for r in rows}) == len(rows), "duplicate row ids"
    return rows


TABLE = table()


class Launch:
    """A background process group, its output in a file; waited on with a deadline, or until a line appears."""

    def __init__(self, argv, log: Path, **env):
        self.log, self.start = log, time.monotonic()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, *map(str, argv)], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}, start_new_session=True)

    def lines(self):
        return self.log.read_text().splitlines()

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=max(1.0, DEADLINE_S - (time.monotonic() - self.start)))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"{self.proc.args} still running after {DEADLINE_S} s:\n{self.log.read_text()[-3000:]}")

    def ctrl_c_when(self, ready) -> None:
        """In a thread: the terminal's Ctrl-C (SIGINT to the whole group) as soon as ready(self) is true."""
        def watch():
            while self.proc.poll() is None and not ready(self):
                time.sleep(0.005)
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGINT)
        threading.Thread(target=watch, daemon=True).start()


def torchrun(lesson):
    return ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPTS[lesson]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_dir):
    """The launches start first (all at once, in the background); then the artifacts the rows resume from (lesson
    02's .pt from its --resume-auto row, 05's DCP folder, each also in resumable-teachNN/checkpoints beside the
    run.json its run wrote; for 06, the run.json of the rows' flags beside an empty stand-in) and every row's folder."""
    base = tmp_path_factory.mktemp("lesson_inputs")
    art = base / "art"
    ctx = Context(synthetic_dir, str(art), str(base / "rows"))
    small = [a.format(data=synthetic_dir, out="{out}") for a in SMALL]
    launches = {}
    for lesson in ("04", "05"):
        out = base / f"python-{lesson}"
        launches[f"python-{lesson}"] = Launch([SCRIPTS[lesson], *small[:-1], out], base / f"python-{lesson}.log")
        launches[f"data-{lesson}"] = Launch(
            [*torchrun(lesson), *small[:-1], base / f"data-{lesson}", "--data", "mnist", "--data-dir", base / "dta"],
            base / f"data-{lesson}.log", **dict(NO_NETWORK))
        launches[f"ctrl-c-{lesson}"] = Launch(
            [*torchrun(lesson), *small[:-1], base / f"ctrl-c-{lesson}", "--train-samples", "640", "--epochs", "3"],
            base / f"ctrl-c-{lesson}.log")
    # 04: right after epoch 1's line (its checkpoint is being written, or epoch 2 trains); 05: while dcp.save writes
    launches["ctrl-c-04"].ctrl_c_when(lambda launch: any(line.startswith("epoch 1:") for line in launch.lines()))
    launches["ctrl-c-05"].ctrl_c_when(lambda launch: any((base / "ctrl-c-05" / "checkpoints").glob("*.tmp")))
    gc.collect()
    gc.freeze()  # run() and a failed download call gc.collect(): without this it walks all of torch's objects
    try:
        made = {}
        for lesson, case in (("02", row("02", "resume-auto-in-an-empty-folder", ("--resume", "auto"))),
                             ("05", row("05", "artifact", ()))):  # in-process: the launches have the CPUs
            prepare(case, ctx)
            made[lesson] = run_in_process(case, ctx)
            assert made[lesson]["code"] == 0, made[lesson]
            made_here = Path(checkpoint(lesson).format(art=art))
            made_here.parent.parent.mkdir(parents=True)
            Path(ctx.paths(case)["out"], "checkpoints").rename(made_here.parent)
            (art / f"ckpt-{key(lesson)}").symlink_to(made_here)  # what prepare() copies into a used --output-dir
            resumable = art / f"resumable-{key(lesson)}" / "checkpoints"
            resumable.mkdir(parents=True)
            (made_here.parent / RECORD).rename(resumable / RECORD)
            (resumable / made_here.name).symlink_to(made_here)
        flags = lesson_parser(key("06")).parse_args([*small, *OWN["06"]])  # the values its record holds
        with EpochCheckpoints(art / "resumable-teach06", "06", sharded=True, flags=flags).writing(1) as stand_in:
            stand_in.mkdir()  # never read: the resume is refused first
        for case in TABLE:
            prepare(case, ctx)
        yield {"ctx": ctx, "launches": launches, "base": base, "resume-auto": made["02"]}
    finally:
        gc.unfreeze()
        for launch in launches.values():
            if launch.proc.poll() is None:
                os.killpg(launch.proc.pid, signal.SIGKILL)
                launch.proc.wait()


@pytest.mark.parametrize("case", TABLE, ids=lambda case: case.id)
def test_a_mistake_is_one_line_and_exit_2(case, runs):
    """`python SCRIPT ...` with the row's mistake: exit 2, ONE `error:` line holding the needles, no traceback, no
    Python warning, nothing left behind (bad_input_runs.problems judges it)."""
    found = problems(case, [run_in_process(case, runs["ctx"])], runs["ctx"], "python")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("lesson", TEACHING)
def test_the_numeric_flags_are_found_and_zero_is_a_count_only_where_allowed(lesson):
    parser = lesson_parser(key(lesson))  # the rows above come from these flags: none may go unseen
    flags = {flag for flag, _ in numeric_flags(parser)}
    assert len(flags) >= 9 and {"--seed", "--num-workers", "--epochs", "--lr"} <= flags, flags
    for flag in sorted(ZERO_ALLOWED & flags):  # --seed, --num-workers (and 06, 07's --blocks)
        assert getattr(parser.parse_args([flag, "0"]), flag[2:].replace("-", "_")) == 0


def test_resume_auto_in_an_empty_folder_starts_fresh(runs):
    result = runs["resume-auto"]
    assert result["code"] == 0 and not result["escaped"], result
    assert not [line for line in result["lines"] if line.startswith(("resumed", "error:")) or "Warning" in line]
    assert [line.split(":")[0] for line in result["lines"]] == ["epoch 1"], result["lines"]
    assert (Path(runs["ctx"].art) / "ckpt-teach02").is_file()  # its checkpoint, moved to the artifacts


@pytest.mark.parametrize("lesson", ["04", "05"])
def test_a_torchrun_lesson_under_plain_python_is_one_process(lesson, runs):
    launch = runs["launches"][f"python-{lesson}"]
    proc = subprocess.CompletedProcess(launch.proc.args, launch.wait(), "\n".join(launch.lines()), "")
    assert_clean(proc)
    assert "rank 0 of 1 on cpu, 64 of 64 training images" in proc.stdout, proc.stdout
    assert "accuracy " in proc.stdout and "/16, train" in proc.stdout, proc.stdout


@pytest.mark.parametrize("lesson", ["04", "05"])
def test_rank_0_without_the_data_stops_both_ranks_with_one_line(lesson, runs):
    """torchrun, 2 ranks, a typo'd --data-dir: rank 0 fails to prepare MNIST while rank 1 waits in the barrier; both
    exit within the deadline, the one line once (rank 1 finds the files missing: quiet), torchrun's report after."""
    launch = runs["launches"][f"data-{lesson}"]
    code, lines = launch.wait(), launch.lines()
    assert code == 1, lines[-30:]
    [error] = [line for line in lines if line.startswith("error:")]
    assert f"MNIST not found in {runs['base']}/dta/MNIST/raw" in error and "check --data-dir" in error, lines[-30:]
    found = torchrun_report_problems(lines, "torch.distributed.elastic.multiprocessing.errors.ChildFailedError")
    assert not found, "\n".join(found + lines[-40:])
    assert not (runs["base"] / "dta").exists() and not (runs["base"] / f"data-{lesson}").exists()


def finished(folder: Path) -> list[str]:
    """The checkpoints a --resume auto would see, each checked complete (a .pt loads, a DCP folder has .metadata)."""
    names = sorted(p.name for p in folder.iterdir() if "-epoch-" in p.name and not p.name.endswith(".tmp")) \
        if folder.is_dir() else []
    for name in names:
        path = folder / name
        assert (path / ".metadata").is_file() if path.is_dir() else torch.load(path, weights_only=True)["epoch"]
    return names


@pytest.mark.parametrize("lesson", ["04", "05"])
def test_ctrl_c_while_training_under_torchrun(lesson, runs):
    """The terminal's Ctrl-C (SIGINT to the process group) in training or while a checkpoint is written: ONE
    `interrupted (Ctrl-C)` line (run()'s exit 130), then torchrun's SignalException report (it exits 1); no half
    checkpoint under a final name (a .tmp is never resumed)."""
    launch = runs["launches"][f"ctrl-c-{lesson}"]
    code, lines = launch.wait(), launch.lines()
    assert code == 1, lines[-30:]
    said = [line for line in lines if line.startswith(INTERRUPTED)]
    assert len(said) == 1 and "--resume auto" in said[0], lines[-30:]
    epochs = [int(line.split(":")[0][6:]) for line in lines if line.startswith("epoch ")]
    assert max(epochs, default=0) < 3 and not [line for line in lines if line.startswith("error:")], lines[-30:]
    found = torchrun_report_problems(lines, "torch.distributed.elastic.multiprocessing.api.SignalException")
    assert not found, "\n".join(found + lines[-40:])
    suffix = ".pt" if lesson == "04" else ""  # the Ctrl-C came while a checkpoint was written, or in training
    assert set(finished(runs["base"] / f"ctrl-c-{lesson}" / "checkpoints")) <= {
        f"{lesson}-epoch-{epoch:03d}{suffix}" for epoch in epochs}, lines[-30:]


@pytest.mark.parametrize("peer_gone", [False, True], ids=["alone", "peer-gone"])
def test_ctrl_c_inside_dcp_save_is_the_one_line(peer_gone, runs):
    """Lesson 05 in one process, the Ctrl-C raised while dcp.save writes its files (where the torchrun row's SIGINT
    may land): DCP wraps the KeyboardInterrupt in its CheckpointException, a BaseException; still ONE line, exit 130.
    peer-gone: DCP's gather of the ranks' results after the Ctrl-C fails, as it does when the other rank has already
    stopped for the same Ctrl-C (the torchrun row); still the Ctrl-C line, not "a collective failed"."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter
    from torch.distributed.checkpoint.utils import _DistWrapper

    gather, interrupted = _DistWrapper.gather_object, []

    def write_data(*_):
        interrupted.append(True)
        signal.raise_signal(signal.SIGINT)

    def gather_after(self, obj):
        if peer_gone and interrupted:
            raise torch.distributed.DistNetworkError("Connection closed by peer")
        return gather(self, obj)

    case = row("05", f"ctrl-c-in-dcp-save-{peer_gone}", ())
    prepare(case, runs["ctx"])
    with mock.patch.object(_FileSystemWriter, "write_data", write_data), \
            mock.patch.object(_DistWrapper, "gather_object", gather_after):
        result = run_in_process(case, runs["ctx"])
    assert result["code"] == 130 and not result["escaped"], result
    assert [line[:20] for line in result["lines"] if not line.startswith(("rank 0 of 1", "epoch 1:"))] == [INTERRUPTED]
    assert finished(Path(runs["ctx"].paths(case)["out"]) / "checkpoints") == []
