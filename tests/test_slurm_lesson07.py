"""Lesson 07's 2-D submit script (a pipeline stage per node, FSDP2 inside a node), submitted UNCHANGED to the real
two-node test cluster, as test_slurm_lesson06.py does for lesson 06: only sbatch --chdir, --cpus-per-task,
NPROC_PER_NODE=2 and trailing arguments vary; the test nodes' "GPUs" are /dev/null, so gloo on CPU. The mesh is
(nodes, processes per node) = pp 2 x dp 2: node n1's two ranks hold stage 0, n2's stage 1, so every pipeline's
activations and their gradients cross between the two nodes' network namespaces.
"""
import subprocess

import pytest
import torch

from slurm.jobs import ROOT, directives, two_nodes_teaching

SCRIPT = "07_pipeline_parallel/slurm_submit_pp.sh"
FLOOR = "lesson 07 needs torch >= 2.10: torch 2.9's pipeline stages fail over gloo (pytorch/pytorch#165539)"
pytestmark = pytest.mark.skipif(torch.__version__ < "2.10", reason=FLOOR)


def test_pp_script_requeues_and_resumes_without_a_signal():
    body = (ROOT / SCRIPT).read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / SCRIPT)]).returncode == 0
    d = directives(body)
    assert d["--job-name"] == "pp-2d" and "--requeue" in d and "--signal" not in d, d  # no handler: no signal
    assert body.rstrip().endswith('mnist_ppmodel.py" --dp "$NPROC_PER_NODE" --num-workers "$NUM_WORKERS" '
                                  '--output-dir "$OUTPUT_DIR" --resume auto "$@"')


def test_a_stage_per_node_fsdp2_inside_each(slurm_cluster, synthetic_dir, tmp_path):
    log, mesh = two_nodes_teaching(slurm_cluster, SCRIPT, "pp_2d", "07", synthetic_dir, tmp_path,
                                   "--pp-schedule", "1f1b", "--microbatches", 4)
    assert "Warning" not in log, log
    assert "== mesh: pp 2 (a pipeline stage per node) x dp 2 (FSDP2 inside each node)" in log, log
    assert mesh == {0: {"pp": 0, "dp": 0}, 1: {"pp": 0, "dp": 1}, 2: {"pp": 1, "dp": 0}, 3: {"pp": 1, "dp": 1}}, log
