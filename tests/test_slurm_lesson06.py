"""Lesson 06's 2-D submit script (TP inside a node, FSDP2 across nodes), submitted UNCHANGED to the real two-node
test cluster: only sbatch --chdir, --cpus-per-task, NPROC_PER_NODE=2 and trailing arguments vary; the test nodes'
"GPUs" are /dev/null, so gloo on CPU. The mesh is (nodes, processes per node) = dp 2 x tp 2: a node's two ranks
(consecutive under torchrun) form one TP group.
"""
import subprocess

from slurm.jobs import ROOT, directives, two_nodes_teaching

SCRIPT = "06_tensor_parallel/slurm_submit_tp.sh"


def test_tp_script_requeues_and_resumes_without_a_signal():
    body = (ROOT / SCRIPT).read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / SCRIPT)]).returncode == 0
    d = directives(body)
    assert d["--job-name"] == "tp-2d" and "--requeue" in d and "--signal" not in d, d  # no handler: no signal
    assert body.rstrip().endswith('mnist_tpmodel.py" --tp "$NPROC_PER_NODE" --num-workers "$NUM_WORKERS" '
                                  '--output-dir "$OUTPUT_DIR" --resume auto "$@"')


def test_tp_inside_each_node_fsdp2_across_two_nodes(slurm_cluster, synthetic_dir, tmp_path):
    log, mesh = two_nodes_teaching(slurm_cluster, SCRIPT, "tp_2d", "06", synthetic_dir, tmp_path, "--blocks", 2)
    assert "== mesh: dp 2 (FSDP2 across the nodes) x tp 2 (TP inside each node)" in log, log
    assert mesh == {0: {"dp": 0, "tp": 0}, 1: {"dp": 0, "tp": 1}, 2: {"dp": 1, "tp": 0}, 3: {"dp": 1, "tp": 1}}, log
