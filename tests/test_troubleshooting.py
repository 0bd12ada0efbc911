"""The failure lab (troubleshooting/), its failures of the ranks' code: each happens as the README says, ends by
itself, and its fix works. A stuck rank, uneven inputs, unused parameters, replicas that diverge silently, and
every line a rank prints in one write. The host's failures: test_troubleshooting_host.py; how the runs are
started and bounded: failure_lab.py.
"""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from failure_lab import ENV, LAB, Job, failed_quickly, finish_all, succeeded, torchrun


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
