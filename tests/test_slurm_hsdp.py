"""Lesson 05's multi-node HSDP submit script, submitted UNCHANGED to the real two-node test cluster.

As in test_slurm_lessons.py: only what a learner varies without editing the script changes (sbatch --chdir,
--cpus-per-task, NPROC_PER_NODE=2, trailing arguments); the test nodes' "GPUs" are /dev/null, so gloo on CPU.
The HSDP mesh is (nodes, processes per node) = (2, 2).
"""
import json

from slurm.jobs import check_multinode_shape, two_nodes_two_processes_each

SCRIPT = "05_multigpu_fsdp_training/slurm_submit_fsdp_multinode.sh"


def test_hsdp_script_has_the_multinode_shape():
    check_multinode_shape(SCRIPT, "04_ddp_training/slurm_submit_ddp_multinode.sh", "fsdp-multinode",
                          'mnist_fsdpmodel.py" --hsdp --num-workers "$NUM_WORKERS" --output-dir "$OUTPUT_DIR" '
                          '--resume auto "$@"')


def test_hsdp_two_nodes_two_processes_each(slurm_cluster, synthetic_dir, tmp_path):
    job, log, rows = two_nodes_two_processes_each(slurm_cluster, SCRIPT, "fsdp_multinode", synthetic_dir, tmp_path)
    assert f"rendezvous n1:{20000 + job.id % 20000}" in log, log
    assert {host for _, host, _, _ in rows} == {"n1", "n2"}, log
    assert "lesson 05: 4 processes, mesh (2, 2)," in log, log  # (nodes, processes per node): HSDP
    assert json.loads((job.out_dir / "metrics.json").read_text())["args"]["hsdp"] is True
