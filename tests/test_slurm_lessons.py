"""Every lesson's Slurm submit script, submitted UNCHANGED to the real two-node test cluster.

The test varies only what a learner varies without editing a script:
  sbatch options   --chdir=<tmp>: the job works there, so logs/%x-%j.out lands in a temporary
                   folder (with logs/ made first), not in the repository; the submit folder stays
                   the course, which is how the scripts find it ($SLURM_SUBMIT_DIR, one line each).
                   --cpus-per-task=1 or 2: each test node has 2 CPUs; the scripts ask for GPU-node
                   sized counts (4-8), which the test cluster could never schedule.
  environment      NPROC_PER_NODE=2 for some torchrun jobs; the others derive 2 processes from the
                   GPU GRES the test nodes declare (the "GPUs" are /dev/null: no CUDA, so gloo).
                   TORCH_LOGS=RENDEZVOUS_LOG for the two-node torchrun jobs: torchrun logs each node's host and rank.
  trailing args    --device cpu --data synthetic, one epoch of 512 images, an output folder per job (it comes after
                   the scripts' own --output-dir and wins; OUTPUT_ROOT also points that one to tmp).
  GPU binding      the srun-style DDP job gets --gpus-per-task=1, as many sites require: each task then sees
                   one GPU of its node (CUDA_VISIBLE_DEVICES), whatever its local rank.
  container        the Apptainer variant runs with a stand-in `apptainer` first on PATH (tests/fakebin: it
                   records its arguments and runs the command without a container), with STAGE_DATA=1: each
                   node copies the data to its own node-local folder (cluster.node_local), and the results
                   must equal those of the same run without staging or container (ddp_multinode).
All jobs are submitted at once, then each test waits for its own; the cluster runs them as its
2 nodes x (2 CPUs, 2 GPUs) allow. A failed job shows its log and the Slurm daemon logs.
The scripts' text, and slurm/job_env.sh run outside a job, need no cluster: test_slurm_scripts.py.
"""
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from slurm.jobs import (ROOT, SCRIPTS, FAKEBIN, DEADLINE_S, TEST_SAMPLES, RENDEZVOUS_LOG, Job, sbatch, log_path, wait,
                        completed, one_epoch_line, rank_lines, task_lines)


@pytest.fixture(scope="module")
def jobs(slurm_cluster, synthetic_dir, tmp_path_factory):
    """Submit every script at once (after one without a logs/ folder and one from a lesson folder); yield {name: Job}."""
    container = tmp_path_factory.mktemp("container")  # the stand-in's call log, an "image", a "plugin" folder
    (container / "pytorch.sif").write_bytes(b"not an image: tests/fakebin/apptainer only checks that it exists")
    (container / "nccl-plugin").mkdir()
    apptainer_env = {  # fakebin first on PATH; the run stages its data on each node's own folder
        "PATH": f"{FAKEBIN}:{slurm_cluster.env['PATH']}", "FAKE_APPTAINER_LOG": str(container / "calls.log"),
        "APPTAINER_IMAGE": str(container / "pytorch.sif"), "NCCL_PLUGIN_DIR": str(container / "nccl-plugin"),
        "NPROC_PER_NODE": "2", "TORCH_LOGS": RENDEZVOUS_LOG, "STAGE_DATA": "1",
        "NODE_LOCAL_DIR": str(slurm_cluster.node_local / "lessons"),
        "WORKSHOP_DATA_DIR": synthetic_dir}
    plan = {  # name -> (cpus per task, environment, submit folder, other sbatch options)
        "setup": (1, {}, ROOT, ()),
        "single": (1, {}, ROOT, ()),
        "dp": (2, {}, ROOT, ()),
        "ddp": (2, {}, ROOT, ()),  # 2 processes from the 2 GPUs of the GRES, no NPROC_PER_NODE
        "fsdp": (2, {"NPROC_PER_NODE": "2"}, ROOT, ()),
        "ddp_multinode": (2, {"NPROC_PER_NODE": "2", "TORCH_LOGS": RENDEZVOUS_LOG}, ROOT, ()),
        "ddp_srun": (1, {"VENV": str(ROOT / ".venv")}, ROOT, ("--gpus-per-task=1",)),  # one GPU bound to each task
        "apptainer": (2, apptainer_env, ROOT, ()),  # = ddp_multinode, in a "container", with staged data
    }
    submitted, deadline = {}, time.monotonic() + DEADLINE_S
    # first the two jobs that fail at once (they need a CPU only for a moment), then the lessons
    no_logs = tmp_path_factory.mktemp("job-no-logs")  # no logs/ folder in it
    submitted["no_logs"] = Job("no_logs", sbatch(slurm_cluster, SCRIPTS["setup"][0], [], 1, workdir=no_logs),
                               no_logs, no_logs / "out", deadline)
    lesson_folder = tmp_path_factory.mktemp("job-lesson-folder")  # submitted from a lesson folder, not the course
    (lesson_folder / "logs").mkdir()
    submitted["lesson_folder"] = Job("lesson_folder", sbatch(slurm_cluster, SCRIPTS["single"][0], [], 1,
                                     submit_from=ROOT / "02_singlegpu_training", workdir=lesson_folder),
                                     lesson_folder, lesson_folder / "out", deadline)
    for name, (cpus, env, submit_from, opts) in plan.items():
        workdir = tmp_path_factory.mktemp(f"job-{name}")
        (workdir / "logs").mkdir()
        out_dir = workdir / "out"
        env = {**env, "OUTPUT_ROOT": str(workdir / "runs")}  # unused: the --output-dir below comes later
        # The test nodes' GPUs are /dev/null: torch sees none, and a job given GPUs stops unless told --device cpu.
        args = ["--device", "cpu"] if name == "setup" else [
            "--data", "synthetic", "--data-dir", synthetic_dir, "--train-samples", 512,
            "--test-samples", TEST_SAMPLES[name], "--epochs", 1, "--device", "cpu",
            "--num-workers", 0, "--output-dir", out_dir]
        if name == "apptainer":  # data from WORKSHOP_DATA_DIR (staged), results in OUTPUT_DIR (bound)
            args = [a for a in args if a not in ("--data-dir", synthetic_dir, "--output-dir", out_dir)]
        job_id = sbatch(slurm_cluster, SCRIPTS[name][0], args, cpus, env, submit_from, workdir, opts)
        if name == "apptainer":
            out_dir = workdir / "runs" / f"ddp-apptainer-{job_id}"
        submitted[name] = Job(name, job_id, workdir, out_dir, deadline)
    submitted["apptainer"].calls = container / "calls.log"
    yield submitted
    for job in submitted.values():  # nothing of ours left running for the next module
        if job.state is None:
            subprocess.run(["scancel", str(job.id)], env=slurm_cluster.env, capture_output=True)


def test_01_setup_checks_env_then_collectives(slurm_cluster, jobs):
    log = completed(slurm_cluster, jobs["setup"])
    assert log.count("verdict: READY") == 1, log  # check_env.py once per node (1 node)
    # the GPU check ran in a real job: Slurm's variables name GPUs that torch cannot use (--device cpu: a note)
    assert re.search(r"^note \(--device cpu\): Slurm gave this job GPUs \(\S+\) but torch sees none: ", log, re.M), log
    assert "OK: all_reduce, broadcast, all_gather and barrier verified on 2 rank(s)" in log, log
    assert sorted(re.findall(r"rank \d of 2", log)) == ["rank 0 of 2", "rank 1 of 2"], log
    assert f"rendezvous {slurm_cluster.job_info(jobs['setup'].id)['NodeList']}:{20000 + jobs['setup'].id % 20000}" in log
    node = slurm_cluster.job_info(jobs["setup"].id)["NodeList"]  # no GPU binding: each task sees the node's 2 GPUs
    assert task_lines(log) == {node: [(0, 0, "0,1"), (1, 1, "0,1")]}, log


def one_epoch_checkpointed(job, lesson: str, log: str):
    """The teaching script's epoch line, with the test images the trailing arguments asked for, and its checkpoint."""
    one_epoch_line(log, TEST_SAMPLES[job.name])
    assert sorted(p.name for p in (job.out_dir / "checkpoints").iterdir()) == [f"{lesson}-epoch-001.pt", "run.json"]


def test_02_single_process(slurm_cluster, jobs):
    log = completed(slurm_cluster, jobs["single"])
    one_epoch_checkpointed(jobs["single"], "02", log)


def test_03_dataparallel_one_task(slurm_cluster, jobs):
    log = completed(slurm_cluster, jobs["dp"])
    assert "nn.DataParallel over 0 GPU(s)" in log, log
    one_epoch_checkpointed(jobs["dp"], "03", log)


def check_04_run(job, log, world_size, test_samples):
    """Lesson 04's teaching script in a job: one `rank R of W` line per rank, each with its shard of the 512 training
    images; one epoch line (rank 0's), every test image counted once; rank 0's checkpoint of that epoch."""
    ranks = sorted(re.findall(rf"^rank (\d+) of {world_size} on cpu, {512 // world_size} of 512 training images$",
                              log, re.M))
    assert ranks == [str(r) for r in range(world_size)], log
    one_epoch_line(log, test_samples)
    assert (job.out_dir / "checkpoints" / "04-epoch-001.pt").stat().st_size > 0


def test_04_ddp_one_node_takes_processes_from_the_gpus(slurm_cluster, jobs):
    log = completed(slurm_cluster, jobs["ddp"])
    assert "GPUs 2 | processes 2" in log, log  # NPROC_PER_NODE not set: read from SLURM_GPUS_ON_NODE
    check_04_run(jobs["ddp"], log, 2, TEST_SAMPLES["ddp"])


@pytest.mark.parametrize("name", ["ddp_multinode", "ddp_srun"])
def test_04_ddp_two_nodes_two_processes_each(slurm_cluster, jobs, name):
    """World size 4 over n1 and n2 in both styles; the srun style with one GPU bound to each task."""
    job = jobs[name]
    log = completed(slurm_cluster, job)
    assert f"rendezvous n1:{20000 + job.id % 20000}" in log and " on 2 node(s): n[1-2]" in log, log
    check_04_run(job, log, 4, TEST_SAMPLES[name])
    if name == "ddp_multinode":  # one torchrun per node, two processes each: ranks 0-1 on n1, 2-3 on n2
        assert "tasks 2 (one torchrun per node) | GPUs per node 2 | processes per node 2 -> world size 4" in log, log
        assert [(r, host) for r, host, _, _ in rank_lines(log)] == [(0, "n1"), (1, "n1"), (2, "n2"), (3, "n2")], log
    if name == "ddp_srun":  # Slurm's block distribution: tasks 0, 1 on the first node, local ranks 0, 1 on each
        # --gpus-per-task=1: every task saw exactly one GPU, a different one from the other task of its node
        assert "GPUs per node 2 (per task 1) |" in log, log
        tasks = task_lines(log)
        assert sorted(tasks) == ["n1", "n2"] and [r for rows in tasks.values() for r, _, _ in rows] == [0, 1, 2, 3], log
        assert [r for r, _, _ in tasks["n1"]] == [0, 1], log
        for rows in tasks.values():
            assert [lr for _, lr, _ in rows] == [0, 1], log
            gpus = [cvd for _, _, cvd in rows]
            assert all(g.isdigit() for g in gpus) and len(set(gpus)) == len(gpus) == 2, log


def test_05_fsdp_one_node(slurm_cluster, jobs):
    log = completed(slurm_cluster, jobs["fsdp"])
    assert sorted(re.findall(r"^rank (\d) of (\d) on cpu, ", log, re.M)) == [("0", "2"), ("1", "2")], log
    one_epoch_line(log, TEST_SAMPLES["fsdp"])
    checkpoint = jobs["fsdp"].out_dir / "checkpoints" / "05-epoch-001"
    assert sorted(p.name for p in checkpoint.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_missing_logs_folder_fails_the_job_without_a_log(slurm_cluster, jobs):
    """What slurm/README.md tells learners: Slurm does not create logs/, the job just fails."""
    job = jobs["no_logs"]
    assert wait(slurm_cluster, job) == "FAILED"
    assert not (job.workdir / "logs").exists() and not log_path(slurm_cluster, job).exists()


def test_submitted_from_a_lesson_folder_fails_naming_the_missing_file(slurm_cluster, jobs):
    """The scripts find the course by $SLURM_SUBMIT_DIR: from a lesson folder the job fails at its first line."""
    job = jobs["lesson_folder"]
    assert wait(slurm_cluster, job) == "FAILED" and slurm_cluster.job_info(job.id)["ExitCode"] == "1:0"
    log = log_path(slurm_cluster, job).read_text()
    assert f"{ROOT}/02_singlegpu_training/slurm/job_env.sh: No such file or directory" in log, log
    assert "== job" not in log, log


def test_04_apptainer_variant_with_staged_data(slurm_cluster, jobs, synthetic_dir):
    """The Apptainer script with the stand-in: one `apptainer exec --nv` per node, with the binds; data staged once
    per node on node-local disk and read from there; results equal to ddp_multinode's (no container, no staging)."""
    job = jobs["apptainer"]
    log = completed(slurm_cluster, job)
    assert " on 2 node(s): n[1-2]" in log, log
    check_04_run(job, log, 4, TEST_SAMPLES["apptainer"])
    assert [(r, host) for r, host, _, _ in rank_lines(log)] == [(0, "n1"), (1, "n1"), (2, "n2"), (3, "n2")], log
    # staging: each node has its own complete copy, made once (one "copied" line in its log), bound for the run
    staged = Path(re.search(r"^== data: staged on each node's local disk, (\S+) \(from ", log, re.M)[1])
    assert staged.parent == slurm_cluster.node_local / "lessons", log
    assert not any(slurm_cluster.node_local.iterdir()), "the test's own namespace must not see the nodes' copies"
    original = Path(synthetic_dir)
    files = sorted(p.relative_to(original) for p in original.rglob("*") if p.is_file())
    assert files, synthetic_dir
    for node in ("n1", "n2"):
        copy = slurm_cluster.local_disk(node) / "lessons" / staged.name
        assert sorted(p.relative_to(copy) for p in copy.rglob("*") if p.is_file()) == files, node
        assert all((copy / f).read_bytes() == (original / f).read_bytes() for f in files), node
        events = (copy.parent / f"{staged.name}.log").read_text().splitlines()
        assert [e.split()[1:] for e in events] == [[node, "job", str(job.id), "copied"]], events
    # the container: one call per node, with --nv, the image, the binds, and torchrun inside
    calls = [shlex.split(line) for line in job.calls.read_text().splitlines()]
    assert sorted(c[0] for c in calls) == ["n1", "n2"], calls
    plugin = job.calls.parent / "nccl-plugin"
    for host, *argv in calls:
        image = argv.index(str(job.calls.parent / "pytorch.sif"))
        options = argv[1:image]
        binds = [options[i + 1] for i, o in enumerate(options) if o == "--bind"]
        assert argv[0] == "exec" and "--nv" in options, argv
        assert binds == [str(ROOT), str(staged), str(job.out_dir), f"{plugin}:{plugin}:ro"], binds
        assert argv[image + 1] == "torchrun", argv
    # the same numbers as the same run without container and staging
    plain = completed(slurm_cluster, jobs["ddp_multinode"])
    epoch = re.compile(r"^epoch 1: test loss \S+ accuracy \S+", re.M)
    assert epoch.findall(log) == epoch.findall(plain) and len(epoch.findall(log)) == 1, (log, plain)
