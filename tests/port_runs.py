"""tests/test_port.py's runs: how a port of 08_your_model/port, or a variant of it with one checklist item removed
(VARIANTS), is launched (launch: torchrun on one "node" or two, the sbatch template with stand-ins for srun and
scontrol, or plain python), and the inputs that expose a missing item: a file saved on a GPU, test labels that
split the ranks, a BatchNorm classifier's gradients under DDP. What a run must show: tests/port_checks.py.
"""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from common.distributed import free_port
from lessons import ROOT

PORT = ROOT / "08_your_model" / "port"
TRAIN = 512  # training images: 256 per rank, 8 steps of 32
TEST_DDP, TEST_FSDP = 101, 2001  # odd: the ranks get 51 and 50; 1001 and 1000, i.e. 2 test batches and 1
FLAGS = ["--epochs", "2", "--batch-size", "32", "--train-samples", str(TRAIN), "--device", "cpu", "--cosine"]
FROM_FILE = [*FLAGS, "--init-from", "../init.pt"]  # each run's folder is its working directory
SPY = """import os
if os.environ.get("PORT_DEBUG_DIR") and "RANK" in os.environ:  # torchrun's workers only
    import torch, torch.distributed
    def _spy(module, name, log):
        real = getattr(module, name)
        def spy(*args, **kwargs):
            with open(os.path.join(os.environ["PORT_DEBUG_DIR"], log), "a") as f:
                f.write(os.environ["RANK"] + "\\n")
            return real(*args, **kwargs)
        setattr(module, name, spy)
    _spy(torch, "save", "torch_save_calls")
    _spy(torch.distributed, "destroy_process_group", "destroy_calls")
"""
FAKE_SLURM = {  # stand-ins that let bash run the sbatch template on this machine, as one node
    "srun": '#!/bin/bash\nwhile [[ $1 == -* ]]; do shift; done  # its options; then the command, once\nexec "$@"\n',
    "scontrol": '#!/bin/bash\n[ "$2" != hostnames ] || echo localhost\n',
}
INIT = ('dist.init_process_group("nccl" if device.type == "cuda" else "gloo",', "device_id=device if device.type")
DDP_LINE = 'model = DDP(net, device_ids=[local_rank] if device.type == "cuda" else None)'
OWN_LOSS = [("        sums = torch.tensor(", "        own_loss = test_loss / total  # this rank's shard only\n"
             "        sums = torch.tensor("), ("if test_loss / total < best:", "if own_loss < best:"),
            ("best = test_loss / total", "best = own_loss")]

# Each variant: a checklist item removed from a port. (script, [(text, replacement, or None to delete its line)],
# the layout it runs in, and the check it must fail.)
VARIANTS = {
    "no_init_process_group": ("train_ddp.py", [(INIT[0], None), (INIT[1], None)], "1x2", "finishes"),
    "rank_and_size_of_the_node": ("train_ddp.py", [("dist.get_rank(), dist.get_world_size()  #",
                                                    'local_rank, int(os.environ["LOCAL_WORLD_SIZE"])  #')],
                                  "2x1", "shards"),
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
    "no_ddp_wrap": ("train_ddp.py", [(DDP_LINE, "model = net"),
                                     ("model.module.state_dict()", "model.state_dict()")], "1x2", "replicas"),
    "saves_the_wrapper": ("train_ddp.py", [("model.module.state_dict()", "model.state_dict()")], "1x2",
                          "plain_keys"),
    "best_by_own_shard": ("train_ddp.py", OWN_LOSS, "1x2", "finishes"),  # on test labels that rank 1 gets wrong
    "seed_per_rank_ddp": ("train_ddp.py", [("torch.manual_seed(args.seed)",
                                            'torch.manual_seed(args.seed + int(os.environ["RANK"]))'),
                                           ("seed=args.seed)", "seed=args.seed + rank)")], "1x2", "shards"),
    "no_destroy_process_group": ("train_ddp.py", [("dist.destroy_process_group()", None)], "1x2", "leaves_group"),
    "no_map_location": ("train_ddp.py", [("map_location=device, ", "")], "1x2", "finishes"),  # a file saved on a GPU
    "loads_on_rank_0_after_the_wrap": ("train_ddp.py", [("    if args.init_from:  # every rank, into the Net", None),
                                                         ("net.load_state_dict(", None), (DDP_LINE, DDP_LINE + (
        "\n    if args.init_from and rank == 0:\n        model.module.load_state_dict("
        "torch.load(args.init_from, map_location=device, weights_only=True))"))], "1x2", "starts_from"),
    "loads_on_rank_0": ("train_fsdp.py", [("if args.init_from:  # every rank", "if args.init_from and rank == 0:  #")],
                        "1x2", "starts_from"),
    "schedule_of_one_process": ("train_ddp.py", [("steps = args.epochs * len(train_loader)",
                                                  "steps = args.epochs * -(-len(train_set) // args.batch_size)")],
                                "1x2", "schedule_ends"),
    "seed_per_rank": ("train_fsdp.py", [("torch.manual_seed(args.seed)",
                                         'torch.manual_seed(args.seed + int(os.environ["RANK"]))')],
                      "1x2", "same_as_ddp"),
}
LOADING = {"no_map_location", "loads_on_rank_0_after_the_wrap", "loads_on_rank_0"}  # run with FROM_FILE


def saved_on_a_gpu(path: Path) -> None:
    """A Net's weights (seed 7: not the ports' --seed) in a file that says its tensors were on cuda:0, as one saved
    on a GPU: torch.load puts them back there unless given map_location."""
    torch.manual_seed(7)
    state = TRAIN_PY.Net().state_dict()
    real, torch.serialization.location_tag = torch.serialization.location_tag, lambda storage: "cuda:0"
    try:
        torch.save(state, path)
    finally:
        torch.serialization.location_tag = real


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


def launch(script: Path, data_dir: str, out: Path, layout: str = "1x2", test_samples: int = TEST_DDP,
           flags=FLAGS, deadline_s: float = 300):
    """Run `script` as NODESxPROCS: 1x2 is torchrun --standalone with 2 processes; 2x1 is two torchruns of one process
    each on this machine, as two nodes (every LOCAL_RANK is 0); slurm is 08_your_model/slurm_submit_any.sh run by
    bash as a one-node job of 2 processes; 1 is plain python. A run past `deadline_s` is stopped (a hang). Returns
    what the run printed, recorded and saved."""
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PORT_DEBUG_DIR": str(out),
           "PYTHONPATH": str(out.parent / "spy")}
    args = [str(script), "--data-dir", data_dir, "--test-samples", str(test_samples),
            "--checkpoint", str(out / "model.pt"), *flags]
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if layout == "1":
        commands = [[sys.executable] + args]
    elif layout == "1x2":
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
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=out,
                              start_new_session=True) for c in commands]
    outputs, hung = [], False
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=deadline_s)[0])
        except subprocess.TimeoutExpired:
            hung = True
            for q in procs:  # SIGTERM: torchrun stops its workers (each in a session of its own) before it exits
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGTERM)
            outputs.append(p.communicate(timeout=60)[0])
    output = "\n".join(outputs)
    ranks = (0,) if layout == "1" else (0, 1)
    lines = {r: [json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()]
             if (out / f"rank{r}.jsonl").exists() else [] for r in ranks}
    records = {r: [x for x in lines[r] if x["epoch"] > 0] for r in ranks}  # epoch 0: the weights it starts from
    calls = {log: (out / log).read_text().split() if (out / log).exists() else []
             for log in ("torch_save_calls", "destroy_calls")}
    epochs = [dict(zip(("epoch", "train_loss", "test_loss", "accuracy", "correct", "total"), map(float, m.groups())))
              for m in re.finditer(r"^epoch (\d+) \| train_loss (\S+) \| test_loss (\S+) \| test_accuracy (\S+) "
                                   r"\((\d+)/(\d+)\)$", output, re.M)]
    saved = [int(e) for e in re.findall(r"^saved \S+ \(epoch (\d+)\)$", output, re.M)]
    return SimpleNamespace(output=output, records=records, saves=calls["torch_save_calls"], saved_epochs=saved,
                           destroys=calls["destroy_calls"], epochs=epochs, checkpoint=out / "model.pt",
                           data_dir=data_dir, test_samples=test_samples, hung=hung,
                           starts={r: [x["checksum"] for x in lines[r] if x["epoch"] == 0] for r in ranks},
                           init_from=out / flags[flags.index("--init-from") + 1] if "--init-from" in flags else None,
                           returncodes=[p.returncode for p in procs])


def load_port(name: str):
    spec = importlib.util.spec_from_file_location(f"port_{name}", PORT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TRAIN_PY = load_port("train")


def wrong_half_of_the_test_labels(data_dir: str, folder: Path) -> str:
    """A copy of `data_dir` whose odd test images (rank 1's shard) carry the next class's label: as training goes on,
    rank 1's own test loss rises while rank 0's falls, so a branch each rank decides alone splits them."""
    raw = folder / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for f in (Path(data_dir) / "MNIST" / "raw").iterdir():
        data = bytearray(f.read_bytes())
        if f.name == "t10k-labels-idx1-ubyte":
            data[9::2] = bytes((label + 1) % 10 for label in data[9::2])  # after the 8-byte header
        (raw / f.name).write_bytes(bytes(data))
    return str(folder)


def small_bn_net(batchnorm: bool) -> torch.nn.Module:
    """A small classifier with a BatchNorm layer, or a GroupNorm (each example normalized alone) in its place, the
    same weights every time."""
    nn = torch.nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8) if batchnorm else nn.GroupNorm(2, 8), nn.ReLU(),
                         nn.Linear(8, 3))


def ddp_grads(state, batchnorm, data, target):
    """A rank's gradients after DDP's backward on its half of the batch; with BatchNorm, also DDP's refusal of the
    SyncBatchNorm version on a CPU."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = small_bn_net(batchnorm)
    model.load_state_dict(state)
    shard = slice(rank * len(data) // world_size, (rank + 1) * len(data) // world_size)
    ddp = DDP(model)  # kept alive: its reducer all-reduces the gradients during backward
    torch.nn.functional.cross_entropy(ddp(data[shard]), target[shard]).backward()
    refused = None
    if batchnorm:
        try:
            DDP(torch.nn.SyncBatchNorm.convert_sync_batchnorm(small_bn_net(True)))
        except ValueError as e:
            refused = str(e)
    dist.destroy_process_group()
    return [p.grad.clone() for p in model.parameters()], refused
