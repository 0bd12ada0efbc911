"""The Slurm test harness itself: real jobs on a real two-node cluster (tests/slurm/)."""
import subprocess
import sys
from pathlib import Path

import pytest

from slurm import netns
from slurm.cluster import SlurmCluster
from slurm.fixtures import skip_or_fail, unavailable_reason

TWO_NODES = ["--nodes=2", "--ntasks-per-node=1"]

ALLREDUCE = """\
import os, socket, sys
import torch, torch.distributed as dist
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)  # SUM over ranks: 1 + 2 = 3
print(f"rank={rank} host={socket.gethostname()} sum={t.item():g} python={sys.executable}", flush=True)
dist.destroy_process_group()
"""


def finished(cluster, job, timeout=120):
    """(final state, standard output) of a job."""
    state = cluster.wait(job, timeout)
    return state, cluster.output(job)


def machine_state():
    """What tear-down must restore: /etc/hosts, and no namespaces or links of ours."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    namespaces = sorted(Path("/run/netns").glob(netns.PREFIX + "*"))
    return Path("/etc/hosts").read_text(), namespaces, [l for l in links.splitlines() if netns.PREFIX in l]


def test_teardown_restores_the_machine():
    # runs before the session cluster exists (first in this file), as both use the same names
    reason = unavailable_reason()
    if reason:
        skip_or_fail(reason)
    owner = netns.hosts_owner()
    if owner and netns.pid_alive(owner[0]):
        pytest.skip("another test cluster is already up (a module before this one used slurm_cluster)")
    before = machine_state()
    with SlurmCluster() as cluster:
        state_dir = cluster.dir
        assert netns.MARK in Path("/etc/hosts").read_text()
        assert len(netns.processes(state_dir)) >= 4  # munged, slurmctld, 2 slurmd: the check below sees them
        job = cluster.submit("#!/bin/bash\nsrun hostname\n")
        assert cluster.wait(job) == "COMPLETED", cluster.daemon_logs()
    assert machine_state() == before
    assert not netns.processes(state_dir), "slurmctld, slurmd or munged of ours still running"
    assert not state_dir.exists()


def test_two_nodes_run_srun_hostname(slurm_cluster):
    job = slurm_cluster.submit("#!/bin/bash\nsrun hostname\n", sbatch_opts=TWO_NODES)
    state, out = finished(slurm_cluster, job)
    assert state == "COMPLETED", out + slurm_cluster.daemon_logs()
    assert sorted(out.split()) == ["n1", "n2"]


def test_gpu_gres_sets_cuda_visible_devices(slurm_cluster):
    script = '#!/bin/bash\nsrun bash -c \'echo "$(hostname) CVD=$CUDA_VISIBLE_DEVICES"\'\n'
    job = slurm_cluster.submit(script, sbatch_opts=[*TWO_NODES, "--gpus-per-node=2"])
    state, out = finished(slurm_cluster, job)
    assert state == "COMPLETED", out + slurm_cluster.daemon_logs()
    assert sorted(out.splitlines()) == ["n1 CVD=0,1", "n2 CVD=0,1"]


def test_gloo_all_reduce_across_two_nodes(slurm_cluster, tmp_path):
    (tmp_path / "allreduce.py").write_text(ALLREDUCE)  # same filesystem on every node
    script = """#!/bin/bash
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
export MASTER_PORT=29512
srun python allreduce.py
"""
    job = slurm_cluster.submit(script, cwd=tmp_path, sbatch_opts=TWO_NODES)
    state, out = finished(slurm_cluster, job)
    assert state == "COMPLETED", out + slurm_cluster.daemon_logs()
    lines = sorted(l for l in out.splitlines() if l.startswith("rank="))
    assert lines == [f"rank={r} host=n{r + 1} sum=3 python={sys.executable}" for r in (0, 1)], out


def test_failing_job_is_failed(slurm_cluster):
    job = slurm_cluster.submit("#!/bin/bash\necho about to fail\nexit 3\n")
    state, out = finished(slurm_cluster, job)
    assert state == "FAILED"
    assert slurm_cluster.job_info(job)["ExitCode"] == "3:0"
    assert "about to fail" in out
