"""08_your_model/port: a researcher's train.py, its DDP and FSDP2 ports, the sbatch template, and every item of
08_your_model/checklist.md.

Real gloo process groups through torchrun, on synthetic digits (genuine IDX files), a few hundred images per run.
train_ddp.py runs as two "nodes" of one process each (two torchruns, both with LOCAL_RANK 0), train_fsdp.py through
slurm_submit_any.sh (bash, with stand-ins for srun and scontrol: torchrun with a c10d rendezvous), the variants with
torchrun --standalone. Each checklist item has a variant of a port with that item removed (a text replacement on a
copy; the replaced text must exist), and the variant fails a check that the correct port passes (the runs:
tests/port_runs.py; the checks: tests/port_checks.py). Most variants still run to the end with exit 0: their bugs
are silent.
"""
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from common.launcher import launch as launch_ranks
from lessons import ROOT
from port_checks import CHECKS, DDP_CHECKS, FAILS_WITH, check_same_as_ddp
from port_runs import (FAKE_SLURM, FROM_FILE, LOADING, PORT, SPY, TEST_DDP, TEST_FSDP, TRAIN_PY, VARIANTS, ddp_grads,
                       launch, load_port, saved_on_a_gpu, small_bn_net, variant, wrong_half_of_the_test_labels)
from walk import TOLERANCE

# The module's runs (every port, variant and batch run, 2 at a time) are set up inside the first test that needs them:
# 368 s at 7e4d32c under make test-slow beside another worker on this 2-core machine, over 600 s beside more load.
pytestmark = pytest.mark.timeout(1500)

# The global batch (checklist item "the global batch"): train.py at 64 a step, then the DDP port on 2 ranks with
# train.py's flags (2 x 64: half the steps), with the same global batch (2 x 32), and with the learning rate scaled.
BATCH = ["--epochs", "3", "--train-samples", "2048", "--device", "cpu"]
BATCH_RUNS = {"one_process": ["--batch-size", "64"], "ddp_2x64": ["--batch-size", "64"],
              "ddp_2x32": ["--batch-size", "32"], "ddp_2x64_lr_x2": ["--batch-size", "64", "--lr", "2e-3"]}
OWN_SHARD = ["--epochs", "3", "--batch-size", "32", "--train-samples", "512", "--device", "cpu"]
HANG_DEADLINE_S = 60  # the correct port on the same data and flags takes ~15 s on 2 idle cores


@pytest.fixture(scope="module")
def runs(synthetic_dir, tmp_path_factory):
    """Every launch of this file, two at a time: the correct ports, each variant, the global-batch runs."""
    tmp = tmp_path_factory.mktemp("port")
    (tmp / "spy").mkdir()
    (tmp / "spy" / "sitecustomize.py").write_text(SPY)
    (tmp / "fakebin").mkdir()
    for name, text in FAKE_SLURM.items():
        (tmp / "fakebin" / name).write_text(text)
        (tmp / "fakebin" / name).chmod(0o755)
    saved_on_a_gpu(tmp / "init.pt")  # FROM_FILE's --init-from
    data = str(Path(synthetic_dir) / "synthetic")
    split = wrong_half_of_the_test_labels(data, tmp / "split")
    ddp, fsdp = PORT / "train_ddp.py", PORT / "train_fsdp.py"
    jobs = {"ddp": (ddp, data, "2x1", TEST_DDP, {}), "fsdp": (fsdp, data, "slurm", TEST_FSDP, {}),
            "ddp_split": (ddp, split, "1x2", TEST_DDP, {"flags": OWN_SHARD}),
            "ddp_init": (ddp, data, "1x2", TEST_DDP, {"flags": FROM_FILE}),
            "fsdp_init": (fsdp, data, "1x2", TEST_DDP, {"flags": FROM_FILE})}
    for name, (script, _, layout, _) in VARIANTS.items():
        options = ({"flags": OWN_SHARD, "deadline_s": HANG_DEADLINE_S} if name == "best_by_own_shard" else
                   {"flags": FROM_FILE} if name in LOADING else {})
        jobs[name] = (variant(name, tmp), split if options else data, layout,
                      TEST_FSDP if script == "train_fsdp.py" else TEST_DDP, options)
    for name, flags in BATCH_RUNS.items():
        script, layout = (PORT / "train.py", "1") if name == "one_process" else (ddp, "1x2")
        jobs[name] = (script, data, layout, 1000, {"flags": BATCH + flags})
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(launch, script, data_dir, tmp / name, layout, test, **options)
                   for name, (script, data_dir, layout, test, options) in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def epoch_lines(output: str) -> list[dict]:
    return [dict(zip(("loss", "accuracy"), map(float, m.groups()))) for m in
            re.finditer(r"^epoch \d+ \| train_loss (\S+) \| .* test_accuracy (\S+) ", output, re.M)]


def test_train_py_runs_and_learns(synthetic_dir, tmp_path):
    proc = subprocess.run([sys.executable, str(PORT / "train.py"), "--data-dir", str(Path(synthetic_dir) / "synthetic"),
                           "--epochs", "2", "--train-samples", "1024", "--test-samples", "200", "--device", "cpu",
                           "--checkpoint", str(tmp_path / "ckpt" / "model.pt")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "PORT_DEBUG_DIR": ""})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Warning" not in out, out[-3000:]
    first, last = epoch_lines(proc.stdout)
    assert last["loss"] < first["loss"] and last["accuracy"] >= 0.8, out  # synthetic digits: far easier than MNIST
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["model.pt"]  # written whole: no .tmp left
    model = TRAIN_PY.Net()
    model.load_state_dict(torch.load(tmp_path / "ckpt" / "model.pt", weights_only=True))


BAD_FLAGS = {("--epochs", "0"): "argument --epochs: must be at least 1, not 0",
             ("--batch-size", "-64"): "argument --batch-size: must be at least 1, not -64",
             ("--lr", "-0.1"): "argument --lr: must be above 0, not -0.1",
             ("--data-dir", "no/such/folder"): "--data-dir no/such/folder is not a folder"}


@pytest.mark.parametrize("flags", BAD_FLAGS)
def test_bad_flags_are_one_line_errors(flags, tmp_path, monkeypatch, capsys):
    """train.py's parse_args, the first thing its main() does, in this process (a new one costs 3 s of imports)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", *flags])
    with pytest.raises(SystemExit) as exit_:
        TRAIN_PY.parse_args()
    out = capsys.readouterr()
    assert exit_.value.code == 2 and out.out == "", (flags, out)
    assert out.err.count("\n") == 1 and out.err.startswith(f"train.py: error: {BAD_FLAGS[flags]}"), out.err


@pytest.mark.parametrize("script", ["train", "train_ddp", "train_fsdp"])
def test_no_data_is_one_line_naming_the_download_and_leaves_nothing(script, tmp_path, monkeypatch):
    """Each port's load_data, offline (a proxy that refuses every connection: a test never downloads)."""
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with pytest.raises(SystemExit) as exit_:
        load_port(script).load_data(SimpleNamespace(data_dir=str(tmp_path), train_samples=None, test_samples=None))
    message = str(exit_.value.code)
    assert message.startswith("error: MNIST is not in ") and "\n" not in message, message
    assert f"python 01_setup/download_mnist.py --data-dir {tmp_path}" in message, message
    assert os.listdir(tmp_path) == []  # no empty MNIST/raw left behind


def diff_counts(old: str, new: str) -> tuple[int, int]:
    """Lines that `diff` (the command the checklist names) shows removed and added."""
    out = subprocess.run(["diff", PORT / old, PORT / new], capture_output=True, text=True).stdout.splitlines()
    return sum(line.startswith("< ") or line == "<" for line in out), sum(line.startswith("> ") or line == ">"
                                                                          for line in out)


def test_the_checklist_states_each_diff_as_diff_counts_it():
    text = (ROOT / "08_your_model" / "checklist.md").read_text()
    for old, new in [("train.py", "train_ddp.py"), ("train_ddp.py", "train_fsdp.py")]:
        removed, added = diff_counts(old, new)
        stated = f"`diff 08_your_model/port/{old} 08_your_model/port/{new}`: {removed} lines removed, {added} added"
        assert stated in text, (stated, "not in checklist.md")
    assert "import common" not in (PORT / "train.py").read_text()  # a script the course did not write


def test_train_ddp_passes_every_check(runs):
    """Run as two "nodes" of one process (two torchruns, both with LOCAL_RANK 0), where local-rank sharding shows."""
    ddp = runs["ddp"]
    assert sorted(re.findall(r"\[rank (\d)/2\] training on cpu: 256 of 512 training images, (\d+) of 101 test "
                             r"images, a step of 32 x 2", ddp.output)) == [("0", "51"), ("1", "50")], ddp.output
    assert [e["total"] for e in ddp.epochs] == [TEST_DDP, TEST_DDP]  # printed by rank 0 alone, each image once
    for name in DDP_CHECKS:
        CHECKS[name](ddp)


def test_train_fsdp_through_the_sbatch_template_passes_every_check(runs):
    """slurm_submit_any.sh run by bash, with stand-ins for srun and scontrol: torchrun with a c10d rendezvous."""
    fsdp = runs["fsdp"]
    assert "== script " in fsdp.output and "== rendezvous localhost:" in fsdp.output, fsdp.output
    for name in ["finishes", "shards", "new_order", "one_writer", "train_loss", "exact_test", "plain_keys",
                 "leaves_group", "schedule_ends"]:
        CHECKS[name](fsdp)
    check_same_as_ddp(fsdp, runs["ddp"])  # the same training as DDP's, with rank 0's 2 test batches against rank 1's 1


def test_a_branch_on_all_reduced_numbers_is_taken_by_every_rank(runs):
    """The test labels of rank 1's shard are wrong: its own loss rises after epoch 1 while rank 0's falls. The port
    decides on the all-reduced loss; its variant best_by_own_shard, on each rank's own, hangs (the next test)."""
    split = runs["ddp_split"]
    CHECKS["finishes"](split)
    CHECKS["exact_test"](split)
    assert split.saved_epochs == [1] and split.epochs[1]["test_loss"] > split.epochs[0]["test_loss"], split.output


def test_every_rank_starts_from_a_file_saved_on_a_gpu(runs):
    """--init-from a file whose tensors say cuda:0, on 2 CPU ranks: each port loads it on every rank, with
    map_location, before the wrap; FSDP2's ranks then hold their shards of it, and train as DDP's replicas do."""
    for name in ("ddp_init", "fsdp_init"):
        CHECKS["finishes"](runs[name])
        CHECKS["starts_from"](runs[name])
    check_same_as_ddp(runs["fsdp_init"], runs["ddp_init"])


@pytest.mark.parametrize("name", VARIANTS)
def test_a_port_without_an_item_fails_its_check(runs, name):
    check = VARIANTS[name][3]
    with pytest.raises(AssertionError, match=FAILS_WITH[check]):
        CHECKS[check](runs[name], runs["ddp"])
    if name == "best_by_own_shard":
        assert runs[name].hung, runs[name].output[-3000:]  # rank 0 waits at its barrier; rank 1 trains on


def within_tolerance(line: dict, reference: dict) -> bool:
    """tests/walk.py's TOLERANCE, the course's: accuracy within 2 points, loss within 10% or 0.02."""
    loss_limit = max(TOLERANCE["loss"] * reference["test_loss"], TOLERANCE["loss_abs"])
    return (abs(line["accuracy"] - reference["accuracy"]) <= TOLERANCE["accuracy"]
            and abs(line["test_loss"] - reference["test_loss"]) <= loss_limit)


def test_the_ddp_port_matches_one_process_at_the_same_global_batch(runs):
    """With train.py's flags the port takes 2 x 64 images a step, half the steps: it ends outside the tolerance of
    the one-process run. The same global batch (2 x 32), or the learning rate scaled with the batch, ends inside."""
    one = runs["one_process"].epochs[-1]
    for name in BATCH_RUNS:
        CHECKS["finishes"](runs[name])
    assert not within_tolerance(runs["ddp_2x64"].epochs[-1], one), (runs["ddp_2x64"].epochs[-1], one)
    for name in ["ddp_2x32", "ddp_2x64_lr_x2"]:
        assert within_tolerance(runs[name].epochs[-1], one), (name, runs[name].epochs[-1], one)
    assert "a step of 64 x 2" in runs["ddp_2x64"].output and "a step of 32 x 2" in runs["ddp_2x32"].output


def test_plain_batchnorm_under_ddp_normalizes_each_shard_alone():
    """SyncBatchNorm is GPU-only (its forward and DDP both refuse CPU modules), so on a CPU this shows the bug it
    prevents and the conversion: plain BatchNorm under DDP on 2 gloo ranks computes other gradients than one
    process on the same global batch (each rank normalizes its 8 images by their own mean), while the same model
    with GroupNorm in its place (each image normalized alone) gives one process's gradients."""
    torch.manual_seed(0)
    data, target = torch.randn(16, 4), torch.randint(0, 3, (16,))
    for batchnorm in (True, False):
        model = small_bn_net(batchnorm)
        nn.functional.cross_entropy(model(data), target).backward()
        (grads, refused), _ = launch_ranks(ddp_grads, nprocs=2, args=(model.state_dict(), batchnorm, data, target),
                                           timeout_s=120)
        gap = max((g - p.grad).abs().max().item() for g, p in zip(grads, model.parameters()))
        assert (gap > 1e-2) if batchnorm else (gap < 1e-5), (batchnorm, gap)
        assert refused == ("SyncBatchNorm layers only work with GPU modules" if batchnorm else None), refused
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(small_bn_net(True))
    assert [type(m).__name__ for m in synced.modules() if "BatchNorm" in type(m).__name__] == ["SyncBatchNorm"]


def test_the_checklist_names_each_variant_and_its_check():
    text = (ROOT / "08_your_model" / "checklist.md").read_text()
    assert all(len(line) <= 120 for line in text.splitlines())
    items = re.findall(r"^\d+\. .*$", text, re.M)  # one line each, naming its proof: a variant, a test, or none
    assert items and all(re.search(r"` -> `|`test_\w+`|\(no variant\)", item) for item in items), items
    for name, (_, _, _, check) in VARIANTS.items():  # the variant and the check it fails, on the item's line
        assert any(f"`{name}` -> `{check}`" in item for item in items), name
    for name in re.findall(r"`(test_\w+)`", text):
        assert name in globals(), f"{name}: no such test in tests/test_port.py"
