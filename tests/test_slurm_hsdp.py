"""Lesson 05's multi-node submit script, submitted UNCHANGED to the real two-node test cluster.

As in test_slurm_lessons.py: only what a learner varies without editing the script changes (sbatch --chdir,
--cpus-per-task, NPROC_PER_NODE=2, trailing arguments); the test nodes' "GPUs" are /dev/null, so gloo on CPU.
The lesson's 1-D mesh spans both nodes: 4 ranks, 4 shard files. (HSDP's 2-D mesh is the trainer's --hsdp; the file
keeps its name for the Makefile's and docs/tests.md's lists.)
"""
import re
import time

from slurm.jobs import Job, check_multinode_shape, completed, sbatch
from lessons import ROOT

SCRIPT = "05_multigpu_fsdp_training/slurm_submit_fsdp_multinode.sh"
RANK = re.compile(r"^rank (\d) of (\d) on cpu, 128 of 512 training images$", re.M)


def test_multinode_script_has_the_multinode_shape():
    check_multinode_shape(SCRIPT, "04_ddp_training/slurm_submit_ddp_multinode.sh", "fsdp-multinode",
                          'mnist_fsdpmodel.py" --num-workers "$NUM_WORKERS" --output-dir "$OUTPUT_DIR" '
                          '--resume auto "$@"')


def test_fsdp_two_nodes_two_processes_each(slurm_cluster, synthetic_dir, tmp_path):
    workdir = tmp_path / "job"
    (workdir / "logs").mkdir(parents=True)
    out_dir = workdir / "out"
    args = ["--data", "synthetic", "--data-dir", synthetic_dir, "--train-samples", 512, "--test-samples", 101,
            "--epochs", 1, "--device", "cpu", "--num-workers", 0, "--output-dir", out_dir]
    env = {"NPROC_PER_NODE": "2", "OUTPUT_ROOT": str(workdir / "runs")}
    job = Job("fsdp_multinode", sbatch(slurm_cluster, SCRIPT, args, 2, env, ROOT, workdir), workdir, out_dir,
              time.monotonic() + 150)
    log = completed(slurm_cluster, job)
    assert f"rendezvous n1:{20000 + job.id % 20000}" in log, log
    assert sorted(RANK.findall(log)) == [(str(r), "4") for r in range(4)], log  # one mesh of 4 over both nodes
    assert len(re.findall(r"^epoch 1: test loss \S+, accuracy \d+/101, train ", log, re.M)) == 1, log  # rank 0
    assert sorted(p.name for p in (out_dir / "checkpoints" / "05-epoch-001").iterdir()) == \
        [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
