"""Ctrl-C as a learner presses it: a real SIGINT to a real process group, at a step the job itself reported.

Every run starts with PYTHONPATH=tests/inject FAIL_AT_STEP=0:3:WAIT (tests/inject/sitecustomize.py): rank 0
prints `inject: rank 0 waits at epoch 1 step 3` and waits for a signal. The test waits (with a deadline) for
that line and then does what a terminal does on Ctrl-C: os.killpg(pgid, SIGINT) to the whole foreground group
(python, or torchrun and its workers). No fixed sleeps: every wait ends at a line, an exit, or a deadline.
"""
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch.distributed as dist

from bad_input_runs import torchrun_report_problems
from common.exits import run
from common.signals import CTRL_C_REPEAT_S, StopSignals
from lessons import PARALLEL, ROOT, assert_clean, metrics, run_trainer, trainer

pytestmark = pytest.mark.timeout(300)  # each run below has its own 150 s deadline
INJECT = str(ROOT / "tests" / "inject")
DEADLINE_S = 150
CONTINUE = "continue with the same command and --resume auto"
INTERRUPTED = ("interrupted (Ctrl-C): the epoch in progress is lost; continue from the last checkpoint with the "
               "same command and --resume auto")


@pytest.fixture(scope="module")
def small(synthetic_dir):
    return ["--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", "0", "--test-samples", "200",
            "--batch-size", "32", "--epochs", "2"]


class Terminal:
    """A command started like a terminal starts it: its own process group, output read line by line."""

    def __init__(self, argv, env=None):
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=full_env, cwd=ROOT, start_new_session=True)
        self.lines, self._queue = [], queue.Queue()
        self.start = time.monotonic()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, prefix: str, until: float | None = None) -> str:
        """The first line starting with `prefix` (or, with prefix "", wait until the monotonic time `until`)."""
        deadline = self.start + DEADLINE_S
        while True:
            if until is not None and time.monotonic() >= until:
                return ""
            left = min(deadline, until or deadline) - time.monotonic()
            if left <= 0:
                self.kill()
                pytest.fail(f"no line starting {prefix!r} within {DEADLINE_S} s:\n" + "\n".join(self.lines[-30:]))
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                pytest.fail(f"exited ({self.proc.wait()}) before a line starting {prefix!r}:\n"
                            + "\n".join(self.lines[-30:]))
            self.lines.append(line)
            if prefix and line.startswith(prefix):
                return line

    def ctrl_c(self) -> float:
        os.killpg(self.proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: every process of the foreground group
        return time.monotonic()

    def finish(self) -> int:
        try:
            code = self.proc.wait(timeout=max(1.0, self.start + DEADLINE_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("still running at the deadline:\n" + "\n".join(self.lines[-30:]))
        while (line := self._queue.get(timeout=30)) is not None:
            self.lines.append(line)
        return code

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def torchrun(lesson, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            *trainer(PARALLEL[lesson]), *map(str, args)]


def checkpoints(out: Path) -> list[str]:
    folder = out / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def no_traceback(lines):
    assert not [line for line in lines if "Traceback" in line], "\n".join(lines)


# ---- trainer --parallel ddp, torchrun with 2 ranks --------------------------------------------------------------

def test_ctrl_c_in_the_trainers_ddp_under_torchrun_stops_every_rank_at_one_step(small, tmp_path):
    """A learner pressed Ctrl-C in epoch 1 of `torchrun ... trainer/train.py --parallel ddp`: both ranks agree
    to stop at step 20 (the vote of step 10, read at step 20), ONE `stopped by` line, a checkpoint; torchrun then
    reports its own SignalException and exits 1; the same command with --resume auto finishes the job."""
    args = [*small, "--train-samples", 1600, "--output-dir", tmp_path]  # 25 steps per rank and epoch
    job = Terminal(torchrun("04", *args), env={"PYTHONPATH": INJECT, "FAIL_AT_STEP": "0:3:WAIT"})
    assert job.wait_for("inject: rank 0 waits") == "inject: rank 0 waits at epoch 1 step 3"
    job.ctrl_c()
    code = job.finish()
    assert code == 1, job.lines[-30:]
    said = [line for line in job.lines if line.startswith("stopped by")]
    assert said == [f"stopped by Ctrl-C (SIGINT) at epoch 1 step 20, checkpoint saved: {CONTINUE}"], job.lines
    assert not [line for line in job.lines if line.startswith(("error:", "interrupted", "rank 1: stopping"))]
    report = next(i for i, line in enumerate(job.lines) if line.startswith("Traceback"))
    assert job.lines.index(said[0]) < report
    found = torchrun_report_problems(job.lines, "torch.distributed.elastic.multiprocessing.api.SignalException")
    assert not found, "\n".join(found + job.lines[-40:])
    assert job.lines[-1].endswith("got signal: 2"), job.lines[-3:]
    assert checkpoints(tmp_path) == ["ckpt-e0000-s0000020.pt"]
    resumed = run_trainer("ddp", *args, "--resume", "auto", nproc=2, timeout=DEADLINE_S)
    assert_clean(resumed)
    assert "continuing at epoch 1 step 20" in resumed.stdout, resumed.stdout
    assert [e["epoch"] for e in metrics(tmp_path)["epochs"]] == [1, 2]


# ---- a second Ctrl-C ---------------------------------------------------------------------------------------

# The child: trainer/single.py as train.py runs it, except that the checkpoint of the first Ctrl-C waits (up to 60 s)
# before it saves (trainer/state.py's TorchSave.save), so that the test's second Ctrl-C provably arrives WHILE the
# first stop is still in progress.
SLOW_SAVE = f"""
import sys, time
sys.path[:0] = [{str(ROOT)!r}]
from common.exits import run
from trainer import single as lesson
from trainer.state import TorchSave
save = TorchSave.save
def save_slowly(*args, **kwargs):
    print("test: the first Ctrl-C's checkpoint is being saved", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.02)  # a second Ctrl-C raises KeyboardInterrupt in here
    save(*args, **kwargs)
TorchSave.save = save_slowly
run(lesson.main, sys.argv[1:])
"""


def test_a_second_ctrl_c_during_the_checkpoint_stops_the_trainers_single_at_once(small, tmp_path):
    """A learner pressed Ctrl-C, and again more than 2 s later while the checkpoint was still being written:
    the run ends at once, one `interrupted (Ctrl-C)` line, exit 130, no traceback, no (half) checkpoint."""
    job = Terminal([sys.executable, "-c", SLOW_SAVE, *map(str, [*small, "--train-samples", 640, "--output-dir",
                                                                  tmp_path])],
                   env={"PYTHONPATH": INJECT, "FAIL_AT_STEP": "0:3:WAIT"})
    job.wait_for("inject: rank 0 waits")
    first = job.ctrl_c()
    job.wait_for("test: the first Ctrl-C's checkpoint is being saved")
    job.wait_for("", until=first + CTRL_C_REPEAT_S + 0.5)  # "more than 2 s later" is what the learner did
    job.ctrl_c()
    code = job.finish()
    assert code == 130, job.lines[-20:]
    assert job.lines[-1] == INTERRUPTED, job.lines[-5:]
    assert sum(line.startswith(("interrupted", "error:", "stopped by")) for line in job.lines) == 1, job.lines
    no_traceback(job.lines)
    assert checkpoints(tmp_path) == [], list((tmp_path / "checkpoints").iterdir())


@pytest.mark.parametrize("peer_gone", [False, True], ids=["alone", "peer-gone"])
def test_stop_signals_counts_ctrl_c_twice_within_2_s_as_one_and_a_later_one_as_stop_now(peer_gone, monkeypatch,
                                                                                      capsys):
    """In-process, on common.signals.StopSignals with a fake clock: Ctrl-C asks for a checkpoint; the copy torchrun
    forwards 1 s later is the same request; a Ctrl-C 2.5 s after the first raises KeyboardInterrupt, which
    common.exits.run turns into one line and exit code 130. peer-gone: that KeyboardInterrupt is swallowed as DCP's
    save swallows it, and its gather with a rank already gone fails: still the Ctrl-C line (run's NoteCtrlC)."""
    clock = {"now": 1000.0}
    monkeypatch.setattr("common.signals.time", types.SimpleNamespace(monotonic=lambda: clock["now"]))
    reached, before = [], signal.getsignal(signal.SIGINT)

    def main(argv):
        with StopSignals(signal.SIGINT, signal.SIGTERM) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            reached.append(stop.request)  # 1: Ctrl-C, a checkpoint please
            clock["now"] += 1.0
            os.kill(os.getpid(), signal.SIGINT)
            reached.append(stop.request)  # still 1: within CTRL_C_REPEAT_S it is the same request
            clock["now"] += 1.5
            try:
                os.kill(os.getpid(), signal.SIGINT)  # 2.5 s after the first: stop now
            except KeyboardInterrupt:
                if not peer_gone:
                    raise
                raise dist.DistNetworkError("Connection closed by peer") from None
            reached.append("not reached")

    with pytest.raises(SystemExit) as exited:
        run(main, [])
    assert exited.value.code == 130 and reached == [1, 1]
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [INTERRUPTED]
    assert signal.getsignal(signal.SIGINT) is before  # StopSignals put Ctrl-C's handler back
