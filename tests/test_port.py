"""08_your_model/port: a researcher's train.py, its DDP and FSDP2 ports, the sbatch template, and every item of
08_your_model/checklist.md.

Real gloo process groups through torchrun, on synthetic digits (genuine IDX files), a few hundred images per run.
train_ddp.py runs as two "nodes" of one process each (two torchruns, both with LOCAL_RANK 0), train_fsdp.py through
slurm_submit_any.sh (bash, with stand-ins for srun and scontrol: torchrun with a c10d rendezvous), the variants with
torchrun --standalone. Each checklist item has a variant of a port with that item removed (a text replacement on a
copy; the replaced text must exist). Every variant still runs to the end with exit 0: the bugs are silent. Each one
fails a check that the correct port passes:
  shards          each epoch, the ranks trained on disjoint shards that together are the training set once
  new_order       each rank's order differs between epochs
  one_writer      torch.save ran on rank 0 only (seen by a sitecustomize wrapped around torch.save, outside the port)
  train_loss      the printed train loss is the sum of every rank's losses over the sum of their images
  exact_test      the printed test line equals one plain process evaluating the saved weights on the whole test set
  replicas        the ranks hold the same weights after each epoch (a checksum each rank records)
  same_as_ddp     train_fsdp.py's weights equal train_ddp.py's, same flags
What each rank trained on and its checksum come from the ports' test hook (debug_record, PORT_DEBUG_DIR).
"""
import difflib
import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from common.distributed import free_port
from lessons import ROOT

PORT = ROOT / "08_your_model" / "port"
TRAIN = 512  # training images: 256 per rank, 8 steps of 32
TEST_DDP, TEST_FSDP = 101, 2001  # odd: the ranks get 51 and 50; 1001 and 1000, i.e. 2 test batches and 1
FLAGS = ["--epochs", "2", "--batch-size", "32", "--train-samples", str(TRAIN), "--device", "cpu"]
SAVE_SPY = """import os
if os.environ.get("PORT_DEBUG_DIR") and "RANK" in os.environ:  # torchrun's workers only
    import torch
    _save = torch.save
    def _spy(obj, f, *args, **kwargs):
        with open(os.path.join(os.environ["PORT_DEBUG_DIR"], "torch_save_calls"), "a") as log:
            log.write(os.environ["RANK"] + "\\n")
        return _save(obj, f, *args, **kwargs)
    torch.save = _spy
"""
FAKE_SLURM = {  # stand-ins that let bash run the sbatch template on this machine, as one node
    "srun": '#!/bin/bash\nwhile [[ $1 == -* ]]; do shift; done  # its options; then the command, once\nexec "$@"\n',
    "scontrol": '#!/bin/bash\n[ "$2" != hostnames ] || echo localhost\n',
}

# Each variant: a checklist item removed from a port. (script, [(text, replacement, or None to delete its line)],
# the layout it runs in, and the check it must fail.)
VARIANTS = {
    "no_distributed_sampler": ("train_ddp.py", [("sampler=train_sampler", "shuffle=True")], "1x2", "shards"),
    "sharded_by_local_rank": ("train_ddp.py", [("rank=rank, shuffle=True", "rank=local_rank, shuffle=True")],
                              "2x1", "shards"),
    "no_set_epoch": ("train_ddp.py", [("train_sampler.set_epoch(epoch)", None)], "1x2", "new_order"),
    "every_rank_saves": ("train_ddp.py", [("if rank == 0:  # one writer", "if True:  # one writer")], "1x2",
                         "one_writer"),
    "train_loss_of_rank_0": ("train_ddp.py", [("dist.all_reduce(sums)", None)], "1x2", "train_loss"),
    "means_of_rank_means": ("train_ddp.py", [("[train_loss, seen, test_loss, correct, total]",
                                              "[train_loss / seen, 1, test_loss / total, correct / total, 1]")],
                            "1x2", "exact_test"),
    "padded_test_shard": ("train_ddp.py", [("Subset(test_set, range(rank, len(test_set), world_size))",
                                            "Subset(test_set, list(DistributedSampler(test_set, shuffle=False)))")],
                          "1x2", "exact_test"),
    "no_ddp_wrap": ("train_ddp.py", [("DDP(Net().to(device), device_ids=[local_rank] "
                                      'if device.type == "cuda" else None)', "Net().to(device)"),
                                     ("model.module.state_dict()", "model.state_dict()")], "1x2", "replicas"),
    "seed_per_rank": ("train_fsdp.py", [("torch.manual_seed(args.seed)", "torch.manual_seed(args.seed + rank)")],
                      "1x2", "same_as_ddp"),
}


def variant(name: str, folder: Path) -> Path:
    """A copy of the port with the replacements of VARIANTS[name]; each replaced text must occur exactly once."""
    script, replacements, _, _ = VARIANTS[name]
    text = (PORT / script).read_text()
    for old, new in replacements:
        assert text.count(old) == 1, f"{name}: {old!r} occurs {text.count(old)} times in {script}"
        if new is None:
            start = text.rindex("\n", 0, text.index(old)) + 1
            text = text[:start] + text[text.index("\n", start) + 1:]
        else:
            text = text.replace(old, new)
    path = folder / f"{name}.py"
    path.write_text(text)
    return path


def launch(script: Path, data_dir: str, out: Path, layout: str = "1x2", test_samples: int = TEST_DDP):
    """Run `script` as NODESxPROCS: 1x2 is torchrun --standalone with 2 processes; 2x1 is two torchruns of one process
    each on this machine, as two nodes (every LOCAL_RANK is 0); slurm is 08_your_model/slurm_submit_any.sh run by
    bash as a one-node job of 2 processes. Returns what the run printed, recorded and saved."""
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PORT_DEBUG_DIR": str(out),
           "PYTHONPATH": str(out.parent / "spy")}
    args = [str(script), "--data-dir", data_dir, "--test-samples", str(test_samples),
            "--checkpoint", str(out / "model.pt"), *FLAGS]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if layout == "1x2":
        commands = [torchrun + ["--standalone", "--nproc_per_node=2"] + args]
    elif layout == "slurm":
        commands = [["bash", str(ROOT / "08_your_model" / "slurm_submit_any.sh"), str(script.relative_to(ROOT)),
                     *args[1:]]]
        env.update(SLURM_JOB_ID="7", SLURM_JOB_NAME="any", SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_NODELIST="localhost",
                   SLURM_NNODES="1", SLURM_CPUS_PER_TASK="2", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()),
                   PATH=f"{out.parent / 'fakebin'}:{os.environ['PATH']}")
    else:
        port = free_port()
        commands = [torchrun + ["--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                                f"--master_port={port}"] + args for node in (0, 1)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=out)
             for c in commands]
    output = "\n".join(p.communicate(timeout=300)[0] for p in procs)
    assert all(p.returncode == 0 for p in procs), output[-3000:]
    assert "Warning" not in output, output[-3000:]
    records = {rank: [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
               for rank in (0, 1)}
    saves = (out / "torch_save_calls").read_text().split() if (out / "torch_save_calls").exists() else []
    epochs = [dict(zip(("epoch", "train_loss", "test_loss", "accuracy", "correct", "total"), map(float, m.groups())))
              for m in re.finditer(r"^epoch (\d+) \| train_loss (\S+) \| test_loss (\S+) \| test_accuracy (\S+) "
                                   r"\((\d+)/(\d+)\)$", output, re.M)]
    return SimpleNamespace(output=output, records=records, saves=saves, epochs=epochs, checkpoint=out / "model.pt",
                           data_dir=data_dir, test_samples=test_samples)


def load_port(name: str):
    spec = importlib.util.spec_from_file_location(f"port_{name}", PORT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TRAIN_PY = load_port("train")


def weights(run) -> dict:
    return torch.load(run.checkpoint, weights_only=True)


# ---- the checks: each raises AssertionError when its item is missing ----
def check_shards(run, reference=None):
    for e in range(2):
        shards = [run.records[r][e]["indices"] for r in (0, 1)]
        assert sorted(shards[0] + shards[1]) == list(range(TRAIN)), f"epoch {e + 1}: shards overlap or miss images"


def check_new_order(run, reference=None):
    for r in (0, 1):
        assert run.records[r][0]["indices"] != run.records[r][1]["indices"], f"rank {r}: same order in both epochs"


def check_one_writer(run, reference=None):
    assert run.saves == ["0"], f"torch.save called by ranks {run.saves}"


def check_train_loss(run, reference=None):
    assert len(run.epochs) == 2, run.output[-2000:]
    for e, printed in enumerate(run.epochs):
        loss_sum, seen = (sum(run.records[r][e]["train"][i] for r in (0, 1)) for i in (0, 1))
        assert seen == TRAIN and printed["train_loss"] == pytest.approx(loss_sum / seen, abs=6e-5), \
            f"epoch {e + 1}: printed train loss {printed['train_loss']}, all ranks' mean {loss_sum / seen:.4f}"


def check_exact_test(run, reference=None):
    """One plain process (train.py's own evaluate) on the saved weights and the whole test set."""
    model = TRAIN_PY.Net()
    model.load_state_dict(weights(run))
    _, test_set = TRAIN_PY.load_data(SimpleNamespace(data_dir=run.data_dir, train_samples=1,
                                                     test_samples=run.test_samples))
    loss_sum, correct, total = TRAIN_PY.evaluate(model, DataLoader(test_set, batch_size=1000), torch.device("cpu"))
    last = run.epochs[-1]
    assert (last["correct"], last["total"]) == (correct, total) == (correct, run.test_samples), \
        f"test counts: printed {last}, one process {correct}/{total}"
    assert last["test_loss"] == pytest.approx(loss_sum / total, abs=1e-4), \
        f"test loss: printed {last}, one process {loss_sum / total:.4f}"


def check_replicas(run, reference=None):
    for e in range(2):
        assert run.records[0][e]["checksum"] == run.records[1][e]["checksum"], f"epoch {e + 1}: replicas differ"


def check_same_as_ddp(run, reference):
    mine, ddp = weights(run), weights(reference)
    assert mine.keys() == ddp.keys()
    for name in ddp:
        torch.testing.assert_close(mine[name], ddp[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


CHECKS = {name[len("check_"):]: f for name, f in globals().items() if name.startswith("check_")}
FAILS_WITH = {"shards": "shards overlap", "new_order": "same order", "one_writer": "torch.save called by ranks",
              "train_loss": "printed train loss", "exact_test": "printed", "replicas": "replicas differ",
              "same_as_ddp": "not close"}  # the message that says the check failed, not another error
DDP_CHECKS = ["shards", "new_order", "one_writer", "train_loss", "exact_test", "replicas"]


@pytest.fixture(scope="module")
def runs(synthetic_dir, tmp_path_factory):
    """Every torchrun launch of this file, two at a time: the two correct ports and each variant."""
    tmp = tmp_path_factory.mktemp("port")
    (tmp / "spy").mkdir()
    (tmp / "spy" / "sitecustomize.py").write_text(SAVE_SPY)
    (tmp / "fakebin").mkdir()
    for name, text in FAKE_SLURM.items():
        (tmp / "fakebin" / name).write_text(text)
        (tmp / "fakebin" / name).chmod(0o755)
    data_dir = str(Path(synthetic_dir) / "synthetic")
    jobs = {"ddp": (PORT / "train_ddp.py", "2x1", TEST_DDP), "fsdp": (PORT / "train_fsdp.py", "slurm", TEST_FSDP)}
    for name, (script, _, layout, _) in VARIANTS.items():
        jobs[name] = (variant(name, tmp), layout, TEST_FSDP if script == "train_fsdp.py" else TEST_DDP)
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(launch, script, data_dir, tmp / name, layout, test)
                   for name, (script, layout, test) in jobs.items()}
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


def changed_lines(old: str, new: str) -> int:
    """Lines of `new` that are not in `old` (added or modified), as difflib counts them."""
    a, b = ((PORT / name).read_text().splitlines() for name in (old, new))
    return sum(j2 - j1 for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
               if tag != "equal")


def test_each_port_is_a_small_diff():
    assert changed_lines("train.py", "train_ddp.py") <= 40
    assert changed_lines("train_ddp.py", "train_fsdp.py") <= 25
    assert "import common" not in (PORT / "train.py").read_text()  # a script the course did not write


def test_train_ddp_passes_every_check(runs):
    """Run as two "nodes" of one process (two torchruns, both with LOCAL_RANK 0), where local-rank sharding shows."""
    ddp = runs["ddp"]
    assert sorted(re.findall(r"\[rank (\d)/2\] training on cpu: 256 of 512 training images, (\d+) of 101",
                             ddp.output)) == [("0", "51"), ("1", "50")], ddp.output
    assert [e["total"] for e in ddp.epochs] == [TEST_DDP, TEST_DDP]  # printed by rank 0 alone, each image once
    for name in DDP_CHECKS:
        CHECKS[name](ddp)


def test_train_fsdp_through_the_sbatch_template_passes_every_check(runs):
    """slurm_submit_any.sh run by bash, with stand-ins for srun and scontrol: torchrun with a c10d rendezvous."""
    fsdp = runs["fsdp"]
    assert "== script " in fsdp.output and "== rendezvous localhost:" in fsdp.output, fsdp.output
    for name in ["shards", "new_order", "one_writer", "train_loss", "exact_test"]:
        CHECKS[name](fsdp)
    check_same_as_ddp(fsdp, runs["ddp"])  # the same training as DDP's, with rank 0's 2 test batches against rank 1's 1


@pytest.mark.parametrize("name", VARIANTS)
def test_a_port_without_an_item_fails_its_check(runs, name):
    check = VARIANTS[name][3]
    with pytest.raises(AssertionError, match=FAILS_WITH[check]):
        CHECKS[check](runs[name], runs["ddp"])


def test_the_checklist_names_each_variant_and_its_check():
    text = (ROOT / "08_your_model" / "checklist.md").read_text()
    assert all(len(line) <= 120 for line in text.splitlines())
    for name, (_, _, _, check) in VARIANTS.items():
        assert f"`{name}`" in text and f"`{check}`" in text, name
