"""Lesson 06's 2-D submit script (TP inside a node, FSDP2 across nodes), submitted UNCHANGED to the real two-node
test cluster, as test_slurm_hsdp.py does for lesson 05: only sbatch --chdir, --cpus-per-task, NPROC_PER_NODE=2
and trailing arguments vary; the test nodes' "GPUs" are /dev/null, so gloo on CPU. The mesh is (nodes, processes
per node) = dp 2 x tp 2, and each node's two ranks form one TP group.
"""
import json
import re
import subprocess
import time

from test_slurm_lessons import ROOT, Job, check_metrics, completed, directives, rank_lines, sbatch, shared_part, text

SCRIPT = "06_tensor_parallel/slurm_submit_tp.sh"
TEMPLATE = "05_multigpu_fsdp_training/slurm_submit_fsdp_multinode.sh"  # lesson 05's multi-node script: the same shape


def test_tp_script_has_the_multinode_shape():
    body, template = (ROOT / SCRIPT).read_text(), (ROOT / TEMPLATE).read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / SCRIPT)]).returncode == 0
    d, t = directives(body), directives(template)
    assert d["--job-name"] == "tp-2d" and {**d, "--job-name": None} == {**t, "--job-name": None}
    assert shared_part(body) == shared_part(text("ddp_multinode"))  # the same set-up (slurm/job_env.sh, site.sh)
    assert body.rstrip().endswith('mnist_tpmodel.py" --tp "$NPROC_PER_NODE" --num-workers "$NUM_WORKERS" '
                                  '--output-dir "$OUTPUT_DIR" --resume auto "$@"')
    assert re.search(r"""bash -c 'trap "" USR1; exec "\$@"' _ \\\n    torchrun --nnodes="\$SLURM_NNODES" """, body)


def test_tp_inside_each_node_fsdp2_across_two_nodes(slurm_cluster, synthetic_dir, tmp_path):
    workdir = tmp_path / "job"
    (workdir / "logs").mkdir(parents=True)
    out_dir = workdir / "out"
    args = ["--data", "synthetic", "--data-dir", synthetic_dir, "--train-samples", 512, "--test-samples", 101,
            "--epochs", 1, "--max-steps", 3, "--blocks", 2, "--device", "cpu", "--num-workers", 0,
            "--output-dir", out_dir]
    env = {"NPROC_PER_NODE": "2", "OUTPUT_ROOT": str(workdir / "runs")}
    job_id = sbatch(slurm_cluster, SCRIPT, args, 2, env, ROOT, workdir)
    job = Job("tp_2d", job_id, workdir, out_dir, time.monotonic() + 150)
    log = completed(slurm_cluster, job)
    assert f"resume: starting fresh (no checkpoint in {out_dir}" in log, log
    assert "== mesh: dp 2 (FSDP2 across the nodes) x tp 2 (TP inside each node)" in log, log
    rows = rank_lines(log)
    assert [r for r, *_ in rows] == [0, 1, 2, 3] and {w for _, _, w, _ in rows} == {4}, log
    assert [host for _, host, _, _ in rows] == ["n1", "n1", "n2", "n2"], log  # ranks 0-1: node 1's TP group
    assert "lesson 06: 4 processes, mesh dp 2 x tp 2," in log, log
    assert log.count("epoch 1 |") == 1, log
    check_metrics(job, 4, 101)  # test_samples exactly 101: counted once per TP group, every image once
    assert json.loads((out_dir / "metrics.json").read_text())["args"]["tp"] == 2
    assert len(list((out_dir / "checkpoints" / "ckpt-e0001-s0000000").glob("*.distcp"))) == 4
    assert (out_dir / "model_full.pt").stat().st_size > 0
