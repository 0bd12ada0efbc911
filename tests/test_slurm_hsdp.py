"""Lesson 05's multi-node HSDP submit script, submitted UNCHANGED to the real two-node test cluster.

As in test_slurm_lessons.py: only what a learner varies without editing the script changes (sbatch --chdir,
--cpus-per-task, NPROC_PER_NODE=2, trailing arguments); the test nodes' "GPUs" are /dev/null, so gloo on CPU.
The HSDP mesh is (nodes, processes per node) = (2, 2).
"""
import json
import re
import subprocess
import time

from test_slurm_lessons import (ROOT, Job, check_metrics, completed, directives, rank_lines, sbatch, shared_part,
                                text)

SCRIPT = "05_multigpu_fsdp_training/slurm_submit_fsdp_multinode.sh"
TEMPLATE = "04_ddp_training/slurm_submit_ddp_multinode.sh"  # lesson 04's multi-node script: the same shape


def test_hsdp_script_has_the_multinode_shape():
    body, template = (ROOT / SCRIPT).read_text(), (ROOT / TEMPLATE).read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / SCRIPT)]).returncode == 0
    d, t = directives(body), directives(template)
    assert d["--job-name"] == "fsdp-multinode" and {**d, "--job-name": None} == {**t, "--job-name": None}
    assert shared_part(body) == shared_part(text("ddp_multinode"))  # the same set-up (slurm/job_env.sh, site.sh)
    assert body.rstrip().endswith('mnist_fsdpmodel.py" --hsdp --num-workers "$NUM_WORKERS" '
                                  '--output-dir "$OUTPUT_DIR" --resume auto "$@"')
    assert re.search(r"""bash -c 'trap "" USR1; exec "\$@"' _ \\\n    torchrun --nnodes="\$SLURM_NNODES" """, body)


def test_hsdp_two_nodes_two_processes_each(slurm_cluster, synthetic_dir, tmp_path):
    workdir = tmp_path / "job"
    (workdir / "logs").mkdir(parents=True)
    out_dir = workdir / "out"
    args = ["--data", "synthetic", "--data-dir", synthetic_dir, "--train-samples", 512, "--test-samples", 101,
            "--epochs", 1, "--max-steps", 3, "--device", "cpu", "--num-workers", 0, "--output-dir", out_dir]
    env = {"NPROC_PER_NODE": "2", "OUTPUT_ROOT": str(workdir / "runs")}
    job_id = sbatch(slurm_cluster, SCRIPT, args, 2, env, ROOT, workdir)
    job = Job("fsdp_multinode", job_id, workdir, out_dir, time.monotonic() + 150)
    log = completed(slurm_cluster, job)
    assert f"resume: starting fresh (no checkpoint in {out_dir}" in log, log
    assert f"rendezvous n1:{20000 + job_id % 20000}" in log, log
    rows = rank_lines(log)
    assert [r for r, *_ in rows] == [0, 1, 2, 3] and {w for _, _, w, _ in rows} == {4}, log
    assert {host for _, host, _, _ in rows} == {"n1", "n2"}, log
    assert "lesson 05: 4 processes, mesh (2, 2)," in log, log  # (nodes, processes per node): HSDP
    assert log.count("epoch 1 |") == 1, log
    check_metrics(job, 4, 101)  # test_samples exactly 101: every test image counted once
    assert json.loads((out_dir / "metrics.json").read_text())["args"]["hsdp"] is True
    assert len(list((out_dir / "checkpoints" / "ckpt-e0001-s0000000").glob("*.distcp"))) == 4
    assert (out_dir / "model_full.pt").stat().st_size > 0
