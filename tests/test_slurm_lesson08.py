"""Lesson 08's template for any script (08_your_model/slurm_submit_any.sh), running digits_lm.py, submitted UNCHANGED
to the real two-node test cluster (--nodes=2, 2 processes per node; the test nodes' "GPUs" are /dev/null, so gloo on
CPU): one torchrun per node meeting at a c10d rendezvous, 4 ranks sharding the Hugging Face decoder with FSDP2 across
the two nodes' network namespaces, each rank writing its DCP shard and its part of the export.
"""
import json
import re
import time

from slurm.jobs import Job, completed, sbatch

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
