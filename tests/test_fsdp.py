"""Lesson 05 as FSDP2 is practised (issue 12), for real on CPU with gloo:
meta-device initialisation, --init-from a full checkpoint, --grad-accum, --clip-grad, --amp,
HSDP on a (2, 2) mesh, and an HSDP checkpoint that loads under plain FSDP on another number of ranks."""
import os
import subprocess
import sys

import pytest
import torch

import fsdp_workers
from common.distributed import free_port
from common.launcher import launch
from common.model import Net
from lessons import ROOT, SCRIPTS, assert_clean, metrics, run_script


@pytest.fixture(scope="module")
def small(synthetic_dir):
    return ["--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", "0", "--batch-size", "16",
            "--train-samples", "640", "--epochs", "1", "--max-steps", "3"]


def test_sharded_pieces_equal_a_plain_net(tmp_path):
    """4 ranks, on a 1-D mesh (uneven shards: fc2's 10 rows over 4 ranks) and on an HSDP (2, 2) mesh."""
    results = launch(fsdp_workers.fsdp_equivalence, nprocs=4, args=(1, 4, 2, 0.05, str(tmp_path)), timeout_s=240)
    assert all(r == results[0] for r in results)  # every rank saw the same
    for mesh, r in results[0].items():
        assert r["placements"] == {"fsdp": "(Shard(dim=0),)", "hsdp": "(Replicate(), Shard(dim=0))"}[mesh]
        assert r["init"] == 0.0, (mesh, r)  # meta device + init_weights: bit-identical to eager Net()
        assert r["init_from"] == 0.0, (mesh, r)  # broadcast_from_rank0: exactly rank 0's weights
        assert r["accum"] < 1e-6, (mesh, r)  # 2 micro-batches == one 2x step == a plain Net on the global batch
        assert r["clip"] < 1e-6, (mesh, r)  # the same with the gradients clipped (norm 2.3, max 0.05)
        # The sharded norm is the whole model's; fp32 sums over 1.2 M gradients differ by ~1e-5 between the two.
        assert r["norm"] == pytest.approx(r["norm_float64"], rel=1e-5), (mesh, r)
        assert r["norm"] == pytest.approx(r["norm_plain"], rel=1e-4), (mesh, r)


def test_init_from_lesson_04_checkpoint_with_amp_and_clip(small, tmp_path):
    """A lesson 04 checkpoint (its "model") loads into the sharded model; lr 1e-30 keeps it, so the export equals it
    (to 1e-20: a step of 1e-30 x an update of order 1 shows only on weights that are themselves that small)."""
    torch.manual_seed(7)
    weights = Net().state_dict()
    ckpt = tmp_path / "ckpt-e0003-s0000000.pt"
    torch.save({"model": weights, "optimizer": {}, "progress": {"epoch": 4}}, ckpt)  # the keys lesson 04 writes
    out = tmp_path / "run"
    proc = run_script("05", *small, "--test-samples", 64, "--init-from", ckpt, "--lr", 1e-30, "--amp",
                      "--clip-grad", 0.5, "--output-dir", out, nproc=2)
    assert_clean(proc)
    assert metrics(out)["args"]["amp"] == "auto" and metrics(out)["epochs"][0]["test_samples"] == 64
    exported = torch.load(out / "model_full.pt", weights_only=True)
    assert all(torch.allclose(exported[k], v, rtol=0, atol=1e-20) for k, v in weights.items())  # lr 1e-30 x ~1
    # A checkpoint of another --width is refused in one line: the bad-input matrix's real torchrun launch
    # (tests/test_bad_inputs.py, row 05-init-from-other-width).


def two_node_torchrun(args, timeout=240):
    """Two torchruns of 2 processes each on this machine, as on two nodes: LOCAL_WORLD_SIZE 2, WORLD_SIZE 4."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                               "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
                               str(SCRIPTS["05"]), *map(str, args)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for node in (0, 1)]
    try:
        return [p.communicate(timeout=timeout) + (p.returncode,) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_hsdp_on_2x2_then_its_checkpoint_loads_under_fsdp_on_3_ranks(small, tmp_path):
    hsdp, fsdp = tmp_path / "hsdp", tmp_path / "fsdp"
    (out0, err0, rc0), (out1, err1, rc1) = two_node_torchrun([*small, "--test-samples", 101, "--hsdp",
                                                              "--grad-accum", 2, "--output-dir", hsdp])
    assert rc0 == 0 and rc1 == 0, (out0 + err0 + out1 + err1)[-4000:]
    assert "Warning" not in out0 + err0 + out1 + err1
    assert "lesson 05: 4 processes, mesh (2, 2)" in out0, out0
    m = metrics(hsdp)
    assert m["world_size"] == 4 and [r["test_samples"] for r in m["epochs"]] == [101]
    folder = hsdp / "checkpoints" / "ckpt-e0001-s0000000"
    assert len(list(folder.glob("*.distcp"))) == 4
    # Another world size, a 1-D mesh: DCP reshards; --epochs 1 again, so it only loads and exports.
    proc = run_script("05", *small, "--test-samples", 101, "--grad-accum", 2, "--resume", folder,
                      "--output-dir", fsdp, nproc=3)
    assert_clean(proc)
    assert "mesh (3,)" in proc.stdout and "nothing to train" in proc.stdout
    saved, loaded = (torch.load(d / "model_full.pt", weights_only=True) for d in (hsdp, fsdp))
    assert saved.keys() == loaded.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())
