"""05_multigpu_fsdp_training/fsdp_memory.py (lesson 05's model with the FSDP2 tools) on CPU with gloo.

ONE launch of `fsdp_memory.py --sweep` per N = 1, 2, 3 (torchrun, the module fixture) measures several configs each
(--blocks 0 and 4, --hidden 256, 2 steps): every rank prints its own row, which the byte counts below are read from.
Lesson 04's simulated out-of-memory line is checked in tests/test_bench.py (the `fsdp_oom` suite's quick mode).
"""
import importlib.util
import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch

from common.errors import CourseError
from lessons import ROOT

MEMORY = ROOT / "05_multigpu_fsdp_training" / "fsdp_memory.py"


SWEEP = ("blocks=0,4;hidden=256;steps=2;tools=ddp,fsdp,checkpoint-activations"
         "|blocks=4;hidden=256;steps=2;tools=fsdp,no-reshard-after-forward,prefetch")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """{N: every rank's rows} of one torchrun launch of the sweep per N."""
    found, trace = {}, tmp_path_factory.mktemp("fsdp-trace") / "trace.json"
    for n in (1, 2, 3):
        profile = ["--profile", str(trace)] if n == 2 else []  # the last config's last 3 steps, traced by rank 0
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                               str(MEMORY), "--device", "cpu", "--batch-size", "8", "--sweep", SWEEP, *profile],
                              capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "Warning" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
        found[n] = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert json.loads(trace.read_text())["traceEvents"], "the --profile trace holds no event"
    return found


def rows(result, n, group=0):
    """Every rank's rows of one group of configs (the sweep's `|` parts) in the launch of N processes."""
    return [r for r in result[n] if r["group"] == group]


def test_bytes_per_rank_fall_as_one_over_n(smoke):
    """Parameters and gradients split EXACTLY (to_local() shards, uneven over 3 ranks, add up to the whole tensors);
    AdamW's exp_avg and exp_avg_sq too. Only its `step` counter, one 4-byte scalar per parameter tensor, is kept
    whole on every rank: the sum over N ranks has (N - 1) x 4 x tensors bytes more."""
    s = smoke
    one = {(r["tools"], r["blocks"]): r for r in rows(s, 1)}
    for n in (2, 3):
        for (tools, blocks), whole in one.items():
            ranks = [r for r in rows(s, n) if (r["tools"], r["blocks"]) == (tools, blocks)]
            assert len(ranks) == n and all(r["status"] == "ok" for r in ranks)
            tensors = 2 * (4 + blocks)  # a weight and a bias each: conv1, conv2, fc1, fc2 and the blocks
            if tools == "ddp":  # every rank a full replica
                assert all(r["held_bytes"] == whole["held_bytes"] for r in ranks)
                continue
            for key in ("param_bytes", "grad_bytes"):
                assert sum(r[key] for r in ranks) == whole[key], (tools, blocks, n, key)
            assert sum(r["optim_bytes"] for r in ranks) == whole["optim_bytes"] + (n - 1) * 4 * tensors
            assert max(r["held_bytes"] for r in ranks) <= 1.1 * whole["held_bytes"] / n, (tools, blocks, n)
        assert one[("fsdp", 4)]["held_bytes"] == one[("ddp", 4)]["held_bytes"]  # one rank: the same model, all of it


def test_tools_change_memory_and_time_not_the_maths(smoke):
    """Same data, same init: the tools give the plain FSDP run's loss after the steps (to 1e-5)."""
    s = smoke
    for n in (1, 2, 3):
        loss = {(r["tools"], r["blocks"]): r["loss"] for r in rows(s, n) if r["rank"] == 0}
        for blocks in (0, 4):
            assert loss[("checkpoint-activations", blocks)] == pytest.approx(loss[("fsdp", blocks)], abs=1e-5)
            assert loss[("ddp", blocks)] == pytest.approx(loss[("fsdp", blocks)], abs=1e-4)  # another reduction order
    tools = {r["tools"]: r["loss"] for r in rows(s, 2, group=1) if r["rank"] == 0}
    for name in ("no-reshard-after-forward", "prefetch"):
        assert tools[name] == pytest.approx(tools["fsdp"], abs=1e-5)


def test_tool_flags_run_for_two_steps():
    """The flags themselves (the sweep sets the same switches), one process: a world of one."""
    proc = subprocess.run([sys.executable, str(MEMORY), "--device", "cpu", "--steps", "2", "--batch-size", "8",
                           "--blocks", "2", "--hidden", "64", "--checkpoint-activations", "--no-reshard-after-forward",
                           "--prefetch"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    row = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert row["tools"] == "checkpoint-activations+no-reshard-after-forward+prefetch" and row["status"] == "ok"
    assert row["held_bytes"] == 16 * row["parameters"] + 4 * 2 * (4 + 2)  # 4 + 4 + 8 B per parameter, + the steps


def test_wrong_combinations_are_one_line_errors():
    spec = importlib.util.spec_from_file_location("fsdp_memory", MEMORY)
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)
    flags = {t.replace("-", "_"): False for t in memory.TOOLS}
    with pytest.raises(CourseError, match="it needs GPUs"):  # CPUOffloadPolicy on CPU: see check()
        memory.check(Namespace(**{**flags, "cpu_offload": True}), torch.device("cpu"))
    with pytest.raises(CourseError, match="are FSDP tools"):
        memory.check(Namespace(**{**flags, "ddp": True, "prefetch": True}), torch.device("cpu"))
    args = Namespace(sweep="blocks=0,2;tools=fsdp,ddp+checkpoint-activations|width=2", **flags)
    assert [(c.group, getattr(c, "blocks", None), c.ddp, c.checkpoint_activations) for c in memory.configs(args)] == [
        (0, 0, False, False), (0, 0, True, True), (0, 2, False, False), (0, 2, True, True), (1, None, False, False)]
    for wrong in ("blocks=1;colour=red", "tools=fsdp+zero3"):
        with pytest.raises(CourseError, match="--sweep: unknown"):
            memory.configs(Namespace(sweep=wrong, **flags))
