"""Lesson 08's template for any script (08_your_model/slurm_submit_any.sh), running digits_lm.py, submitted UNCHANGED
to the real two-node test cluster (--nodes=2, 2 processes per node; the test nodes' "GPUs" are /dev/null, so gloo on
CPU): one torchrun per node meeting at a c10d rendezvous, 4 ranks sharding the Hugging Face decoder with FSDP2 across
the two nodes' network namespaces, each rank writing its DCP shard and its part of the export. And the template's
warning before the time limit: the job gets SIGUSR1, saves, requeues itself, resumes with --resume auto and ends as a
run that was never interrupted.
"""
import json
import re
import time

import pytest

from slurm.jobs import ROOT, Job, completed, directives, sbatch
from test_slurm_preemption import INJECT, read_log, report, run_to_the_end, wait_for

SCRIPT = "08_your_model/slurm_submit_any.sh"
RANK = re.compile(r"^\[rank (\d)\] host (\S+) rank \d/(\d) device cpu backend gloo$", re.M)


def test_digits_lm_on_two_nodes_through_the_template_for_any_script(slurm_cluster, synthetic_dir, tmp_path):
    workdir = tmp_path / "job"
    (workdir / "logs").mkdir(parents=True)
    out_dir, export = workdir / "out", workdir / "out" / "hf"
    args = ["08_your_model/digits_lm.py", "--data", "synthetic", "--data-dir", synthetic_dir, "--train-samples", 256,
            "--test-samples", 51, "--epochs", 1, "--max-steps", 3, "--dtype", "float32", "--device", "cpu",
            "--output-dir", out_dir, "--export", export]
    job_id = sbatch(slurm_cluster, SCRIPT, args, 2, {"NPROC_PER_NODE": "2"}, workdir=workdir, opts=("--nodes=2",))
    job = Job("any", job_id, workdir, out_dir, time.monotonic() + 420)
    log = completed(slurm_cluster, job)
    assert "Warning" not in log, log
    assert "== tasks 2 (one torchrun per node) | processes per node 2 -> world size 4" in log, log
    ranks = sorted((int(r), host, int(w)) for r, host, w in RANK.findall(log))
    assert ranks == [(0, "n1", 4), (1, "n1", 4), (2, "n2", 4), (3, "n2", 4)], log
    assert "digits_lm: 4 processes, llama, 3 layers, 0.33 M parameters, each rank stores ~1/4" in log, log
    assert log.count("epoch 1 |") == 1 and "/9996) |" in log, log  # 51 test images x 196 pixels, each counted once
    m = json.loads((out_dir / "metrics.json").read_text())
    assert m["world_size"] == 4 and [r["test_samples"] for r in m["epochs"]] == [51 * 196], m
    assert len(list((out_dir / "checkpoints" / "ckpt-e0001-s0000000").glob("*.distcp"))) == 4
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    assert (export / "config.json").is_file() and len(set(index.values())) == 5, index  # embeddings, 3 layers, rest


def test_the_template_asks_for_the_warning_signal_and_torchrun_ignores_it():
    """No cluster needed: the lines that make the job below work (lesson 04's; test_slurm_lessons.py checks those)."""
    body = (ROOT / SCRIPT).read_text()
    d = directives(body)
    assert d["--signal"] == "USR1@120" and "--requeue" in d and d["--open-mode"] == "append", d
    assert re.search(r"""\n    bash -c 'trap "" USR1; exec "\$@"' _ \\\n    torchrun """, body), body


def test_the_warning_signal_saves_requeues_and_resumes_as_if_uninterrupted(slurm_cluster, synthetic_dir, tmp_path):
    """Two jobs at once, each on both nodes (1 CPU and 1 GPU of each: --gpus-per-node=1, NPROC_PER_NODE=2): the same
    training with --resume auto, one left alone, one stopped. Rank 0 of that one waits at step 3 (tests/inject); the
    test sends on that line what Slurm sends 120 s before the time limit, `scancel --signal=USR1`. The vote of step 10,
    read at step 20, stops every rank there; rank 0 requeues the job; the restart (same id and log; the test skips
    Slurm's ~2 min hold as test_slurm_preemption.py does) resumes at step 20 and finishes. digits_lm's resume is exact
    on the same ranks (test_interrupts_08.py): its numbers equal the other job's within float rounding."""
    data = ["--data", "synthetic", "--data-dir", synthetic_dir, "--train-samples", 448, "--test-samples", 51,
            "--batch-size", 4, "--max-steps", 22, "--epochs", 1, "--dtype", "float32", "--device", "cpu"]
    jobs = {}
    for name, env in (("plain", {}), ("stopped", {**INJECT, "FAIL_AT_STEP": "0:3:WAIT"})):
        workdir = tmp_path / name
        (workdir / "logs").mkdir(parents=True)
        args = ["08_your_model/digits_lm.py", *data, "--output-dir", workdir / "out", "--resume", "auto"]
        job_id = sbatch(slurm_cluster, SCRIPT, args, 1, {"NPROC_PER_NODE": "2", **env}, workdir=workdir,
                        opts=("--nodes=2", "--gpus-per-node=1", f"--job-name=lm-{name}"))
        jobs[name] = Job(name, job_id, workdir, workdir / "out", time.monotonic() + 420)
    job_id, out_dir = jobs["stopped"].id, jobs["stopped"].out_dir
    waiting = "inject: rank 0 waits at epoch 1 step 3"
    wait_for(slurm_cluster, job_id, lambda: waiting in read_log(slurm_cluster, job_id), "rank 0 at step 3")
    assert slurm_cluster.job_info(job_id)["JobState"] == "RUNNING", report(slurm_cluster, job_id, "not running")
    slurm_cluster.run("scancel", "--signal=USR1", str(job_id))  # to the processes of the job's steps, as --signal

    info, released = run_to_the_end(slurm_cluster, job_id)
    log = read_log(slurm_cluster, job_id)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, report(slurm_cluster, job_id, "one requeue")
    story = [f"resume: starting fresh (no checkpoint in {out_dir}", waiting,
             f"stopped by SIGUSR1 at epoch 1 step 20, checkpoint saved: requeued Slurm job {job_id}",
             f"resume: from {out_dir}/checkpoints/ckpt-e0000-s0000020, continuing at epoch 1 step 20", "epoch 1 |"]
    at = 0
    for piece in story:  # in this order, in the one appended log
        found = log.find(piece, at)
        assert found >= 0, report(slurm_cluster, job_id, f"log: {piece!r} missing after position {at}")
        at = found + len(piece)
    assert log.count("stopped by") == log.count("resume: from") == log.count("epoch 1 |") == 1, log
    ranks = sorted((int(r), host, int(w)) for r, host, w in RANK.findall(log))  # both runs: 4 ranks on 2 nodes
    assert ranks == sorted(2 * [(0, "n1", 4), (1, "n1", 4), (2, "n2", 4), (3, "n2", 4)]), log
    assert len(list((out_dir / "checkpoints" / "ckpt-e0000-s0000020").glob("*.distcp"))) == 4  # every rank's shard

    completed(slurm_cluster, jobs["plain"])
    [got], [want] = (json.loads((jobs[n].out_dir / "metrics.json").read_text())["epochs"] for n in ("stopped", "plain"))
    assert got["test_samples"] == want["test_samples"] == 51 * 196  # every test pixel counted once
    for key in ("train_loss", "test_loss", "test_accuracy"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (key, got, want)
    print(f"\nSIGUSR1 -> requeued -> COMPLETED (requeue hold skipped {released}x); {got}")
