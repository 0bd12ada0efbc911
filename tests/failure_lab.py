"""How the failure lab's tests (test_troubleshooting.py, test_troubleshooting_host.py) run its commands.

Every command is started the way a learner starts it (torchrun or python, from the repo root), as a Job: in the
background, its own session, stdout and stderr read line by line. The runs of one failure start together, so the
hangs (10 s process-group timeouts) overlap; each run must end within LIMIT seconds or the test fails. Namespaces
(unshare) stand in for a container's small /dev/shm, a firewall and a laptop whose hostname does not resolve;
without root those tests skip (needs_unshare).
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "troubleshooting"
LIMIT = 60  # seconds: no run of this file may wait longer
ENV = {k: v for k, v in os.environ.items()
       if k not in {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCH_DISTRIBUTED_DEBUG",
                    "GLOO_SOCKET_IFNAME", "USE_LIBUV"}}
ENV.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


class Job:
    """A command running in the background; stdout and stderr collected together, line by line."""

    def __init__(self, cmd, env=None, preexec_fn=None):
        self.cmd, self.lines, self.start = cmd, [], time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace",
                                     start_new_session=True, preexec_fn=preexec_fn)
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, seconds: float = LIMIT) -> re.Match:
        """The first match of pattern in the output so far; polls until it appears (or fails)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if match := re.search(pattern, self.out):
                return match
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"no {pattern!r} in the output of {self.cmd}:\n{self.out[-3000:]}")

    def finish(self) -> "Job":
        """Wait for the end (at most LIMIT s after the start); rc, seconds and out are then final."""
        try:
            self.proc.wait(timeout=max(0.0, self.start + LIMIT - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running after {LIMIT} s: {self.cmd}\n{self.out[-3000:]}")
        self.reader.join(10)
        self.rc, self.seconds = self.proc.returncode, time.monotonic() - self.start
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: torchrun and its workers
            self.proc.wait()


def torchrun(script: str, *args, launch=("--standalone",), env=None, wrap=(), preexec_fn=None) -> Job:
    """[wrap...] python -m torch.distributed.run LAUNCH --nproc_per_node=2 troubleshooting/SCRIPT ARGS"""
    cmd = [*wrap, sys.executable, "-m", "torch.distributed.run", *launch, "--nproc_per_node=2",
           str(LAB / script), *map(str, args)]
    return Job(cmd, env=env, preexec_fn=preexec_fn)


def finish_all(*jobs: Job) -> list[Job]:
    return [job.finish() for job in jobs]


def failed_quickly(job: Job) -> None:
    assert job.rc != 0, job.out[-3000:]
    assert job.seconds < LIMIT


def succeeded(job: Job) -> None:
    assert job.rc == 0, job.out[-3000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@cache
def can_unshare(flag: str) -> bool:
    """unshare -m (mounts), -n (network) or -u (hostname) works here: root, and not blocked by a sandbox."""
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", flag, "true"], capture_output=True).returncode == 0


def needs_unshare(flag: str):
    return pytest.mark.skipif(not can_unshare(flag), reason=f"`unshare {flag}` is not permitted here (needs root)")
