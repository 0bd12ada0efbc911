"""Lesson 07's 2-D submit script (a pipeline stage per node, FSDP2 inside a node), submitted UNCHANGED to the real
two-node test cluster, as test_slurm_lesson06.py does for lesson 06: only sbatch --chdir, --cpus-per-task,
NPROC_PER_NODE=2 and trailing arguments vary; the test nodes' "GPUs" are /dev/null, so gloo on CPU. The mesh is
(nodes, processes per node) = pp 2 x dp 2: node n1's two ranks hold stage 0, n2's stage 1, so every pipeline's
activations and their gradients cross between the two nodes' network namespaces.
"""
import json
import re

import pytest
import torch

from slurm.jobs import check_multinode_shape, two_nodes_two_processes_each

SCRIPT = "07_pipeline_parallel/slurm_submit_pp.sh"
FLOOR = "lesson 07 needs torch >= 2.10: torch 2.9's pipeline stages fail over gloo (pytorch/pytorch#165539)"
pytestmark = pytest.mark.skipif(torch.__version__ < "2.10", reason=FLOOR)


def test_pp_script_has_the_multinode_shape():
    check_multinode_shape(SCRIPT, "05_multigpu_fsdp_training/slurm_submit_fsdp_multinode.sh", "pp-2d",
                          'mnist_ppmodel.py" --dp "$NPROC_PER_NODE" --num-workers "$NUM_WORKERS" '
                          '--output-dir "$OUTPUT_DIR" --resume auto "$@"')


def test_a_stage_per_node_fsdp2_inside_each(slurm_cluster, synthetic_dir, tmp_path):
    job, log, rows = two_nodes_two_processes_each(slurm_cluster, SCRIPT, "pp_2d", synthetic_dir, tmp_path,
                                                  "--pp-schedule", "1f1b", "--microbatches", 4)
    assert "Warning" not in log, log
    assert "== mesh: pp 2 (a pipeline stage per node) x dp 2 (FSDP2 inside each node)" in log, log
    hosts = {rank: host for rank, host, _, _ in rows}
    assert [hosts[r] for r in range(4)] == ["n1", "n1", "n2", "n2"], log  # ranks 0-1 on node 1
    assert "lesson 07: 4 processes, mesh pp 2 x dp 2, 1f1b: 2 stages of " in log, log
    stages = {int(r): (int(pp), int(s)) for r, pp, s in re.findall(r"^\[rank (\d)\] pp-rank (\d) holds stage (\d):",
                                                                   log, re.M)}
    assert stages == {0: (0, 0), 1: (0, 0), 2: (1, 1), 3: (1, 1)}, log  # stage 0 on n1, stage 1 on n2
    m = json.loads((job.out_dir / "metrics.json").read_text())
    assert (m["args"]["dp"], m["args"]["pp_schedule"], m["args"]["microbatches"]) == (2, "1f1b", 4), m["args"]
    assert m["epochs"][0]["test_loss"] > 0, m["epochs"]  # the last stages' loss, summed over the pipelines
