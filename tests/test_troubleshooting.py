"""The failure lab (troubleshooting/): each failure happens as the README says, ends by itself, and its fix works.

Every command is started the way a learner starts it (torchrun or python, from the repo root). The
runs of one failure start together, so the hangs (10 s process-group timeouts) overlap; each run
must end within LIMIT seconds or the test fails. Namespaces (unshare) stand in for a container's
small /dev/shm, a firewall and a laptop whose hostname does not resolve; without root those
tests skip.
"""
import os
import re
import resource
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


# ---------------------------------------------------------------- 1. a stuck rank

@pytest.fixture(scope="module")
def stuck():
    """stuck_rank.py with rank 1 skipping an all_reduce; while it hangs, py-spy dumps every rank."""
    job = torchrun("stuck_rank.py")
    pids = {int(r): int(p) for r, p in re.findall(r"\[rank (\d)\] pid (\d+)", job.wait_for(
        r"(?s)(\[rank \d\] pid \d+.*){2}").group(0))}
    job.wait_for(r"(?s)(3 steps done.*){2}")
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    dumps, reason = {}, None
    if not Path(py_spy).exists():
        reason = "py-spy is not installed (it is in the dev extras: pip install -e '.[dev]')"
    for rank, pid in sorted(pids.items()):
        want = "all_reduce" if rank == 0 else "barrier"
        deadline = time.monotonic() + 8  # the rank may need a moment to enter the collective
        while reason is None and time.monotonic() < deadline:
            dump = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
            text = dump.stdout + dump.stderr
            if re.search(r"Permission denied|Operation not permitted|ptrace", text, re.I) and dump.returncode:
                reason = f"py-spy may not ptrace here: {text.strip()[:200]}"
            dumps[rank] = text
            if want in text:
                break
            time.sleep(0.3)
    return job.finish(), dumps, reason


def test_stuck_rank_times_out_naming_rank_and_collective(stuck):
    job, _, _ = stuck
    failed_quickly(job)
    assert "Timed out waiting 10000ms" in job.out
    # The tracebacks name both ranks and where each waits: rank 0 in all_reduce, rank 1 in barrier.
    assert re.search(r"\[rank0\]:.*in all_reduce", job.out), job.out[-3000:]
    assert re.search(r"\[rank1\]:.*in barrier", job.out), job.out[-3000:]
    assert "[rank 0] finished" not in job.out


def test_py_spy_dump_shows_where_each_rank_waits(stuck):
    _, dumps, reason = stuck
    if reason:
        pytest.skip(reason)
    assert "all_reduce" in dumps[0] and "stuck_rank.py" in dumps[0], dumps[0]
    assert "barrier" in dumps[1] and "stuck_rank.py" in dumps[1], dumps[1]


def test_detail_debug_reports_the_mismatch_and_the_fix_finishes():
    detail = torchrun("stuck_rank.py", "--bug", "reorder", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    fixes = [torchrun("stuck_rank.py", "--fix"), torchrun("stuck_rank.py", "--fix", "--bug", "reorder")]
    detail, *fixes = finish_all(detail, *fixes)
    failed_quickly(detail)
    assert "Detected mismatch between collectives on ranks" in detail.out, detail.out[-3000:]
    assert re.search(r"Rank 0 is running collective: .*OpType=ALLREDUCE.*but Rank 1 is running collective: "
                     r".*OpType=BROADCAST", detail.out), detail.out[-3000:]
    for job in fixes:
        succeeded(job)
        assert "[rank 0] finished" in job.out and "[rank 1] finished" in job.out


# ---------------------------------------------------------------- 2. uneven inputs

def test_uneven_inputs_hang_and_join_or_equal_shards_fix_them():
    bug, join, shards = finish_all(torchrun("uneven_inputs.py"), torchrun("uneven_inputs.py", "--fix", "join"),
                                   torchrun("uneven_inputs.py", "--fix", "shards"))
    failed_quickly(bug)
    assert "[rank 1] 2 steps done" in bug.out and "[rank 0] 3 steps done" not in bug.out
    assert "Timed out waiting 10000ms" in bug.out
    assert re.search(r"\[rank0\]:.*loss\.backward\(\)", bug.out), bug.out[-3000:]  # rank 0: DDP's all_reduce
    assert re.search(r"\[rank1\]:.*in barrier", bug.out), bug.out[-3000:]
    succeeded(join)
    assert "[rank 0] finished: 3 steps here, 5 over 2 ranks" in join.out
    assert "[rank 1] finished: 2 steps here, 5 over 2 ranks" in join.out
    succeeded(shards)
    assert shards.out.count("3 steps here, 6 over 2 ranks") == 2


# ---------------------------------------------------------------- 3. unused parameters

def test_unused_parameter_error_and_its_fixes():
    bug = torchrun("unused_parameters.py", env={"TORCH_DISTRIBUTED_DEBUG": "INFO"})  # DETAIL crashes DDP here
    fixes = [torchrun("unused_parameters.py", "--fix", fix) for fix in ("find-unused", "static-graph")]
    bug, *fixes = finish_all(bug, *fixes)
    failed_quickly(bug)
    assert "Expected to have finished reduction in the prior iteration" in bug.out, bug.out[-3000:]
    assert "Parameters which did not receive grad for rank 0: unused.bias, unused.weight" in bug.out, bug.out[-3000:]
    assert "[rank 0] step 1 " in bug.out and "[rank 0] step 2 " not in bug.out  # fails at the 2nd forward
    for job in fixes:
        succeeded(job)
        assert "[rank 0] step 5 " in job.out and re.search(r"\d+\.\d+ ms/step", job.out)


# ---------------------------------------------------------------- 4. replicas that diverge silently

def checksums(job: Job) -> dict[int, str]:
    return {int(r): c for r, c in re.findall(r"\[rank (\d)\] after 5 steps: checksum (-?\d+\.\d+)", job.out)}


def test_diverged_replicas_are_detected_by_a_checksum_and_fixed():
    bug, seed, bcast = finish_all(torchrun("diverged_replicas.py"),
                                  torchrun("diverged_replicas.py", "--fix", "same-seed"),
                                  torchrun("diverged_replicas.py", "--fix", "broadcast"))
    succeeded(bug)  # silently: no error at all...
    assert "REPLICAS DIVERGED" in bug.out  # ...only the checksum shows it
    assert len(set(checksums(bug).values())) == 2
    for job in (seed, bcast):
        succeeded(job)
        assert "replicas identical" in job.out and "replicas equal: False" not in job.out
        sums = checksums(job)
        assert len(sums) == 2 and sums[0] == sums[1]


# ---------------------------------------------------------------- 5. rendezvous

def test_master_port_in_use_fails_at_once_and_a_free_port_works():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        clash = torchrun("rendezvous.py", launch=("--master-addr=127.0.0.1", f"--master-port={port}")).finish()
    fixed = torchrun("rendezvous.py", launch=("--master-addr=127.0.0.1", f"--master-port={free_port()}")).finish()
    failed_quickly(clash)
    assert f"port: {port}" in clash.out and "EADDRINUSE" in clash.out, clash.out[-3000:]
    succeeded(fixed)
    assert fixed.out.count("all_reduce of ones = 2") == 2


FIREWALL = """
ip link set lo up
ip link add fw0 type veth peer name fw1 && ip addr add 10.99.0.1/24 dev fw0
ip link set fw0 up && ip link set fw1 up
# 10.99.0.2 "exists" (a fixed MAC) but nothing answers: packets vanish, like a firewall that drops them
ip neigh add 10.99.0.2 lladdr 02:00:00:00:00:02 dev fw0 nud permanent
timeout 3 bash -c '</dev/tcp/127.0.0.2/{port}' 2>/dev/null; echo "probe refused rc=$?"
timeout 3 bash -c '</dev/tcp/10.99.0.2/{port}' 2>/dev/null; echo "probe dropped rc=$?"
exec "$@"
"""


@pytest.fixture(scope="module")
def unreachable():
    """This machine as node 1 of 2, its MASTER_ADDR unreachable: nothing listens / a firewall drops
    (a network namespace). Both runs wait for their 10 s timeouts at the same time."""
    port = free_port()
    launch = ("--nnodes=2", "--node-rank=1", f"--master-port={port}", "--rdzv-conf=timeout=10")
    closed = torchrun("rendezvous.py", launch=("--master-addr=127.0.0.2", *launch))
    dropped = None
    if can_unshare("-n"):
        dropped = torchrun("rendezvous.py", launch=("--master-addr=10.99.0.2", *launch),
                           wrap=("unshare", "-n", "sh", "-c", FIREWALL.format(port=port), "firewall"))
    return port, closed.finish(), dropped and dropped.finish()


def test_wrong_master_addr_ends_with_a_connect_timeout(unreachable):
    port, job, _ = unreachable
    failed_quickly(job)
    assert f"The client socket has timed out after 10000ms while trying to connect to (127.0.0.2, {port})" in job.out


@needs_unshare("-n")
def test_firewalled_port_times_out_and_a_probe_tells_it_from_a_closed_port(unreachable):
    port, _, job = unreachable
    failed_quickly(job)
    assert "probe refused rc=1" in job.out  # a closed port answers at once: connection refused
    assert "probe dropped rc=124" in job.out  # a firewalled one never answers: the probe times out
    assert f"timed out after 10000ms while trying to connect to (10.99.0.2, {port})" in job.out, job.out[-3000:]


def test_wrong_network_interface_is_reported_at_init():
    job = torchrun("rendezvous.py", env={"GLOO_SOCKET_IFNAME": "nosuch0"}).finish()
    failed_quickly(job)
    assert "Unable to find address for: nosuch0" in job.out, job.out[-3000:]


@needs_unshare("-u")
def test_unresolvable_hostname_hangs_standalone_and_loopback_fixes_it():
    """A laptop whose hostname does not resolve (as on many Macs): a UTS namespace with a made-up name."""
    rename = ("unshare", "-u", "sh", "-c", 'hostname lab-unresolvable-host && exec "$@"', "rename")
    hang = torchrun("rendezvous.py", wrap=rename)
    fixed = torchrun("rendezvous.py", wrap=rename, launch=("--standalone", "--local-addr=127.0.0.1"),
                     env={"GLOO_SOCKET_IFNAME": "lo"})
    hang.wait_for(r"\(lab-unresolvable-host, \d+\) cannot be retrieved \(gai error")
    assert hang.proc.poll() is None, hang.out[-3000:]  # still hanging in the rendezvous...
    assert "all_reduce" not in hang.out  # ...and no worker ever ran
    hang.kill()
    succeeded(fixed.finish())
    assert fixed.out.count("all_reduce of ones = 2") == 2
    assert "Unable to resolve hostname" not in fixed.out


# ---------------------------------------------------------------- 6. DataLoader workers killed

def in_shm(size: str) -> tuple:
    """Run a command with a private /dev/shm of SIZE, as in a container started with --shm-size=SIZE."""
    return ("unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"', "shm")


def loader(*args, shm="", preexec_fn=None) -> Job:
    wrap = in_shm(shm) if shm else ()
    return Job([*wrap, sys.executable, str(LAB / "dataloader_workers.py"), *args], preexec_fn=preexec_fn)


@needs_unshare("-m")
def test_small_dev_shm_kills_the_workers_and_the_fixes():
    default, fs, sparse = loader(shm="64m"), loader("--sharing", "file_system", shm="64m"), \
        loader("--sparse-shm", shm="64m")
    no_workers, bigger = loader("--workers", "0", shm="64m"), loader(shm="256m")
    default, fs, sparse, no_workers, bigger = finish_all(default, fs, sparse, no_workers, bigger)
    for job in (default, fs):  # the file_system strategy also lives in /dev/shm: no help here
        failed_quickly(job)
        assert "Caught RuntimeError in DataLoader worker process" in job.out
        assert "unable to allocate shared memory(shm)" in job.out and "No space left on device" in job.out
    failed_quickly(sparse)
    assert "Unexpected bus error encountered in worker" in sparse.out, sparse.out[-3000:]
    # The main process then notices the dead worker, or first loses the connection it was reading from (timing).
    assert any(end in sparse.out for end in ("is killed by signal: Bus error", "ConnectionResetError", "EOFError")), \
        sparse.out[-3000:]
    for job in (no_workers, bigger):
        succeeded(job)
        assert "ok: 4 batches" in job.out


def test_too_many_open_files_and_the_file_system_strategy():
    def few_files():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # a low `ulimit -n`, in the child only

    fds, fs = finish_all(loader("--many-tensors", preexec_fn=few_files),
                         loader("--many-tensors", "--sharing", "file_system", preexec_fn=few_files))
    failed_quickly(fds)
    assert "received 0 items of ancdata" in fds.out, fds.out[-3000:]
    succeeded(fs)
    assert "ok: 64 batches" in fs.out


# ---------------------------------------------------------------- every line in one write

SLOW_STDOUT = '''import sys, time
class _Slow:  # a stdout that pauses after any write that does not end a line
    def __init__(self, stream): self._stream = stream
    def write(self, text):
        n = self._stream.write(text)
        if text and not text.endswith("\\n"):
            self._stream.flush(); time.sleep(0.3)
        return n
    def __getattr__(self, name): return getattr(self._stream, name)
sys.stdout = _Slow(sys.stdout)
'''


def test_ranks_never_share_an_output_line(tmp_path):
    """Every line the ranks print is ONE write. print() writes the text and the newline separately, so
    two ranks printing together could give "[rank 1] pid 17465[rank 0] pid 17464". A stdout that waits
    0.3 s after a write without a newline (a sitecustomize in every process) makes that certain."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_STDOUT)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), ENV.get("PYTHONPATH")]))}
    job = torchrun("stuck_rank.py", "--fix", env=env).finish()
    succeeded(job)
    lines = job.out.splitlines()
    assert {"[rank 0]", "[rank 1]"} <= {line[:8] for line in lines}, job.out[-3000:]  # both ranks spoke
    assert not [line for line in lines if line.count("[rank ") > 1], job.out[-3000:]
    # The other multi-rank scripts print the same way: through say(), never print().
    for script in ("stuck_rank.py", "uneven_inputs.py", "unused_parameters.py", "diverged_replicas.py", "rendezvous.py"):
        code = (LAB / script).read_text()
        assert "import write_line as say" in code and not re.search(r"^\s*print\(", code, re.M), script
