"""Lesson 05 as FSDP2 is practised, for real on CPU with gloo:
meta-device initialisation, --init-from a full checkpoint, --grad-accum, --clip-grad, --amp. HSDP on a (2, 2) mesh
and its checkpoint loaded on 3 ranks are walked in 05_multigpu_fsdp_training/reference.md (and run on the Slurm test
cluster, tests/test_slurm_hsdp.py); a 2-rank checkpoint loaded on 3, weights compared, in tests/test_exercises_05.py."""
import pytest
import torch

import fsdp_workers
from common.launcher import launch
from common.model import Net
from lessons import assert_clean, metrics, run_trainer


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
    """The trainer's fsdp2: a lesson 04 checkpoint (its "model") loads into the sharded model; lr 1e-30 keeps it, so the export equals it
    (to 1e-20: a step of 1e-30 x an update of order 1 shows only on weights that are themselves that small)."""
    torch.manual_seed(7)
    weights = Net().state_dict()
    ckpt = tmp_path / "ckpt-e0003-s0000000.pt"
    torch.save({"model": weights, "optimizer": {}, "progress": {"epoch": 4}}, ckpt)  # the keys lesson 04 writes
    out = tmp_path / "run"
    proc = run_trainer("fsdp2", *small, "--test-samples", 64, "--init-from", ckpt, "--lr", 1e-30, "--amp",
                       "--clip-grad", 0.5, "--output-dir", out, nproc=2)
    assert_clean(proc)
    assert metrics(out)["args"]["amp"] == "auto" and metrics(out)["epochs"][0]["test_samples"] == 64
    exported = torch.load(out / "model_full.pt", weights_only=True)
    assert all(torch.allclose(exported[k], v, rtol=0, atol=1e-20) for k, v in weights.items())  # lr 1e-30 x ~1
    # The export itself (a plain state dict, no "model" key) is what --init-from also takes: read as it is.
    again = fsdp_workers.lesson05.read_full_weights(out / "model_full.pt", Net())
    assert again.keys() == exported.keys() and all(torch.equal(again[k], exported[k]) for k in exported)
    # A checkpoint of another --width is refused in one line: the bad-input matrix's real torchrun launch
    # (tests/test_bad_inputs.py, row 05-init-from-other-width).
