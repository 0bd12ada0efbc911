"""Lesson 05's multi-node submit script, submitted UNCHANGED to the real two-node test cluster.

As in test_slurm_lessons.py: only what a learner varies without editing the script changes (sbatch --chdir,
--cpus-per-task, NPROC_PER_NODE=2, trailing arguments); the test nodes' "GPUs" are /dev/null, so gloo on CPU.
The lesson's 1-D mesh spans both nodes: 4 ranks, 4 shard files. (HSDP's 2-D mesh is the trainer's --hsdp; the file
keeps its name for the Makefile's and docs/tests.md's lists.)
"""
import re

from slurm.jobs import check_multinode_shape, two_nodes_two_processes_each

SCRIPT = "05_multigpu_fsdp_training/slurm_submit_fsdp_multinode.sh"


def test_multinode_script_has_the_multinode_shape():
    check_multinode_shape(SCRIPT, "04_ddp_training/slurm_submit_ddp_multinode.sh", "fsdp-multinode",
                          'mnist_fsdpmodel.py" --num-workers "$NUM_WORKERS" --output-dir "$OUTPUT_DIR" '
                          '--resume auto "$@"')


def test_fsdp_two_nodes_two_processes_each(slurm_cluster, synthetic_dir, tmp_path):
    job, log, rows = two_nodes_two_processes_each(slurm_cluster, SCRIPT, "fsdp_multinode", synthetic_dir, tmp_path)
    # one mesh of 4 over both nodes: each rank trains on its quarter of the 256 training images
    assert sorted(re.findall(r"^rank (\d) of 4 on cpu, 64 of 256 training images$", log, re.M)) == list("0123"), log
