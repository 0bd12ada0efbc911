"""Every lesson's Slurm submit script, submitted UNCHANGED to the real two-node test cluster.

The test varies only what a learner varies without editing a script:
  sbatch options   --chdir=<tmp>: the job works there, so logs/%x-%j.out lands in a temporary
                   folder (with logs/ made first), not in the repository; the submit folder stays
                   the course (or a lesson folder), which is how the scripts find the course.
                   --cpus-per-task=1 or 2: each test node has 2 CPUs; the scripts ask for GPU-node
                   sized counts (4-8), which the test cluster could never schedule.
  environment      NPROC_PER_NODE=2 for some torchrun jobs; the others derive 2 processes from the
                   GPU GRES the test nodes declare (the "GPUs" are /dev/null: no CUDA, so gloo).
  trailing args    --device cpu --data synthetic, a few steps, an output folder per job (it comes after
                   the scripts' own --output-dir and wins; OUTPUT_ROOT also points that one to tmp).
  GPU binding      the srun-style DDP job gets --gpus-per-task=1, as many sites require: each task then sees
                   one GPU of its node (CUDA_VISIBLE_DEVICES), whatever its local rank.
All jobs are submitted at once, then each test waits for its own; the cluster runs them as its
2 nodes x (2 CPUs, 2 GPUs) allow. A failed job shows its log and the Slurm daemon logs.
"""
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {  # name -> (script, launch style)
    "setup": ("01_setup/slurm_submit_setup.sh", "srun"),
    "single": ("02_singlegpu_training/slurm_submit_singlegpu.sh", "single"),
    "dp": ("03_dp_training/slurm_submit_dp.sh", "single"),
    "ddp": ("04_ddp_training/slurm_submit_ddp.sh", "torchrun"),
    "ddp_multinode": ("04_ddp_training/slurm_submit_ddp_multinode.sh", "torchrun"),
    "ddp_srun": ("04_ddp_training/slurm_submit_ddp_srun.sh", "srun"),
    "fsdp": ("05_multigpu_fsdp_training/slurm_submit_fsdp.sh", "torchrun"),
}
DEADLINE_S = 300  # for all jobs together, from submission
TEST_SAMPLES = {"single": 77, "dp": 77, "ddp": 77, "fsdp": 77, "ddp_multinode": 101, "ddp_srun": 101}
# sbatch copies the submitting shell's environment into the job: the test's own shell must not
# decide the outcome (site settings, or launcher variables left over from experiments).
LEAKY = ("COURSE_DIR", "MODULES", "CONDA_ENV", "VENV", "WORKSHOP_DATA_DIR", "OUTPUT_ROOT", "NPROC_PER_NODE",
         "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "FAIL_AT_STEP")
TRAINING = ("single", "dp", "ddp", "ddp_multinode", "ddp_srun", "fsdp")  # they checkpoint and resume
PREEMPTIBLE = ("ddp", "ddp_multinode", "ddp_srun", "fsdp")  # from lesson 04 on: they also stop and requeue
RANK_LINE = re.compile(r"^\[rank (\d+)\] host (\S+) rank (\d+)/(\d+) local_rank (\d+) device (\S+) backend (\S+)$", re.M)


def text(name):
    return (ROOT / SCRIPTS[name][0]).read_text()


def directives(script_text):
    """The #SBATCH options sbatch reads: those above the first command, as {option: value}."""
    found = {}
    for line in script_text.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if m := re.match(r"#SBATCH\s+(--[\w-]+)(?:=(\S+))?", line):
            found[m.group(1)] = m.group(2)
    return found


# ---- static checks: no cluster needed ----------------------------------------------------------
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
    assert 'source "$COURSE_DIR/slurm/job_env.sh"' in body
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
    if style == "torchrun":  # torchrun would die of SIGUSR1: it starts with the signal ignored (its workers handle it)
        assert re.search(r"""bash -c 'trap "" USR1; exec "\$@"' _ \\\n    torchrun """, body), body


def shared_part(script_text):
    """From `set -euo pipefail` (the first command) to the line that sources slurm/job_env.sh."""
    start = script_text.index("set -euo pipefail")
    end = script_text.index('source "$COURSE_DIR/slurm/job_env.sh"')
    return script_text[start:script_text.index("\n", end)]


def test_the_scripts_share_one_set_up():
    """Every script: #SBATCH lines, then the same few lines that find the course and source slurm/job_env.sh
    (which reads slurm/site.sh), then its launch lines."""
    parts = {name: shared_part(text(name)) for name in SCRIPTS}
    assert all(p == parts["setup"] for p in parts.values()), [n for n, p in parts.items() if p != parts["setup"]]
    assert len(parts["setup"].splitlines()) <= 8
    for name in SCRIPTS:  # nothing but comments and #SBATCH lines above the shared part
        head = text(name)[:text(name).index("set -euo pipefail")].splitlines()[1:]
        assert all(l.startswith("#") for l in head), name
    for f in ("slurm/job_env.sh", "slurm/site.sh"):
        done = subprocess.run(["bash", "-n", str(ROOT / f)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert 'source "$COURSE_DIR/slurm/site.sh"' in (ROOT / "slurm/job_env.sh").read_text()


def fake_job_env(tmp_path, **slurm):
    """The environment of a batch job, without Slurm: SLURM_* variables and a stand-in scontrol."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "n3\\nn4\\n"\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LEAKY}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="12345", SLURM_JOB_NAME="ddp",
               SLURM_JOB_NODELIST="n[3-4]", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(ROOT / "04_ddp_training"),
               RANK="7", WORLD_SIZE="9")  # left over from a shell: the scripts unset them
    env.update(slurm)
    return env


def test_job_env_sets_what_the_scripts_use(tmp_path):
    """A script's own lines up to slurm/job_env.sh (found upwards from a lesson folder), with a stand-in scontrol."""
    env = fake_job_env(tmp_path, SLURM_CPUS_PER_TASK="8", SLURM_GPUS_PER_NODE="a100:2", OUTPUT_ROOT=str(tmp_path / "o"))
    script = text("ddp")
    probe = script[:script.index("split_cpus_for_torchrun  #")] + (
        "split_cpus_for_torchrun\n"
        'echo "COURSE=$COURSE_DIR ADDR=$MASTER_ADDR PORT=$MASTER_PORT OUT=$OUTPUT_DIR NPROC=$NPROC_PER_NODE" \\\n'
        '     "CPP=$CPUS_PER_PROC OMP=$OMP_NUM_THREADS NW=$NUM_WORKERS RANK=${RANK:-unset} PP=$PYTHONPATH"\n')
    done = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "== job 12345 (ddp) on 2 node(s): n[3-4]\n" in done.stdout, done.stdout
    assert (f"COURSE={ROOT} ADDR=n3 PORT={20000 + 12345 % 20000} OUT={tmp_path}/o/ddp-12345 NPROC=2 CPP=4 OMP=4 NW=3 "
            f"RANK=unset PP={ROOT}") in done.stdout, done.stdout
    again = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                           env={**env, "SLURM_RESTART_COUNT": "2", "MASTER_PORT": "31000", "NPROC_PER_NODE": "3"})
    assert again.returncode == 0, again.stderr
    assert "n[3-4] | restart 2\n" in again.stdout and "PORT=31000 " in again.stdout, again.stdout
    assert "NPROC=3 CPP=2 OMP=2 NW=1 " in again.stdout, again.stdout


def test_scripts_say_where_the_course_is_missing(tmp_path):
    env = fake_job_env(tmp_path, SLURM_SUBMIT_DIR=str(tmp_path))
    done = subprocess.run(["bash", str(ROOT / SCRIPTS["fsdp"][0])], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert f"no course folder (one holding slurm/job_env.sh) in COURSE_DIR or at or above {tmp_path}:" in done.stderr


def test_site_file_holds_the_site_settings():
    """slurm/site.sh: the variables a site sets (empty defaults, so a submit-time value wins), the debugging notes,
    and where account and partition come from instead."""
    site = (ROOT / "slurm/site.sh").read_text()
    for var in ("MODULES", "CONDA_ENV", "VENV", "WORKSHOP_DATA_DIR", "OUTPUT_ROOT"):
        assert re.search(rf"^{var}=\${{{var}:-}}", site, re.M), var
    for var in ("NCCL_DEBUG=INFO", "NCCL_DEBUG_SUBSYS", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_DISABLE",
                "TORCH_DISTRIBUTED_DEBUG=DETAIL", "DIST_TIMEOUT_SECONDS"):
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
    for extra in ({}, {"COURSE_DIR": str(ROOT)}):  # the check comes first, and again in slurm/job_env.sh
        done = subprocess.run(["bash", str(ROOT / SCRIPTS["ddp"][0])], capture_output=True, text=True,
                              env={**env, **extra}, cwd=tmp_path)
        assert done.returncode == 1 and "not inside a Slurm job: submit it with sbatch" in done.stderr, done.stderr


# ---- the real cluster ----------------------------------------------------------------------------
@dataclass
class Job:
    name: str
    id: int
    workdir: Path  # --chdir: the job's logs/ is here
    out_dir: Path  # --output-dir of the training script
    deadline: float
    state: str | None = field(default=None)


def sbatch(cluster, script, args, cpus, env=None, submit_from=ROOT, workdir=None, opts=()):
    """sbatch the script as a learner would (cwd = submit folder); only the options named in the docstring."""
    full_env = {k: v for k, v in cluster.env.items() if k not in LEAKY}
    full_env.update(env or {})
    cmd = ["sbatch", "--parsable", f"--chdir={workdir}", f"--cpus-per-task={cpus}", *opts, str(ROOT / script),
           *map(str, args)]
    done = subprocess.run(cmd, env=full_env, cwd=submit_from, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr}"
    return int(done.stdout.strip().split(";")[0])


@pytest.fixture(scope="module")
def jobs(slurm_cluster, synthetic_dir, tmp_path_factory):
    """Submit every script at once (plus one without a logs/ folder); yield {name: Job}."""
    plan = {  # name -> (cpus per task, environment, submit folder, other sbatch options)
        "setup": (1, {}, ROOT, ()),
        "single": (1, {}, ROOT / "02_singlegpu_training", ()),  # from a lesson folder: the course is found upwards
        "dp": (2, {}, ROOT, ()),
        "ddp": (2, {}, ROOT, ()),  # 2 processes from the 2 GPUs of the GRES, no NPROC_PER_NODE
        "fsdp": (2, {"NPROC_PER_NODE": "2"}, ROOT, ()),
        "ddp_multinode": (2, {"NPROC_PER_NODE": "2"}, ROOT, ()),
        "ddp_srun": (1, {"VENV": str(ROOT / ".venv")}, ROOT, ("--gpus-per-task=1",)),  # one GPU bound to each task
    }
    submitted, deadline = {}, time.monotonic() + DEADLINE_S
    for name, (cpus, env, submit_from, opts) in plan.items():
        workdir = tmp_path_factory.mktemp(f"job-{name}")
        (workdir / "logs").mkdir()
        out_dir = workdir / "out"
        env = {**env, "OUTPUT_ROOT": str(workdir / "runs")}  # unused: the --output-dir below comes later
        args = [] if name == "setup" else [
            "--data", "synthetic", "--data-dir", synthetic_dir, "--train-samples", 512,
            "--test-samples", TEST_SAMPLES[name], "--epochs", 1, "--max-steps", 3, "--device", "cpu",
            "--num-workers", 0, "--output-dir", out_dir]
        job_id = sbatch(slurm_cluster, SCRIPTS[name][0], args, cpus, env, submit_from, workdir, opts)
        submitted[name] = Job(name, job_id, workdir, out_dir, deadline)
    no_logs = tmp_path_factory.mktemp("job-no-logs")  # no logs/ folder in it
    submitted["no_logs"] = Job("no_logs", sbatch(slurm_cluster, SCRIPTS["setup"][0], [], 1, workdir=no_logs),
                               no_logs, no_logs / "out", deadline)
    yield submitted
    for job in submitted.values():  # nothing of ours left running for the next module
        if job.state is None:
            subprocess.run(["scancel", str(job.id)], env=slurm_cluster.env, capture_output=True)


def log_path(cluster, job):
    return Path(cluster.job_info(job.id)["StdOut"])


def wait(cluster, job):
    """Final state of the job (COMPLETED, FAILED, ...); its log and the daemon logs if it hangs."""
    try:
        job.state = cluster.wait(job.id, timeout=max(5.0, job.deadline - time.monotonic()))
    except TimeoutError as exc:
        job.state = "TIMEOUT(test)"
        pytest.fail(f"{job.name} job {job.id} did not finish in {DEADLINE_S} s\n{job_log(cluster, job)}\n{exc}")
    return job.state


def job_log(cluster, job):
    path = log_path(cluster, job)
    body = path.read_text(errors="replace") if path.exists() else "(no log file)"
    return f"----- {path} -----\n{body}"


def before_exit_barrier_race(log):
    """The log up to the last epoch line when torchrun's exit-barrier race follows it, else all of it.

    Two-node torchrun: the first node's torchrun hosts the rendezvous store. When it exits a moment
    before the other torchrun has read the final barrier, that one logs "Error waiting on exit barrier"
    and C++ frames, after the training has ended and with the job COMPLETED (pytorch/pytorch#69520)."""
    if "Error waiting on exit barrier" not in log:
        return log
    return log[:log.index("\n", log.rindex("\nepoch ") + 1) + 1]


def completed(cluster, job):
    """Wait for the job, assert it COMPLETED and wrote its log where its #SBATCH --output says; return the log."""
    state = wait(cluster, job)
    info = cluster.job_info(job.id)
    assert state == "COMPLETED", (f"{job.name} job {job.id} ended {state}, exit {info.get('ExitCode')}\n"
                                  f"{job_log(cluster, job)}\n{cluster.daemon_logs()}")
    path = log_path(cluster, job)
    assert path == job.workdir / "logs" / f"{info['JobName']}-{job.id}.out"
    log = path.read_text()
    assert f"== job {job.id} ({info['JobName']})" in log and "Traceback" not in before_exit_barrier_race(log), log
    assert f"course {ROOT} |" in log, log
    if job.name in TRAINING:  # --resume auto looked in the last --output-dir: the test's
        assert f"resume: starting fresh (no checkpoint in {job.out_dir}" in log, log
        assert not (job.workdir / "runs").exists(), log
    return log


def check_metrics(job, world_size, test_samples, backend="gloo"):
    m = json.loads((job.out_dir / "metrics.json").read_text())
    assert m["world_size"] == world_size and m["backend"] == backend and m["device"] == "cpu"
    assert [r["test_samples"] for r in m["epochs"]] == [test_samples]  # every test image counted once
    assert m["args"]["max_steps"] == 3 and m["args"]["num_workers"] == 0  # trailing args reached Python, last wins
    return m


def rank_lines(log):
    """[(rank, host, world, local_rank)] from lesson 04/05's per-rank lines."""
    rows = [(int(r), host, int(w), int(lr)) for r, host, r2, w, lr, dev, be in RANK_LINE.findall(log)]
    assert rows and all(dev == "cpu" and be == "gloo" for *_, dev, be in RANK_LINE.findall(log)), log
    return sorted(rows)


TASK_LINE = re.compile(r"^== task (\d+) on (\S+): local rank (\d+), CUDA_VISIBLE_DEVICES=(\S+)$", re.M)


def task_lines(log):
    """{node: [(rank, local rank, CUDA_VISIBLE_DEVICES)]} from the srun-style scripts' show_tasks lines."""
    by_node = {}
    for rank, node, local_rank, cvd in TASK_LINE.findall(log):
        by_node.setdefault(node, []).append((int(rank), int(local_rank), cvd))
    return {node: sorted(rows) for node, rows in by_node.items()}


def test_01_setup_checks_env_then_collectives(slurm_cluster, jobs):
    log = completed(slurm_cluster, jobs["setup"])
    assert log.count("verdict: READY") == 1, log  # check_env.py once per node (1 node)
    assert "OK: all_reduce, broadcast, all_gather and barrier verified on 2 rank(s)" in log, log
    assert sorted(re.findall(r"rank \d of 2", log)) == ["rank 0 of 2", "rank 1 of 2"], log
    assert f"rendezvous {slurm_cluster.job_info(jobs['setup'].id)['NodeList']}:{20000 + jobs['setup'].id % 20000}" in log
    node = slurm_cluster.job_info(jobs["setup"].id)["NodeList"]  # no GPU binding: each task sees the node's 2 GPUs
    assert task_lines(log) == {node: [(0, 0, "0,1"), (1, 1, "0,1")]}, log


def test_02_single_process_from_the_lesson_folder(slurm_cluster, jobs):
    log = completed(slurm_cluster, jobs["single"])
    assert "lesson 02: 1 process on cpu" in log and "epoch 1 |" in log, log
    check_metrics(jobs["single"], 1, TEST_SAMPLES["single"], backend=None)


def test_03_dataparallel_one_task(slurm_cluster, jobs):
    log = completed(slurm_cluster, jobs["dp"])
    assert "DataParallel needs 2+ GPUs and does nothing on cpu" in log, log
    check_metrics(jobs["dp"], 1, TEST_SAMPLES["dp"], backend=None)


def test_04_ddp_one_node_takes_processes_from_the_gpus(slurm_cluster, jobs):
    log = completed(slurm_cluster, jobs["ddp"])
    assert "GPUs 2 | processes 2" in log, log  # NPROC_PER_NODE not set: read from SLURM_GPUS_ON_NODE
    rows = rank_lines(log)
    assert [(r, w, lr) for r, _, w, lr in rows] == [(0, 2, 0), (1, 2, 1)], log
    assert len({host for _, host, _, _ in rows}) == 1, log
    check_metrics(jobs["ddp"], 2, TEST_SAMPLES["ddp"])


@pytest.mark.parametrize("name", ["ddp_multinode", "ddp_srun"])
def test_04_ddp_two_nodes_two_processes_each(slurm_cluster, jobs, name):
    """World size 4 over n1 and n2 in both styles; the srun style with one GPU bound to each task."""
    job = jobs[name]
    log = completed(slurm_cluster, job)
    assert f"rendezvous n1:{20000 + job.id % 20000}" in log, log
    rows = rank_lines(log)
    assert [r for r, *_ in rows] == [0, 1, 2, 3] and {w for _, _, w, _ in rows} == {4}, log
    by_host = {}
    for rank, host, _, local_rank in rows:
        by_host.setdefault(host, []).append((rank, local_rank))
    assert sorted(by_host) == ["n1", "n2"], log
    for pairs in by_host.values():  # two processes per node, local ranks 0 and 1, consecutive global ranks
        assert [lr for _, lr in pairs] == [0, 1] and pairs[1][0] == pairs[0][0] + 1, log
    if name == "ddp_srun":  # Slurm's block distribution: tasks 0, 1 on the first node
        assert by_host["n1"] == [(0, 0), (1, 1)], log
        # --gpus-per-task=1: every task saw exactly one GPU, a different one from the other task of its node
        assert "GPUs per node 2 (per task 1) |" in log, log
        tasks = task_lines(log)
        assert sorted(tasks) == ["n1", "n2"] and [r for rows in tasks.values() for r, _, _ in rows] == [0, 1, 2, 3], log
        for rows in tasks.values():
            gpus = [cvd for _, _, cvd in rows]
            assert all(g.isdigit() for g in gpus) and len(set(gpus)) == len(gpus) == 2, log
    assert log.count("epoch 1 |") == 1, log  # only global rank 0 reports
    check_metrics(job, 4, TEST_SAMPLES[name])


def test_05_fsdp_one_node(slurm_cluster, jobs):
    log = completed(slurm_cluster, jobs["fsdp"])
    assert "lesson 05: 2 processes" in log, log
    assert [(r, w, lr) for r, _, w, lr in rank_lines(log)] == [(0, 2, 0), (1, 2, 1)], log
    check_metrics(jobs["fsdp"], 2, TEST_SAMPLES["fsdp"])
    assert (jobs["fsdp"].out_dir / "model_full.pt").stat().st_size > 0


def test_missing_logs_folder_fails_the_job_without_a_log(slurm_cluster, jobs):
    """What slurm/README.md tells learners: Slurm does not create logs/, the job just fails."""
    job = jobs["no_logs"]
    assert wait(slurm_cluster, job) == "FAILED"
    assert not (job.workdir / "logs").exists() and not log_path(slurm_cluster, job).exists()
