"""Lesson 06's 2-D submit script (TP inside a node, FSDP2 across nodes), submitted UNCHANGED to the real two-node
test cluster, as test_slurm_hsdp.py does for lesson 05: only sbatch --chdir, --cpus-per-task, NPROC_PER_NODE=2
and trailing arguments vary; the test nodes' "GPUs" are /dev/null, so gloo on CPU. The mesh is (nodes, processes
per node) = dp 2 x tp 2, and each node's two ranks form one TP group.
"""
import json

from slurm.jobs import check_multinode_shape, two_nodes_two_processes_each

SCRIPT = "06_tensor_parallel/slurm_submit_tp.sh"


def test_tp_script_has_the_multinode_shape():
    check_multinode_shape(SCRIPT, "05_multigpu_fsdp_training/slurm_submit_fsdp_multinode.sh", "tp-2d",
                          'mnist_tpmodel.py" --tp "$NPROC_PER_NODE" --num-workers "$NUM_WORKERS" '
                          '--output-dir "$OUTPUT_DIR" --resume auto "$@"')


def test_tp_inside_each_node_fsdp2_across_two_nodes(slurm_cluster, synthetic_dir, tmp_path):
    job, log, rows = two_nodes_two_processes_each(slurm_cluster, SCRIPT, "tp_2d", synthetic_dir, tmp_path,
                                                  "--blocks", 2)
    assert "== mesh: dp 2 (FSDP2 across the nodes) x tp 2 (TP inside each node)" in log, log
    assert [host for _, host, _, _ in rows] == ["n1", "n1", "n2", "n2"], log  # ranks 0-1: node 1's TP group
    assert "lesson 06: 4 processes, mesh dp 2 x tp 2," in log, log
    assert json.loads((job.out_dir / "metrics.json").read_text())["args"]["tp"] == 2  # test images: once per TP group
