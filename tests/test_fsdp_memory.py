"""05_multigpu_fsdp_training/fsdp_memory.py (lesson 05's model with the FSDP2 tools) and benchmarks/fsdp_gpu.py, on
CPU with gloo (issue 17).

ONE run of `fsdp_gpu.py --cpu-smoke` (the module fixture, ~55 s on two idle cores) drives almost everything: lesson 04
under torchrun with a simulated out-of-memory error, lesson 05 training the same model, and fsdp_memory.py launched
ONCE per N = 1, 2, 3 (torchrun), several configs per launch (--blocks 0 and 4, --hidden 256, 2 steps each). The
benchmark's JSON keeps every rank's own row, which is what the byte counts below are read from.
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


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-smoke")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fsdp_gpu.py"), "--cpu-smoke", "--budget-s", "500",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "fsdp_gpu.json").read_text())


def rows(result, n):
    """Every rank's rows of part b's configs (the launch's first group) in the fsdp_memory.py launch at N processes."""
    return [r for r in next(r for r in result["runs"] if r["name"] == f"sweep-N{n}")["rows"] if r["group"] == 0]


def test_smoke_measures_every_part(smoke):
    out, s = smoke
    for name in ("fsdp_gpu.md", "fsdp_memory.png", "fsdp_trace.json", "logs/a-ddp-N2-b4.log"):
        assert (out / name).stat().st_size > 0, name
    assert [r["status"] for r in s["runs"]] == ["out of memory", "ok", "ok", "ok", "ok"], s["runs"]
    a = s["a"]
    assert (a["blocks"], a["hidden"]) == (4, 256)  # the smallest --blocks with 16 B x P > 1.05 x the cap
    assert a["ddp"]["error"].startswith("error: CUDA out of memory; Tried to allocate 1.00 GiB (SIMULATED")
    assert a["ddp"]["error"].endswith("shard them with FSDP2 (lesson 05)")  # lesson 04's own one-line error
    assert a["fsdp_N2"]["status"] == "ok" and 0 <= a["fsdp_N2"]["test_accuracy"] <= 1
    assert a["predicted"]["2"]["ddp_16P"] == 16 * a["predicted"]["2"]["parameters"]
    assert {(x["world_size"], x["tools"]) for x in s["b"]} == {
        (n, t) for n in (1, 2, 3) for t in ("ddp", "fsdp", "checkpoint-activations")}
    assert [x["tools"] for x in s["c"]["tools_N2"]] == ["fsdp", "checkpoint-activations", "fsdp",
                                                        "no-reshard-after-forward", "prefetch"]
    assert [r["hidden"] for r in s["d"]["fsdp_over_ddp"]] == [64, 128]
    assert all(r["ratio"] > 0 for r in s["d"]["fsdp_over_ddp"])
    assert s["d"]["profile"]["s_per_step"] > 0 and s["d"]["profile"]["kernels"] == {}  # no GPU kernels on a CPU
    page = (out / "fsdp_gpu.md").read_text()
    assert "## a. Out of memory against fits" in page and a["ddp"]["error"] in page
    for run in s["runs"]:
        assert {"gpu", "driver", "torch", "commit"} <= run.keys()


def test_bytes_per_rank_fall_as_one_over_n(smoke):
    """Parameters and gradients split EXACTLY (to_local() shards, uneven over 3 ranks, add up to the whole tensors);
    AdamW's exp_avg and exp_avg_sq too. Only its `step` counter, one 4-byte scalar per parameter tensor, is kept
    whole on every rank: the sum over N ranks has (N - 1) x 4 x tensors bytes more."""
    _, s = smoke
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
    _, s = smoke
    for n in (1, 2, 3):
        loss = {(r["tools"], r["blocks"]): r["loss"] for r in rows(s, n) if r["rank"] == 0}
        for blocks in (0, 4):
            assert loss[("checkpoint-activations", blocks)] == pytest.approx(loss[("fsdp", blocks)], abs=1e-5)
            assert loss[("ddp", blocks)] == pytest.approx(loss[("fsdp", blocks)], abs=1e-4)  # another reduction order
    tools = {(x["group"], x["tools"]): x["loss"] for x in s["c"]["tools_N2"]}
    assert tools[(1, "checkpoint-activations")] == pytest.approx(tools[(1, "fsdp")], abs=1e-5)
    for name in ("no-reshard-after-forward", "prefetch"):
        assert tools[(2, name)] == pytest.approx(tools[(2, "fsdp")], abs=1e-5)


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
