"""What the Slurm tests of the lesson scripts share: the scripts, the environment a job must not inherit,
sbatch as a learner runs it, waiting for a job, and reading its log and checkpoints.
test_slurm_scripts.py, test_slurm_lessons.py, test_slurm_sweep.py, test_slurm_hsdp.py and test_slurm_lesson06.py to
test_slurm_lesson08.py use it."""
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {  # name -> (script, launch style)
    "setup": ("01_setup/slurm_submit_setup.sh", "srun"),
    "single": ("02_singlegpu_training/slurm_submit_singlegpu.sh", "single"),
    "dp": ("03_dp_training/slurm_submit_dp.sh", "single"),
    "ddp": ("04_ddp_training/slurm_submit_ddp.sh", "torchrun"),
    "ddp_multinode": ("04_ddp_training/slurm_submit_ddp_multinode.sh", "torchrun"),
    "ddp_srun": ("04_ddp_training/slurm_submit_ddp_srun.sh", "srun"),
    "fsdp": ("05_multigpu_fsdp_training/slurm_submit_fsdp.sh", "torchrun"),
    "apptainer": ("04_ddp_training/slurm_submit_ddp_apptainer.sh", "torchrun"),
}
SOURCE_LINE = 'source "${SLURM_SUBMIT_DIR:?submit with sbatch from the course folder}/slurm/job_env.sh"'
FAKEBIN = ROOT / "tests" / "fakebin"  # stand-ins for commands this machine lacks (apptainer)
DEADLINE_S = 480  # for all jobs together, from submission: ~200 s on an idle 2-core machine, ~300 s at load 10
TEST_SAMPLES = {"single": 77, "dp": 77, "ddp": 77, "fsdp": 77, "ddp_multinode": 101, "ddp_srun": 101, "apptainer": 101}
# sbatch copies the submitting shell's environment into the job: the test's own shell must not
# decide the outcome (site settings, or launcher variables left over from experiments).
LEAKY = ("COURSE_DIR", "MODULES", "CONDA_ENV", "VENV", "WORKSHOP_DATA_DIR", "OUTPUT_ROOT", "NPROC_PER_NODE",
         "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "FAIL_AT_STEP",
         "STAGE_DATA", "NODE_LOCAL_DIR", "APPTAINER_IMAGE", "NCCL_PLUGIN_DIR", "SWEEP_TABLE",
         "TRAINER_LAUNCHER")
TRAINING = ("single", "dp", "ddp", "ddp_multinode", "ddp_srun", "fsdp", "apptainer")  # they checkpoint and resume
PREEMPTIBLE = ()  # the lessons' scripts save after each epoch, on no signal: the trainer's slurm_train.sh stops on one
RANK_LINE = re.compile(r"^rank (\d+) of (\d+) on (\S+), ", re.M)  # the teaching scripts', one per rank
# torchrun's agent on each node logs its host (socket.getfqdn()) and node rank from the c10d rendezvous when TORCH_LOGS
# names the module (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py); node rank k runs global ranks
# k*nproc .. k*nproc+nproc-1 (torch/distributed/elastic/agent/server/api.py, _assign_worker_ranks).
RENDEZVOUS_LOG = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
NODE_LINE = re.compile(r"The node '(\S+?)_\d+_\d+' has joined round \d+ of the rendezvous '\S+' as rank (\d+) "
                       r"in a world of size (\d+)\.")
EPOCH_LINE = re.compile(r"^epoch (\d+): test loss [\d.]+, accuracy \d+/(\d+), train [\d.]+ s$", re.M)


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


def shared_part(script_text):
    """From `set -euo pipefail` (the first command) to the line that sources slurm/job_env.sh."""
    start = script_text.index("set -euo pipefail")
    end = script_text.index('/slurm/job_env.sh"', start)
    return script_text[start:script_text.index("\n", end)]


def fake_job_env(tmp_path, command=None, **slurm):
    """The environment of a batch job, without Slurm: SLURM_* variables and a stand-in scontrol (`show hostnames`,
    and `show job` naming the submitted script, `command`, as Command=)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "n3\\nn4\\n"\n'
                                      f'[ "$1 $2 $3" = "show job -o" ] && echo "JobId=$4 Command={command or ""} WorkDir=/x"\n'
                                      'exit 0\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LEAKY}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="12345", SLURM_JOB_NAME="ddp",
               SLURM_JOB_NODELIST="n[3-4]", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(ROOT),
               RANK="7", WORLD_SIZE="9")  # left over from a shell: the scripts unset them
    env.update(slurm)
    return env


def probe_job_env(tmp_path, env, script="ddp"):
    """A script's own lines up to the CPU split, then what slurm/job_env.sh left; with a stand-in scontrol."""
    body = text(script)
    probe = body[:body.index("split_cpus_for_torchrun  #")] + (
        "split_cpus_for_torchrun\n"
        'echo "COURSE=$COURSE_DIR ADDR=$MASTER_ADDR PORT=$MASTER_PORT OUT=$OUTPUT_DIR NPROC=$NPROC_PER_NODE" \\\n'
        '     "CPP=$CPUS_PER_PROC OMP=$OMP_NUM_THREADS NW=$NUM_WORKERS RANK=${RANK:-unset} PP=$PYTHONPATH"\n')
    return subprocess.run(["bash", "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)


@dataclass
class Job:
    name: str
    id: int
    workdir: Path  # --chdir: the job's logs/ is here
    out_dir: Path  # --output-dir of the training script
    deadline: float
    state: str | None = field(default=None)
    calls: Path | None = field(default=None)  # the apptainer stand-in's record of its calls


def sbatch(cluster, script, args, cpus, env=None, submit_from=ROOT, workdir=None, opts=()):
    """sbatch the script as a learner would (cwd = submit folder); only the options named in the docstring."""
    full_env = {k: v for k, v in cluster.env.items() if k not in LEAKY}
    full_env.update(env or {})
    cmd = ["sbatch", "--parsable", f"--chdir={workdir}", f"--cpus-per-task={cpus}", *opts, str(ROOT / script),
           *map(str, args)]
    done = subprocess.run(cmd, env=full_env, cwd=submit_from, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr}"
    return int(done.stdout.strip().split(";")[0])


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
    if job.name in TRAINING:  # --resume auto found nothing in the last --output-dir (the test's, fresh): no line
        assert "resumed from" not in log, log
        assert job.name == "apptainer" or not (job.workdir / "runs").exists(), log
    return log


def one_epoch_line(log, test_samples):
    """Rank 0's one epoch line; it counts `test_samples` test images: every one once, none twice."""
    assert [(int(e), int(n)) for e, n in EPOCH_LINE.findall(log)] == [(1, test_samples)], log


def rank_lines(log):
    """[(rank, host, world, local_rank)] of a two-node torchrun job run with TORCH_LOGS=RENDEZVOUS_LOG: every rank's
    line of the teaching script (on cpu), each placed on the host whose torchrun got its node rank in the rendezvous."""
    ranks = sorted((int(r), int(w)) for r, w, device in RANK_LINE.findall(log) if device == "cpu")
    assert len(ranks) == len(RANK_LINE.findall(log)) > 0, log
    world = ranks[0][1]
    nodes = dict((int(rank), host) for host, rank, _ in NODE_LINE.findall(log))
    assert sorted(nodes) == list(range(len(nodes))) and len(nodes) > 0 and world % len(nodes) == 0, log
    per_node = world // len(nodes)
    return [(r, nodes[r // per_node], w, r % per_node) for r, w in ranks]


TASK_LINE = re.compile(r"^== task (\d+) on (\S+): local rank (\d+), CUDA_VISIBLE_DEVICES=(\S+)$", re.M)


def task_lines(log):
    """{node: [(rank, local rank, CUDA_VISIBLE_DEVICES)]} from the srun-style scripts' show_tasks lines."""
    by_node = {}
    for rank, node, local_rank, cvd in TASK_LINE.findall(log):
        by_node.setdefault(node, []).append((int(rank), int(local_rank), cvd))
    return {node: sorted(rows) for node, rows in by_node.items()}


# ---- lessons 05 and 06: the multi-node FSDP2 scripts (HSDP; TP x FSDP2) ---------------------------------

def check_multinode_shape(script, template, job_name, ending):
    """`script` is `template` (the multi-node script of the lesson before) but its job name and its last line."""
    body, shape = (ROOT / script).read_text(), (ROOT / template).read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / script)]).returncode == 0
    d, t = directives(body), directives(shape)
    assert d["--job-name"] == job_name and {**d, "--job-name": None} == {**t, "--job-name": None}
    assert shared_part(body) == shared_part(text("ddp_multinode"))  # the same set-up (slurm/job_env.sh, site.sh)
    assert body.rstrip().endswith(ending)
    # The trainer's scripts start torchrun ignoring SIGUSR1 (their handler saves); the lessons' have no handler.
    assert re.search(r"""(bash -c 'trap "" USR1; exec "\$@"' _ \\\n)?    torchrun --nnodes="\$SLURM_NNODES" """, body)


def two_nodes_two_processes_each(cluster, script, name, synthetic_dir, tmp_path, *extra):
    """`script` submitted unchanged to both test nodes, 2 processes each, one epoch of 256 training images and 101
    test images: (job, log, rank rows) once it COMPLETED with ranks 0-3 (0-1 on n1, 2-3 on n2), one epoch line
    counting all 101 test images, and the epoch's DCP checkpoint with one shard per rank in the --output-dir given
    last (after the script's own)."""
    workdir = tmp_path / "job"
    (workdir / "logs").mkdir(parents=True)
    out_dir = workdir / "out"
    args = ["--data", "synthetic", "--data-dir", synthetic_dir, "--train-samples", 256, "--test-samples", 101,
            "--epochs", 1, "--device", "cpu", "--num-workers", 0, *extra, "--output-dir", out_dir]
    env = {"NPROC_PER_NODE": "2", "OUTPUT_ROOT": str(workdir / "runs"), "TORCH_LOGS": RENDEZVOUS_LOG}
    job = Job(name, sbatch(cluster, script, args, 2, env, ROOT, workdir), workdir, out_dir, time.monotonic() + 150)
    log = completed(cluster, job)
    assert f"rendezvous n1:{20000 + job.id % 20000}" in log and "resumed from" not in log, log  # --resume auto: fresh
    rows = rank_lines(log)
    assert rows == [(0, "n1", 4, 0), (1, "n1", 4, 1), (2, "n2", 4, 0), (3, "n2", 4, 1)], log
    one_epoch_line(log, 101)
    lesson = Path(script).parts[0][:2]
    assert sorted(p.name for p in (out_dir / "checkpoints").iterdir()) == [f"{lesson}-epoch-001", "run.json"]
    assert sorted(p.name for p in (out_dir / "checkpoints" / f"{lesson}-epoch-001").iterdir()) == \
        [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    return job, log, rows


TEACHING_RANK = re.compile(r"^rank (\d+) of (\d+) on (\S+), mesh \((\w+) (\d+), (\w+) (\d+)\) of \((\d+), (\d+)\)", re.M)


def two_nodes_teaching(cluster, script, name, lesson, synthetic_dir, tmp_path, *extra):
    """Lesson 06 or 07's job as two_nodes_two_processes_each runs it (batches of 16: 07's micro-batches divide them):
    (log, {rank: {mesh dimension: coordinate}}) from the ranks' mesh lines."""
    _, log, _ = two_nodes_two_processes_each(cluster, script, name, synthetic_dir, tmp_path, "--batch-size", 16, *extra)
    rows = {int(r): {a: int(i), b: int(j)} for r, w, _, a, i, b, j, _, _ in TEACHING_RANK.findall(log) if w == "4"}
    assert sorted(rows) == [0, 1, 2, 3], log
    return log, rows
