"""Execute every lesson notebook headless on the CPU and check what it showed the learner.

The notebooks hold no test code: these tests read the executed outputs (the per-rank lines,
the numbers) and check them. Also here: the notebook launcher's guarantees (CPU-only workers,
a failing rank named, no hang, output in rank order).
"""
import ast
import importlib
import os
import re
import sys
import time
import types

import nbformat
import pytest
from nbclient import NotebookClient

from common.launcher import WorkerError, launch, worker_environment
from lessons import ROOT

NOTEBOOKS = ["01_setup/setup.ipynb", "02_singlegpu_training/singlegpu.ipynb", "03_dp_training/dp.ipynb",
             "04_ddp_training/ddp.ipynb", "05_multigpu_fsdp_training/fsdp.ipynb"]


def cell_output(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            parts.append("\n".join(out.get("traceback", [])))
        parts.append(out.get("text", "") or "".join(out.get("data", {}).get("text/plain", "")))
    return "".join(parts)


class Executed:
    """An executed notebook: its whole output, and the output of the cell whose code contains a marker."""

    def __init__(self, book):
        self.book = book
        self.text = "\n".join(cell_output(c) for c in book.cells if c.cell_type == "code")

    def cell(self, marker: str) -> str:
        for c in self.book.cells:
            if c.cell_type == "code" and marker in c.source:
                return cell_output(c)
        raise AssertionError(f"no code cell contains {marker!r}")

    def lines(self, marker: str) -> list[str]:
        return self.cell(marker).splitlines()


def execute(path, synthetic_dir, tmp_path, monkeypatch) -> Executed:
    monkeypatch.setenv("WORKSHOP_DATA_DIR", synthetic_dir)
    monkeypatch.setenv("NOTEBOOK_OUTPUT_DIR", str(tmp_path / "run"))
    book = nbformat.read(ROOT / path, as_version=4)
    NotebookClient(book, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str((ROOT / path).parent)}}).execute()
    nb = Executed(book)
    assert "Warning" not in nb.text, nb.text[-3000:]
    return nb


def number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in:\n{text[-3000:]}"
    return float(match.group(1))


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_committed_without_outputs(path):
    book = nbformat.read(ROOT / path, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in book.cells if c.cell_type == "code")
    ids = [c.get("id") for c in book.cells]  # nbformat 4.5 cells carry unique ids (a missing one is a warning)
    assert None not in ids and len(set(ids)) == len(ids), ids


def test_01_collectives_per_rank(synthetic_dir, tmp_path, monkeypatch):
    nb = execute(NOTEBOOKS[0], synthetic_dir, tmp_path, monkeypatch)
    assert "verdict: READY" in nb.cell("check_env.py"), nb.text[-3000:]
    who = nb.lines("cw.who_am_i")
    assert who[0].startswith("[rank 0] I am rank 0 of 2") and who[1].startswith("[rank 1] I am rank 1 of 2"), who
    assert all(line.endswith("| backend gloo | GPUs visible: 0") for line in who[:2]), who
    assert nb.lines("cw.all_reduce") == ["[rank 0] before all_reduce: tensor([1.])", "[rank 0] after  all_reduce: tensor([3.])",
                                         "[rank 1] before all_reduce: tensor([2.])", "[rank 1] after  all_reduce: tensor([3.])"]
    assert nb.lines("cw.broadcast") == ["[rank 0] before broadcast: tensor([42.])", "[rank 0] after  broadcast: tensor([42.])",
                                        "[rank 1] before broadcast: tensor([-1.])", "[rank 1] after  broadcast: tensor([42.])"]
    gathered = "[tensor([0., 1.]), tensor([10., 11.])]"
    assert nb.lines("cw.all_gather") == ["[rank 0] before all_gather: mine=tensor([0., 1.])", f"[rank 0] after  all_gather: {gathered}",
                                         "[rank 1] before all_gather: mine=tensor([10., 11.])", f"[rank 1] after  all_gather: {gathered}"]
    failure = nb.cell("cw.fail_on_rank")
    assert "caught: rank 1 failed: ValueError: rank 1 cannot read its data shard" in failure and "failed rank: 1" in failure
    torchrun = set(nb.lines("torch.distributed.run"))  # ranks print as they go: any order
    for rank in (0, 1):
        assert {f"[rank {rank}] after  all_reduce: tensor([3.])", f"[rank {rank}] after  broadcast: tensor([42.])",
                f"[rank {rank}] after  all_gather: {gathered}"} <= torchrun, torchrun


def test_02_where_the_time_goes_and_bf16(synthetic_dir, tmp_path, monkeypatch):
    nb = execute(NOTEBOOKS[1], synthetic_dir, tmp_path, monkeypatch)
    assert nb.text.startswith("device: cpu")
    table = nb.cell("statistics.median")
    phases = {m[0]: (float(m[1]), float(m[2])) for m in
              re.findall(r"^\s+(data|forward|backward|optimizer)\s+([\d.]+) ms\s+([\d.]+)%", table, re.M)}
    assert set(phases) == {"data", "forward", "backward", "optimizer"}, table
    assert all(ms > 0 for ms, _ in phases.values()) and abs(sum(pct for _, pct in phases.values()) - 100) < 1, table
    assert re.search(r"largest share: (data|forward|backward|optimizer)", table)
    bf16 = nb.cell("torch.autocast")
    assert "conv1's output is torch.bfloat16" in bf16 and "bf16 within 0.02 of fp32: True" in bf16, bf16
    assert 0 < number(r"class probabilities: ([\d.]+)", bf16) < 0.02  # close, and not identical
    trained = nb.cell("mnist_singlegpu.py")  # the script's main(), in the kernel
    assert re.search(r"^epoch 1: test loss [\d.]+, accuracy \d+/500, train [\d.]+ s$", trained, re.M), trained[-3000:]
    assert "02-epoch-001.pt: model, optimizer, scheduler, epoch; epoch 1, 1,199,882 weights" in trained, trained


def test_03_dataparallel_is_a_no_op_on_cpu(synthetic_dir, tmp_path, monkeypatch):
    nb = execute(NOTEBOOKS[2], synthetic_dir, tmp_path, monkeypatch)
    assert "dp.device_ids: []" in nb.cell("nn.DataParallel(model)")
    assert re.findall(r"forward on (\S+): (\d+) images", nb.cell("register_forward_pre_hook")) == [("cpu", "64")]
    assert "identical: True" in nb.cell("torch.equal")
    assert "scatter onto 2 GPUs would send (32, 1, 28, 28) to cuda:1" in nb.cell("scatter(")


def test_04_ddp_samplers_gradients_and_no_sync(synthetic_dir, tmp_path, monkeypatch):
    nb = execute(NOTEBOOKS[3], synthetic_dir, tmp_path, monkeypatch)
    shards = {(int(r), int(e)): ast.literal_eval(ix) for r, e, ix in
              re.findall(r"\[rank (\d)\] epoch (\d): indices (\[.*\])", nb.cell("w.sampler_indices"))}
    assert set(shards) == {(0, 1), (1, 1), (0, 2), (1, 2)}, shards
    for epoch in (1, 2):  # disjoint, and together the whole data set
        assert len(shards[0, epoch]) == len(shards[1, epoch]) == 5
        assert sorted(shards[0, epoch] + shards[1, epoch]) == list(range(10))
    assert shards[0, 1] != shards[0, 2]  # set_epoch reshuffles
    padded = [ast.literal_eval(ix) for ix in re.findall(r"11 examples, no shuffle: indices (\[.*\])", nb.cell("w.sampler_indices"))]
    assert [len(p) for p in padded] == [6, 6] and set(padded[0] + padded[1]) == set(range(11))

    wrap = re.findall(r"\[rank (\d)\] (before|after)  ?DDP\(model\): fc2.bias (\[.*\])", nb.cell("w.ddp_wrap"))
    values = {(r, when): v for r, when, v in wrap}
    assert values["0", "before"] != values["1", "before"] and values["0", "after"] == values["1", "after"] == values["0", "before"]

    grads = nb.cell("w.gradients_2x32_vs_1x64")
    differences = [float(x) for x in re.findall(r"max \|grad\(2x32\) - grad\(1x64\)\| = (\S+)", grads)]
    assert len(differences) == 2 and all(d < 1e-6 for d in differences), grads

    accum = nb.cell("w.no_sync_accumulation")
    micro0 = re.findall(r"after micro-batch 0 .*fc2.bias.grad (\[.*?\]) \| all_reduce calls so far: (\d+) \| no_sync", accum)
    assert len(micro0) == 2 and [calls for _, calls in micro0] == ["0", "0"], accum
    assert micro0[0][0] != micro0[1][0]  # before the sync, each rank holds its own gradient
    synced = re.findall(r"after micro-batch 1 .*fc2.bias.grad (\[.*?\]) \| all_reduce calls so far: (\d+) \| synced", accum)
    assert len(synced) == 2 and synced[0] == synced[1] and int(synced[0][1]) >= 1, accum
    differences = [float(x) for x in re.findall(r"micro-batches x 16\) - grad\(1x64\)\| = (\S+)", accum)]
    assert len(differences) == 2 and all(d < 1e-6 for d in differences), accum

    trained = nb.cell("mnist_ddpmodel.py").replace("\r\n", "\n")  # `!`'s lines end in \r\n
    # each rank its shard; every test image counted once; rank 0's checkpoint, the plain Net's keys
    assert sorted(re.findall(r"^rank (\d) of 2 on cpu, 500 of 1000 training images$", trained, re.M)) == ["0", "1"], trained
    assert len(re.findall(r"^epoch 1: test loss [\d.]+, accuracy \d+/501, train ", trained, re.M)) == 1, trained
    assert ("04-epoch-001.pt: epoch 1, keys ['epoch', 'model', 'optimizer', 'scheduler'], 1,199,882 weights, "
            "first key features.0.weight") in trained, trained


def test_05_shards_and_a_checkpoint_saved_by_2_loaded_by_3(synthetic_dir, tmp_path, monkeypatch):
    nb = execute(NOTEBOOKS[4], synthetic_dir, tmp_path, monkeypatch)
    shards = nb.cell("w.show_shards")
    for rank in (0, 1):
        assert (f"[rank {rank}] fc1.weight        DTensor global (128, 9216) placements (Shard(dim=0),) local shard (64, 9216)"
                in shards), shards
        assert f"[rank {rank}] holds 599,941 of 1,199,882 parameters (50%)" in shards
        assert f"[rank {rank}] fc1.weight.grad local (64, 9216), Adam exp_avg local (64, 9216)" in shards
    saved = nb.cell("w.save_checkpoint")
    assert "checkpoint files: ['.metadata', '__0_0.distcp', '__1_0.distcp']" in saved, saved
    loaded = nb.cell("w.load_checkpoint")
    rows = re.findall(r"\[rank (\d)\] loaded my shards: fc1.weight rows \((\d+), 9216\), fc2.bias \((\d+),\), Adam step 1",
                      loaded)
    assert rows == [("0", "43", "4"), ("1", "43", "4"), ("2", "42", "2")], loaded
    assert number(r"max \|saved by 2 ranks - loaded by 3 ranks\| = (\S+)", loaded) == 0
    assert "parameters equal: True" in loaded
    held = nb.cell("w.state_bytes")  # parameters + gradients + AdamW state per rank: 1/N, nothing duplicated
    found = re.findall(r"(\d) rank\(s\): largest rank .* = 1/(\S+) of one rank's; all ranks together\s+(\S+) MiB", held)
    assert [n for n, _, _ in found] == ["1", "2", "3"], held
    ratios = [float(r) for _, r, _ in found]
    assert ratios[0] == 1.0 and 1.99 < ratios[1] <= 2.0 and 2.9 < ratios[2] <= 3.0, held
    assert len({together for _, _, together in found}) == 1, held


# ---- the launcher behind the notebooks' multi-process cells -------------------------------------

@pytest.fixture
def cw(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "01_setup"))  # the workers import it by name too
    return importlib.import_module("collective_workers")


def test_launched_workers_use_the_cpu_and_gloo_even_with_a_gpu_visible(cw, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # as on a workstation with one GPU
    env = worker_environment(1, 2, 29500, 1)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "1")
    assert launch(cw.who_am_i, nprocs=2, timeout_s=60) == [
        {"rank": r, "world_size": 2, "backend": "gloo", "gpus": 0} for r in range(2)]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # the notebook's own process keeps its GPU


def test_launcher_names_the_failing_rank_quickly(cw):
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 2 failed: ValueError: rank 2 cannot read its data shard") as info:
        launch(cw.fail_on_rank, nprocs=3, args=(2,), timeout_s=60)
    assert info.value.rank == 2 and "Traceback" in info.value.worker_traceback
    assert time.monotonic() - start < 30  # the healthy ranks, stuck in a barrier, were stopped


def test_launcher_times_out_instead_of_waiting_forever():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\] did not finish within 2 s"):
        launch(time.sleep, nprocs=1, args=(60,), timeout_s=2)
    assert time.monotonic() - start < 20


def test_launcher_prints_worker_lines_in_rank_order(cw, capsys):
    assert launch(cw.all_reduce, nprocs=3, timeout_s=60) == [6.0, 6.0, 6.0]
    lines = capsys.readouterr().out.splitlines()
    assert [line[:8] for line in lines] == ["[rank 0]"] * 2 + ["[rank 1]"] * 2 + ["[rank 2]"] * 2, lines
    assert lines[1] == "[rank 0] after  all_reduce: tensor([6.])"


def test_launcher_refuses_a_function_typed_into_a_notebook(monkeypatch):
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # a kernel's __main__ has no file
    typed_in_a_cell = types.FunctionType((lambda: 1).__code__, {}, "typed_in_a_cell")
    typed_in_a_cell.__module__ = "__main__"
    with pytest.raises(TypeError, match="Put it in a .py file"):
        launch(typed_in_a_cell, nprocs=2)
