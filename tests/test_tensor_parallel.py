"""Lesson 06, for real on CPU with gloo: tensor parallelism on 2 ranks and a 2 x 2 mesh against a plain
TPNet, each rank's pieces, the sampler by data-parallel rank, the collectives per step that the README derives,
a checkpoint of a 2 x 2 run read back on 1 x 2 and 4 x 1, and one run of trainer --parallel 2d (lesson 06's
script with the trainer's metrics.json, config.yaml and model_full.pt) on real flags.

Starting ranks is what costs (each imports torch): one torchrun run and two launches of in-process ranks."""
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from common.exits import run
from common.launcher import launch
from lessons import ROOT, assert_clean, metrics, run_trainer

sys.path.insert(0, str(ROOT / "06_tensor_parallel"))
import tp_workers  # noqa: E402
from comm_bytes import held, predict  # noqa: E402

BLOCKS, HIDDEN = 2, 16  # the size the workers build (tp_workers.checks' defaults)


def expected_collectives(dp: int, tp: int, blocks: int = BLOCKS) -> tuple[dict, dict]:
    """The README's count, forward and whole step (forward + backward): U units = features, fc1, the blocks, fc2.

    FSDP2 (only if dp > 1): one all-gather per unit in forward, again in backward, and one reduce-scatter per unit.
    TP (only if tp > 1): per block one all-reduce in forward (down's partial sums) and one in backward (the
    gradient of up's input, partial over the TP ranks: each rank holds a slice of up's weight)."""
    units = 3 + blocks
    forward, step = {}, {}
    if dp > 1:
        forward["_allgather_base_"], step["_allgather_base_"], step["_reduce_scatter_base_"] = units, 2 * units, units
    if tp > 1:
        forward["all_reduce"], step["all_reduce"] = blocks, 2 * blocks
    return forward, step


@pytest.fixture(scope="module")
def run_2x2(synthetic_dir, tmp_path_factory):
    """trainer --parallel 2d (lesson 06's code) through torchrun: 4 processes, --tp 2 (a 2 x 2 mesh), one epoch,
    --clip-grad."""
    out = tmp_path_factory.mktemp("tp") / "run"
    proc = run_trainer("2d", "--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", "0",
                       "--train-samples", 256, "--test-samples", 101, "--batch-size", 16, "--epochs", 1,
                       "--tp", 2, "--blocks", BLOCKS, "--hidden", HIDDEN, "--clip-grad", 1.0, "--output-dir", out,
                       nproc=4)
    return proc, out


def test_the_script_trains_on_a_2x2_mesh(run_2x2):
    proc, out = run_2x2
    assert_clean(proc)
    assert "lesson 06: 4 processes, mesh dp 2 x tp 2" in proc.stdout, proc.stdout
    row = metrics(out)["epochs"][0]
    assert row["test_samples"] == 101  # counted once per TP group: 4 ranks would count 202
    assert 0 < row["train_loss"] < 2.5 and 0.0 <= row["test_accuracy"] <= 1.0
    assert (out / "checkpoints" / "ckpt-e0001-s0000000" / ".metadata").is_file()
    assert "tp: 2" in (out / "config.yaml").read_text()
    plain = tp_workers.lesson().TPNet(blocks=BLOCKS, hidden=HIDDEN)
    plain.load_state_dict(torch.load(out / "model_full.pt", weights_only=True))  # a plain TPNet's weights


# --tp 0, -1, 1.5, 3, 2 on one process and 4 on two: rows of the bad-input table (tests/bad_inputs.py)
def test_tp_not_dividing_the_processes_is_one_line(tmp_path, capsys, monkeypatch):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "6",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        run(tp_workers.lesson().main, ["--tp", "4", "--output-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err
    assert err.startswith("error: --tp 4 does not divide the 6 process(es)"), err


def check_step(results, dp, tp, key="step"):
    """Equal to one process; the collectives the README counts; the bytes docs/communication.md predicts; the bytes
    docs/memory.md predicts each rank holds."""
    forward, step = expected_collectives(dp, tp)
    strategy = "2d" if dp > 1 and tp > 1 else "tp" if tp > 1 else "fsdp"
    payloads = predict(strategy, BLOCKS, HIDDEN, batch=4, dp=dp, tp=tp)
    for r in results:
        s = r[key]
        assert s["bytes"] == payloads, (s["bytes"], payloads)  # exactly what the collectives received
        assert r["ddp"]["payload"] == predict("ddp", BLOCKS, HIDDEN, batch=4, dp=dp * tp)["all_reduce"]
        assert r["ddp"]["held"] == held("ddp", BLOCKS, HIDDEN)  # docs/memory.md: everything, on every rank
        assert (s["dp_rank"], s["tp_rank"]) == divmod(s["rank"], tp)  # TP peers are neighbours: inside a node
        assert s["output_diff"] < 1e-5 and s["grad_diff"] < 1e-5, s  # equal to one process on the global batch
        assert s["norm"] == pytest.approx(s["norm_plain"], rel=1e-5)  # the clipping norm: every element once
        assert s["forward"] == forward and s["step"] == step, (s["forward"], s["step"])
    assert results[0][key]["held"] == held(strategy, BLOCKS, HIDDEN, dp, tp)  # rank 0: ceil(rows / dp) rows


def check_sampler(results, dp, tp):
    groups = [[r["indices"] for r in results[g * tp:(g + 1) * tp]] for g in range(dp)]
    for peers in groups:
        assert all(p == peers[0] for p in peers)  # the ranks of a TP group read the same batches
    firsts = [set(peers[0]) for peers in groups]
    assert sum(map(len, firsts)) == len(set().union(*firsts)) == 40  # the groups split the data, no overlap


def check_load(results, reference):
    """Every weight and optimizer state of the 2 x 2 checkpoint, read back on another mesh, equals the saved one."""
    loaded = results[0]["load"]
    assert loaded["model"].keys() == reference["model"].keys()
    for name, value in reference["model"].items():
        assert torch.equal(loaded["model"][name], value), name
        for key in ("square_avg", "acc_delta"):  # Adadelta's state
            assert torch.equal(loaded["optimizer"][name][key], reference["optimizer"]["state"][name][key]), name


@pytest.fixture(scope="module")
def saved(run_2x2, tmp_path_factory):
    """The 2 x 2 run's checkpoint as one plain file, read without any process group (the reference)."""
    path = run_2x2[1] / "checkpoints" / "ckpt-e0001-s0000000"
    plain = tmp_path_factory.mktemp("ref") / "full.pt"
    dcp_to_torch_save(path, plain)
    return path, torch.load(plain, weights_only=False)


def test_tp_on_2_ranks_and_the_checkpoint_on_1x2(saved):
    path, reference = saved
    results = launch(tp_workers.checks, nprocs=2, args=(2, 2, str(path)), timeout_s=240)
    check_step(results, dp=1, tp=2)
    check_sampler(results, dp=1, tp=2)
    shapes = results[0]["step"]["local_shapes"]
    assert shapes["blocks.0.up.weight"] == (2 * HIDDEN, HIDDEN)  # 4 x 16 output features, half on each rank
    assert shapes["blocks.0.down.weight"] == (HIDDEN, 2 * HIDDEN)  # its input features, half on each rank
    assert shapes["blocks.0.down.bias"] == (HIDDEN,) and shapes["fc1.weight"] == (HIDDEN, 9216)  # whole on both
    check_load(results, reference)


def test_2d_on_4_ranks_and_the_checkpoint_on_4x1(saved):
    path, reference = saved
    results = launch(tp_workers.checks, nprocs=4, args=(2, 1, str(path)), timeout_s=240)
    check_step(results, dp=2, tp=2)
    check_step(results, dp=4, tp=1, key="step_other_mesh")  # FSDP2 alone: lesson 05's collectives
    initial, fsdp_only = results[0]["step"]["initial"], results[0]["step_other_mesh"]["initial"]
    assert all(torch.equal(initial[k], fsdp_only[k]) for k in initial)  # init_weights: the same values on any mesh
    check_sampler(results, dp=2, tp=2)
    step = results[0]["step"]
    up = step["placements"]["blocks.0.up.weight"]  # rows cut over "tp", then those pieces again over "dp"
    assert up.startswith("(_StridedShard(dim=0") and up.endswith("Shard(dim=0))"), up
    assert step["placements"]["fc1.weight"] == "(Shard(dim=0),)"  # FSDP2 only: cut over "dp", whole over "tp"
    shapes = step["local_shapes"]
    assert shapes["blocks.0.up.weight"] == (HIDDEN, HIDDEN)  # 64 rows: a quarter on each rank
    assert shapes["blocks.0.down.weight"] == (HIDDEN // 2, 2 * HIDDEN)  # rows over dp, columns over tp
    assert shapes["fc1.weight"] == (HIDDEN // 2, 9216)
    assert results[0]["load"]["shapes"]["blocks.0.up.weight"] == (HIDDEN, HIDDEN)  # 4 x 1: FSDP2's cut only
    check_load(results, reference)
