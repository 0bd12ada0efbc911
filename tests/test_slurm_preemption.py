"""Preemption and requeue on the real two-node test cluster: trainer/slurm_train.sh runs trainer/train.py --parallel
ddp UNCHANGED, in its two shapes (srun starts every process; one torchrun per node).

A job trains 3 epochs. At step 5 of epoch 1, rank 0 reports it in the log and waits (the test's fault
injection, PYTHONPATH=tests/inject FAIL_AT_STEP=0:5:WAIT); on that line the test sends what Slurm sends
before a time limit, `scancel --signal=USR1 <job>`: no guessed sleep decides where the signal lands. Every rank must stop at the same step, rank 0 saves a
checkpoint and runs `scontrol requeue`; Slurm restarts the job (same id, so the same output folder
runs/<job name>-<id>), which resumes with `--resume auto` and completes. metrics.json must list
epochs 1, 2, 3 exactly once, and the appended log must tell the story in order.

One shortcut, for time only: Slurm keeps a requeued job pending (Reason=BeginTime) for about 2
minutes (the lifetime of its launch credentials) before it may start again. The test moves its
start time to now with `scontrol update`; everything else is what happens on a real cluster.

Also: a rank that fails makes the whole srun-style job fail long before the process-group timeout
(no hang), and the log names the rank (FAIL_AT_STEP=RANK:STEP, tests/inject/sitecustomize.py); and a
job you cancel stays cancelled.

Under load every phase takes longer, so no test waits a fixed time for Slurm: each polls for the state
it needs (a line in the log, a final job state) until a generous deadline, and asserts on what it found.
"""
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from slurm.jobs import LEAKY, ROOT

EPOCHS = 3
TRAIN_SAMPLES = 4000
TEST_SAMPLES = 200
INJECT = {"PYTHONPATH": str(ROOT / "tests" / "inject")}  # loads tests/inject/sitecustomize.py in every process
WAIT_AT = {**INJECT, "FAIL_AT_STEP": "0:5:WAIT"}  # rank 0 says where it is, then waits for the signal
SCRIPT = ROOT / "trainer" / "slurm_train.sh"
SHAPES = {  # name -> (cpus per task, environment, signal): the test nodes have 2 CPUs each
    # two nodes, srun + torchrun (c10d), world size 4
    "torchrun": (2, {"TRAINER_LAUNCHER": "torchrun", "NPROC_PER_NODE": "2"}, "USR1"),
    "srun": (1, {}, "USR1"),  # two nodes, srun starts the 4 processes
}
PHASE_TIMEOUT_S = 150  # deadline for each of: reaching epoch 1; from the signal to the end (a few seconds when idle)
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")  # not COMPLETING: processes left


def submit(cluster, workdir, cpus, env, args):
    """sbatch trainer/slurm_train.sh --parallel ddp ARGS as a learner would, from the course folder; outputs under
    workdir (OUTPUT_ROOT). The torchrun shape runs one task per node."""
    full_env = {k: v for k, v in cluster.env.items() if k not in LEAKY}
    full_env.update(env, OUTPUT_ROOT=str(workdir / "runs"))
    per_node = ["--ntasks-per-node=1"] if env.get("TRAINER_LAUNCHER") == "torchrun" else []
    cmd = ["sbatch", "--parsable", f"--chdir={workdir}", f"--cpus-per-task={cpus}", *per_node, str(SCRIPT),
           "--parallel", "ddp", *map(str, args)]
    done = subprocess.run(cmd, env=full_env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr}"
    return int(done.stdout.strip().split(";")[0])


def read_log(cluster, job_id):
    path = Path(cluster.job_info(job_id)["StdOut"])
    return path.read_text(errors="replace") if path.exists() else ""


def report(cluster, job_id, what):
    info = cluster.job_info(job_id)
    return (f"{what}\njob {job_id}: {info.get('JobState')} Reason={info.get('Reason')} Restarts={info.get('Restarts')} "
            f"ExitCode={info.get('ExitCode')}\n----- {info.get('StdOut')} -----\n{read_log(cluster, job_id)}\n"
            f"{cluster.daemon_logs()}")


def wait_for(cluster, job_id, ready, what, timeout=PHASE_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", str(job_id)], env=cluster.env, capture_output=True)
            pytest.fail(report(cluster, job_id, f"timed out after {timeout} s waiting for {what}"))
        time.sleep(0.2)


def run_to_the_end(cluster, job_id):
    """Wait for the final state; release the requeued job from Slurm's ~2 min hold once it is pending.

    Not in the second of the requeue: released at once, a job was relaunched 0.7 s after its requeue and slurmd
    refused it ("Job 17 already killed, do not launch batch job"): it FAILED (Slurm 22.05.8, seen once in CI).
    Slurm's own hold prevents that; the test shortens it to two wall-clock seconds after the requeue."""
    released, held_since = 0, None
    def final():
        nonlocal released, held_since
        info = cluster.job_info(job_id)
        if info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime":
            held_since = held_since or time.time()
            if int(time.time()) >= int(held_since) + 2:
                cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
                released += 1
        return info["JobState"] in FINAL
    wait_for(cluster, job_id, final, "the job to end")
    return cluster.job_info(job_id), released


@pytest.mark.parametrize("name", list(SHAPES))
def test_signal_checkpoints_requeues_and_resumes(slurm_cluster, synthetic_dir, tmp_path, name):
    cpus, env, sig = SHAPES[name]
    (tmp_path / "logs").mkdir()
    t0 = time.monotonic()
    job_id = submit(slurm_cluster, tmp_path, cpus, {**env, **WAIT_AT}, [
        "--device", "cpu", "--data", "synthetic", "--data-dir", synthetic_dir, "--epochs", EPOCHS,
        "--train-samples", TRAIN_SAMPLES, "--test-samples", TEST_SAMPLES, "--num-workers", 0])
    waiting = "inject: rank 0 waits at epoch 1 step 5"
    wait_for(slurm_cluster, job_id, lambda: waiting in read_log(slurm_cluster, job_id), "rank 0 at step 5")
    t_signal = time.monotonic()
    assert slurm_cluster.job_info(job_id)["JobState"] == "RUNNING", report(slurm_cluster, job_id, "not running")
    slurm_cluster.run("scancel", f"--signal={sig}", str(job_id))  # to the processes of the job's steps

    info, released = run_to_the_end(slurm_cluster, job_id)
    t_end = time.monotonic()
    log = read_log(slurm_cluster, job_id)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, \
        report(slurm_cluster, job_id, "expected COMPLETED after exactly one requeue")

    # The appended log, in order: fresh start, epoch 1, the stop, the restarted job's header, the resume.
    job_name = info["JobName"]
    out_dir = tmp_path / "runs" / f"{job_name}-{job_id}"
    story = [f"== job {job_id} ({job_name})", f"resume: starting fresh (no checkpoint in {out_dir}", waiting,
             f"stopped by SIG{sig} at epoch 1 step 16, checkpoint saved: requeued Slurm job {job_id}",
             f"== job {job_id} ({job_name}) on", "| restart 1",
             f"resume: from {out_dir}/checkpoints/ckpt-e0000-s0000016", "continuing at epoch 1 step 16", "epoch 1 |"]
    at = 0
    for piece in story:
        found = log.find(piece, at)
        assert found >= 0, report(slurm_cluster, job_id, f"log: {piece!r} missing after position {at}")
        at = found + len(piece)
    preempted = re.findall(r"^stopped by.*$", log, re.M)
    assert len(preempted) == 1 and sig in preempted[0], report(slurm_cluster, job_id, f"one stopped by line, {sig}")
    assert log.count(waiting) == 1, report(slurm_cluster, job_id, "the injection fired once (not after the requeue)")
    assert log.count("resume: from") == 1, report(slurm_cluster, job_id, "resumed more than once")
    assert re.findall(r"^epoch (\d+) \|", log, re.M) == ["1", "2", "3"], report(slurm_cluster, job_id, "epochs")

    # metrics.json of the job's own folder: every epoch exactly once, every test image counted.
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [1, 2, 3], metrics["epochs"]
    assert all(e["test_samples"] == TEST_SAMPLES for e in metrics["epochs"])
    assert metrics["world_size"] == 4 and metrics["args"]["resume"] == "auto"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [f"{job_name}-{job_id}"]
    assert not (ROOT / "runs" / f"{job_name}-{job_id}").exists()  # OUTPUT_ROOT moved it out of the course
    resumed = re.search(r"^resume: from .*$", log, re.M)[0]
    print(f"\n{name}: SIG{sig} {t_signal - t0:.1f} s after submission; -> COMPLETED in {t_end - t_signal:.1f} s "
          f"(requeue hold skipped {released}x)\n  {preempted[0]}\n  {resumed}")


def test_a_failing_rank_fails_the_srun_job_quickly(slurm_cluster, synthetic_dir, tmp_path):
    """No hang: rank 1 raises at step 3; srun --kill-on-bad-exit=1 stops the other ranks; the job FAILs.
    Without that the others would wait in their next all_reduce for the 600 s process-group timeout
    (DIST_TIMEOUT_SECONDS, set here so that a value in the caller's shell cannot shorten it); the
    deadline of run_to_the_end (PHASE_TIMEOUT_S) is far below it."""
    (tmp_path / "logs").mkdir()
    t0 = time.monotonic()
    job_id = submit(slurm_cluster, tmp_path, 1, {**INJECT, "FAIL_AT_STEP": "1:3", "DIST_TIMEOUT_SECONDS": "600"}, [
        "--device", "cpu", "--data", "synthetic", "--data-dir", synthetic_dir, "--epochs", 1,
        "--train-samples", 4096, "--test-samples", TEST_SAMPLES, "--num-workers", 0])
    info, _ = run_to_the_end(slurm_cluster, job_id)
    elapsed = time.monotonic() - t0
    log = read_log(slurm_cluster, job_id)
    assert info["JobState"] == "FAILED" and int(info["Restarts"]) == 0, report(slurm_cluster, job_id, "expected FAILED")
    # Slurm names the task (= rank in the srun style) that exited first; the Python error names the rank.
    assert "task 1: Exited with exit code" in log and re.search(r"(?im)^.*\brank ?1\b.*(fail|error)", log), \
        report(slurm_cluster, job_id, "the log must name rank 1")
    assert "epoch 1 |" not in log
    print(f"FAIL_AT_STEP=1:3: FAILED {elapsed:.1f} s after submission")


def test_a_cancelled_job_stays_cancelled(slurm_cluster, synthetic_dir, tmp_path):
    """`scancel <job>`: SIGTERM, then SIGKILL after KillWait. The job must end CANCELLED, not requeue itself.

    The job trains many short epochs, so it is surely still running when the test cancels it. The test then
    polls until Slurm reports a final state: COMPLETING means processes of the job are still alive (one could
    still run `scontrol requeue`); once CANCELLED is final, none is left. A requeue shows on the way as
    Restarts > 0 or PENDING/REQUEUED, and fails the test at once."""
    (tmp_path / "logs").mkdir()
    job_id = submit(slurm_cluster, tmp_path, 1, {}, [
        "--device", "cpu", "--data", "synthetic", "--data-dir", synthetic_dir, "--epochs", 50,
        "--train-samples", 1000, "--test-samples", TEST_SAMPLES, "--num-workers", 0])
    wait_for(slurm_cluster, job_id, lambda: "epoch 1 |" in read_log(slurm_cluster, job_id), "epoch 1")
    slurm_cluster.run("scancel", str(job_id))
    states = []
    def settled():
        info = slurm_cluster.job_info(job_id)
        state = f"{info['JobState']}/{info['Restarts']}"
        if not states or states[-1] != state:
            states.append(state)
        return info["JobState"] in FINAL or int(info["Restarts"]) > 0 or info["JobState"] in ("PENDING", "REQUEUED")
    wait_for(slurm_cluster, job_id, settled, "a final state after scancel")
    if states[-1] != "CANCELLED/0":  # it came back: nothing of ours may stay in the queue
        subprocess.run(["scancel", str(job_id)], env=slurm_cluster.env, capture_output=True)
    assert states[-1] == "CANCELLED/0", \
        report(slurm_cluster, job_id, f"a cancelled job must stay cancelled; states seen: {' -> '.join(states)}")
    log = read_log(slurm_cluster, job_id)
    assert "requeued Slurm job" not in log and "| restart 1" not in log, report(slurm_cluster, job_id, "requeued")
