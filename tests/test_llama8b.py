"""The 8 B benchmark's scripts on a tiny Llama (benchmarks/llama3_tiny.json: hidden 64, 2 layers) and 2 gloo ranks:
llama_folder.py's random folder is what from_pretrained loads, load_ways.py's four ways give one model, export_8b.py's
export of a trained model is that model, llama8b_train.py trains lesson 08's class and refuses a sequence longer
than the config's positions. The GPU run sheet: benchmarks/llama8b_plan.md."""
import json
import os
import subprocess
import sys

import pytest
import torch

from lessons import ROOT

TINY = ROOT / "benchmarks" / "llama3_tiny.json"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def row_of(command, timeout=300) -> dict:
    """Run it; exit 0, no warning, and its one JSON row."""
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Warning" not in out, out[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"what"')]
    assert len(rows) == 1, proc.stdout[-3000:]
    return rows[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama8b") / "tiny"
    row = row_of([sys.executable, "benchmarks/llama_folder.py", "--config", str(TINY), "--out", str(out),
                  "--shard-mb", "0.05", "--tokenizer-vocab", "512"])
    return out, row


def test_folder_is_what_from_pretrained_loads(folder):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    out, row = folder
    with torch.device("meta"):
        twin = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY))
    parameters = sum(p.numel() for p in twin.parameters())
    assert row["parameters"] == parameters and row["bytes"] == 2 * parameters  # bf16, untied lm_head stored
    stored = {}
    for file in sorted(out.glob("*.safetensors")):
        stored.update(load_file(file))
    assert row["files"] == len(list(out.glob("*.safetensors"))) > 2 and row["tensors"] == len(stored) == 21
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and model.config.rope_parameters["rope_theta"] == 500000.0
    for name, tensor in model.state_dict().items():  # every tensor as written
        assert torch.equal(tensor, stored[name]), name
    assert torch.equal(stored["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert 0.015 < stored["model.embed_tokens.weight"].float().std() < 0.025  # normal(0, initializer_range 0.02)
    assert len(AutoTokenizer.from_pretrained(out)) == row["tokenizer_vocab"] == 512


def test_the_four_ways_load_one_model(folder, tmp_path):
    out, _ = folder
    rows = [row_of([*TORCHRUN, "benchmarks/load_ways.py", "--folder", str(out), "--way", way, "--out", str(tmp_path),
                    "--device", "cpu"]) for way in "abcd"]
    for i, row in enumerate(rows):  # each way against the ways before it: the same logits
        assert row["ranks"] == 2 and len(row["peak_rss_gib_per_rank"]) == 2 and row["load_s"] > 0
        assert sorted(row["logits_max_abs_diff"]) == list("abcd"[:i]), row
        assert all(diff < 1e-5 for diff in row["logits_max_abs_diff"].values()), row
        assert row["parameters"] == rows[0]["parameters"] and row["logits_abs_max"] > 0


def test_export_of_a_trained_model_is_that_model(folder, tmp_path):
    from safetensors.torch import load_file
    out, _ = folder
    export = tmp_path / "export"
    row = row_of([*TORCHRUN, "benchmarks/export_8b.py", "--folder", str(out), "--out", str(export), "--seq", "32",
                  "--steps", "2", "--device", "cpu"])
    assert row["same_model"] and row["tolerance"] == 1e-4 and row["steps"] == 2, row
    assert row["files"] == 4  # the embeddings, one per decoder layer, the rest (hf_export.file_of_each)
    before = load_file(out / "model-00001-of-00009.safetensors")["model.embed_tokens.weight"]
    after = load_file(export / "model-00001-of-00004.safetensors")["model.embed_tokens.weight"]
    assert not torch.equal(before, after)  # the steps moved it: the export is not the folder read


def test_train_row_and_a_sequence_past_the_positions():
    row = row_of([*TORCHRUN, "benchmarks/llama8b_train.py", "--config", str(TINY), "--seq", "32", "--batch", "2",
                  "--ac", "--warmup", "1", "--steps", "2", "--device", "cpu"])
    assert row["outcome"] == "trained" and row["strategy"] == "fsdp2-ac" and len(row["losses"]) == 3
    assert abs(row["tokens_per_s"] * row["step_s"] - 2 * 32) < 1e-6 * 64
    proc = subprocess.run([sys.executable, "benchmarks/llama8b_train.py", "--config", str(TINY), "--seq", "128"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "longer than the config's max_position_embeddings 64: lower --seq"), proc.stderr[-2000:]
