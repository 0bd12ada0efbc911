"""Every lesson's Slurm submit script, read and run without a cluster (test_slurm_lessons.py submits them to one).

Each script is valid bash with the course's #SBATCH lines for its launch style (torchrun, srun, single); its one
shared line sources slurm/job_env.sh, which a fake job environment runs here (the variables the scripts use, an
array task's port and folder, a script of another course copy refused); slurm/site.sh holds the site's settings,
its note on NCCL error handling checked against the installed torch; outside a job, a script stops with one line.
"""
import os
import re
import subprocess
from pathlib import Path

import pytest

from slurm.jobs import (ROOT, SCRIPTS, SOURCE_LINE, LEAKY, TRAINING, PREEMPTIBLE, text, directives, shared_part,
                        fake_job_env, probe_job_env)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_is_valid_bash_with_consistent_directives(name):
    script, style = SCRIPTS[name]
    path = ROOT / script
    assert os.access(path, os.X_OK), f"{script} is not executable"
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    body = path.read_text()
    d = directives(body)
    assert d["--output"] == "logs/%x-%j.out" and "--job-name" in d and "--time" in d
    # site-neutral: account and partition come from SBATCH_ACCOUNT/SBATCH_PARTITION or the sbatch line (slurm/site.sh)
    assert "SBATCH --account" not in body and "SBATCH --partition" not in body
    assert "set -euo pipefail" in body and body.rstrip().endswith('"$@"')  # trailing args go to Python
    gpus = int(d["--gpus-per-node"])
    if style == "torchrun":  # one torchrun per node, as many processes as GPUs
        assert d["--ntasks-per-node"] == "1" and 'nproc_per_node="$NPROC_PER_NODE"' in body
    elif style == "srun":  # one task per GPU
        assert int(d["--ntasks-per-node"]) == gpus
    else:
        assert d["--ntasks"] == "1"
    for line in body.splitlines():
        if re.match(r"\s*srun\b", line):
            assert "--kill-on-bad-exit=1" in line, line
    # The launch line of each style stays in the script; the set-up they share is in slurm/job_env.sh, and what
    # differs between clusters in slurm/site.sh: no SITE SECTION, no site variable in a script.
    assert {"srun": "srun --kill-on-bad-exit=1", "single": "    python ", "torchrun": "    torchrun "}[style] in body
    assert "conda activate" not in body and "scontrol show hostnames" not in body, "belongs in slurm/job_env.sh"
    assert not re.search(r"SITE SECTION|^(MODULES|CONDA_ENV|VENV|WORKSHOP_DATA_DIR|OUTPUT_ROOT)=|export NCCL_", body, re.M)
    if style == "srun":  # one line per task with the GPUs it sees, before training
        assert "\nshow_tasks  #" in body
    if name in PREEMPTIBLE:  # preemption: a warning signal to the steps, requeue, one log
        assert d["--signal"] == "USR1@120" and "--requeue" in d and d["--open-mode"] == "append"
    if name in TRAINING:  # resume in its own folder
        assert body.rstrip().endswith('--output-dir "$OUTPUT_DIR" --resume auto "$@"')  # yours come later, and win
        # Slurm signals the processes of job steps, not the batch shell: the training processes run under srun.
        assert re.search(r"^srun [^\n]*\\\n(    [^\n]*\\\n)*    (python|torchrun) ", body, re.M), body
    if style == "torchrun" and name in PREEMPTIBLE:  # torchrun would die of SIGUSR1: it starts with it ignored
        assert re.search(r"""(bash|sh) -c 'trap "" USR1; exec "\$@"' _ \\\n    torchrun """, body), body
    if name in TRAINING:  # the node-local data step (a no-op unless STAGE_DATA=1), before anything starts
        assert f"{SOURCE_LINE}  # " in body and "\nstage_data  # STAGE_DATA=1" in body


@pytest.mark.parametrize("name", SCRIPTS)
def test_one_line_finds_the_course(name):
    """`set -euo pipefail`, then ONE line: source slurm/job_env.sh of the folder sbatch ran in ($SLURM_SUBMIT_DIR)."""
    part = shared_part(text(name)).splitlines()
    assert len(part) == 2 and part[1].startswith(SOURCE_LINE + "  # "), part
    assert "COURSE_DIR=" not in text(name) and "while " not in text(name)


def test_the_scripts_share_one_set_up():
    """Every script: #SBATCH lines, then `set -euo pipefail` and the line that sources slurm/job_env.sh (which finds
    the course from its own place and reads slurm/site.sh), then its launch lines."""
    for name in SCRIPTS:  # nothing but comments and #SBATCH lines above the shared part
        head = text(name)[:text(name).index("set -euo pipefail")].splitlines()[1:]
        assert all(l.startswith("#") for l in head), name
    for f in ("slurm/job_env.sh", "slurm/site.sh"):
        done = subprocess.run(["bash", "-n", str(ROOT / f)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    job_env = (ROOT / "slurm/job_env.sh").read_text()
    assert 'COURSE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)' in job_env
    assert 'source "$COURSE_DIR/slurm/site.sh"' in job_env


def test_job_env_sets_what_the_scripts_use(tmp_path):
    env = fake_job_env(tmp_path, command=ROOT / SCRIPTS["ddp"][0], SLURM_CPUS_PER_TASK="8",
                       SLURM_GPUS_PER_NODE="a100:2", OUTPUT_ROOT=str(tmp_path / "o"))
    done = probe_job_env(tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert "== job 12345 (ddp) on 2 node(s): n[3-4]\n" in done.stdout, done.stdout
    assert (f"COURSE={ROOT} ADDR=n3 PORT={20000 + 12345 % 20000} OUT={tmp_path}/o/ddp-12345 NPROC=2 CPP=4 OMP=4 NW=3 "
            f"RANK=unset PP={ROOT}") in done.stdout, done.stdout
    again = probe_job_env(tmp_path, {**env, "SLURM_RESTART_COUNT": "2", "MASTER_PORT": "31000", "NPROC_PER_NODE": "3"})
    assert again.returncode == 0, again.stderr
    assert "n[3-4] | restart 2\n" in again.stdout and "PORT=31000 " in again.stdout, again.stdout
    assert "NPROC=3 CPP=2 OMP=2 NW=1 " in again.stdout, again.stdout
    # an array task: the port from its own job id (not the array's: the same in every task), a folder of its own
    task = probe_job_env(tmp_path, {**env, "SLURM_ARRAY_JOB_ID": "12340", "SLURM_ARRAY_TASK_ID": "3"})
    assert task.returncode == 0, task.stderr
    assert f"PORT={20000 + 12345 % 20000} OUT={tmp_path}/o/ddp-12340/task-3 " in task.stdout, task.stdout


def test_scripts_say_where_the_course_is_missing(tmp_path):
    """Submitted from a folder that is not the course: the source line names the missing file, and the job stops."""
    env = fake_job_env(tmp_path, SLURM_SUBMIT_DIR=str(ROOT / "05_multigpu_fsdp_training"))
    done = subprocess.run(["bash", str(ROOT / SCRIPTS["fsdp"][0])], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert f"{ROOT}/05_multigpu_fsdp_training/slurm/job_env.sh: No such file or directory" in done.stderr, done.stderr
    assert "== job" not in done.stdout


def test_scripts_refuse_a_script_of_another_course_copy(tmp_path):
    """sbatch /other/copy/04_ddp_training/x.sh from this course would run THIS copy's code: job_env.sh refuses it."""
    other = tmp_path / "old-copy/04_ddp_training/slurm_submit_ddp.sh"
    env = fake_job_env(tmp_path, command=other)
    done = probe_job_env(tmp_path, env)
    assert done.returncode == 1 and f"error: {other} is not in the course folder {ROOT} you submitted from:" \
        in done.stderr, done.stderr


def test_site_file_holds_the_site_settings():
    """slurm/site.sh: the variables a site sets (empty defaults, so a submit-time value wins), the debugging notes,
    the fabric (NCCL/libfabric) block, and where account and partition come from instead."""
    site = (ROOT / "slurm/site.sh").read_text()
    for var in ("MODULES", "CONDA_ENV", "VENV", "WORKSHOP_DATA_DIR", "OUTPUT_ROOT", "NODE_LOCAL_DIR", "APPTAINER_IMAGE",
                "NCCL_PLUGIN_DIR"):
        assert re.search(rf"^{var}=\${{{var}:-}}", site, re.M), var
    assert re.search(r"^STAGE_DATA=\$\{STAGE_DATA:-0\}", site, re.M)
    for var in ("NCCL_DEBUG=INFO", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_NET_PLUGIN=ofi", 'NCCL_NET="AWS Libfabric"', "FI_PROVIDER=efa",
                "FI_EFA_USE_HUGE_PAGE=0", "FI_CXI_DISABLE_HOST_REGISTER=1", "TORCH_DISTRIBUTED_DEBUG=DETAIL",
                "DIST_TIMEOUT_SECONDS"):
        assert f"# export {var}" in site, var
    assert "SBATCH_ACCOUNT" in site and "SBATCH_PARTITION" in site
    assert "default is 3 (SkipCleanUp" in site and "torchrun sets 1 (TearDown)" in site


def test_site_note_on_nccl_error_handling_matches_installed_torch():
    """What slurm/site.sh says of TORCH_NCCL_ASYNC_ERROR_HANDLING, checked against the installed torch's sources."""
    import torch
    torch_dir = Path(torch.__file__).parent
    header = torch_dir / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    if not header.exists():
        pytest.skip("this torch wheel ships no C++ headers")
    assert "the default value (3 - SkipCleanUp)" in header.read_text()
    agent = (torch_dir / "distributed/elastic/agent/server/local_elastic_agent.py").read_text()
    assert re.search(r'"TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv\(\s*"TORCH_NCCL_ASYNC_ERROR_HANDLING", str\(1\)', agent)


def test_scripts_refuse_to_run_outside_a_job(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LEAKY}
    done = subprocess.run(["bash", str(ROOT / SCRIPTS["ddp"][0])], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 1 and "SLURM_SUBMIT_DIR: submit with sbatch from the course folder" in done.stderr, \
        done.stderr
    # SLURM_SUBMIT_DIR left in a shell from an earlier job: slurm/job_env.sh checks for a job too
    done = subprocess.run(["bash", str(ROOT / SCRIPTS["ddp"][0])], capture_output=True, text=True,
                          env={**env, "SLURM_SUBMIT_DIR": str(ROOT)}, cwd=tmp_path)
    assert done.returncode == 1 and "error: not inside a Slurm job: submit it with sbatch" in done.stderr, done.stderr
