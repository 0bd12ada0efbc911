"""Lesson 08's Hugging Face Llama that draws digits (08_your_model/digits_lm.py), for real on CPU with gloo: trained
on 2 ranks, its DCP checkpoint resumed on 1, its export reloaded by from_pretrained in a fresh process, the model
built on the meta device and initialised as one process would. Nothing reaches the Hugging Face Hub."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.launcher import launch
from lessons import assert_clean, metrics

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "08_your_model" / "digits_lm.py"
OFFLINE = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LEARNS = ("trained to draw MNIST digits, p(pixels | digit), whatever it learned before: its token ids 0-15 become "
          "16 gray levels, 16-25 the digit classes")
TRAIN, TEST = 192, 51  # 51 test images in batches of 25: 2 on rank 0 (26 images), 1 and an empty forward on rank 1


def run(*args, nproc: int | None = 2, timeout: int = 180):
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                                   if nproc else [])
    return subprocess.run(launcher + [str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **OFFLINE}, cwd=ROOT)


@pytest.fixture(scope="module")
def small(synthetic_dir):
    return ["--data", "synthetic", "--data-dir", synthetic_dir, "--train-samples", TRAIN, "--test-samples", TEST,
            "--batch-size", 16, "--test-batch-size", 25]


@pytest.fixture(scope="module")
def trained(small, tmp_path_factory):
    """2 ranks, float32, 2 epochs, exported and drawn."""
    out = tmp_path_factory.mktemp("digits_lm")
    proc = run(*small, "--dtype", "float32", "--epochs", 2, "--lr", 0.01, "--output-dir", out / "run",
               "--export", out / "hf", "--export-dtype", "float32", "--draw")
    assert_clean(proc)
    return proc, out


def test_two_ranks_learn_and_count_every_test_pixel_once(trained):
    proc, out = trained
    rows = metrics(out / "run")["epochs"]
    assert [r["epoch"] for r in rows] == [1, 2], proc.stdout
    assert rows[1]["train_loss"] < rows[0]["train_loss"] and rows[1]["test_loss"] < rows[0]["test_loss"], rows
    assert rows[0]["train_loss"] < 2.8, rows  # below log(16) = 2.77 per pixel: it learns in the first epoch
    assert all(r["test_samples"] == TEST * 196 for r in rows), rows  # all_reduce of sums: exact over ranks
    assert f"/{TEST * 196}) |" in proc.stdout
    checkpoint = out / "run" / "checkpoints" / "ckpt-e0002-s0000000"
    assert sorted(p.name for p in checkpoint.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (out / "run" / "digits.png").stat().st_size > 1000


def test_two_rank_checkpoint_resumes_on_one_rank(trained, small):
    _, out = trained
    checkpoint = out / "run" / "checkpoints" / "ckpt-e0002-s0000000"
    proc = run(*small, "--dtype", "float32", "--epochs", 3, "--lr", 0.01, "--resume", checkpoint,
               "--output-dir", out / "on-1-rank", nproc=1)
    assert_clean(proc)
    assert f"resume: from {checkpoint}, continuing at epoch 3 step 0" in proc.stdout
    before, after = metrics(out / "run")["epochs"], metrics(out / "on-1-rank")["epochs"]
    assert [r["epoch"] for r in after] == [1, 2, 3] and after[:2] == before, proc.stdout  # its history travels
    assert after[2]["test_samples"] == TEST * 196 and after[2]["test_loss"] < before[0]["test_loss"], after


def test_one_rank_loads_exactly_the_two_ranks_weights(trained, small):
    """Nothing left to train (--epochs 2): the 1-rank run only loads, reshards and exports, the 2-rank run's model."""
    from safetensors.torch import load_file
    _, out = trained
    proc = run(*small, "--dtype", "float32", "--epochs", 2, "--resume", out / "run" / "checkpoints" /
               "ckpt-e0002-s0000000", "--output-dir", out / "load-1", "--export", out / "hf-1",
               "--export-dtype", "float32", nproc=1)
    assert_clean(proc)
    assert "nothing to train" in proc.stdout and "epoch 3 |" not in proc.stdout
    one, two = ({k: v for f in sorted((out / name).glob("*.safetensors")) for k, v in load_file(f).items()}
                for name in ("hf-1", "hf"))
    assert one.keys() == two.keys() and all(one[k].equal(two[k]) for k in two)


RELOAD = """
import json, sys, torch
from transformers import LlamaForCausalLM
export, check = sys.argv[1], torch.load(sys.argv[2], weights_only=True)
model = LlamaForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
assert not torch.distributed.is_initialized()
assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again by from_pretrained
print("stored", sorted(json.load(open(f"{export}/model.safetensors.index.json"))["weight_map"]))
with torch.no_grad():
    logits = model(input_ids=check["input_ids"]).logits
print("dtype", check["dtype"], "max_difference", (logits - check["logits"]).abs().max().item())
"""


def test_export_reloads_in_a_fresh_process_with_the_same_logits(trained):
    """from_pretrained in a plain python (no process group, offline) gives the sharded model's float32 logits."""
    _, out = trained
    proc = subprocess.run([sys.executable, "-c", RELOAD, str(out / "hf"), str(out / "run" / "export_check.pt")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **OFFLINE}, cwd=ROOT)
    assert_clean(proc)
    assert "'lm_head.weight'" not in proc.stdout and "'model.embed_tokens.weight'" in proc.stdout  # stored once
    words = proc.stdout.split()
    assert words[words.index("dtype") + 1] == "float32"
    assert float(words[words.index("max_difference") + 1]) < 1e-5, proc.stdout


def test_bfloat16_runs_and_exports_bfloat16_files(small, tmp_path):
    """--export-dtype's default: bf16 files, one per decoder layer plus the first and the last, and a config.json."""
    import json
    from safetensors.torch import load_file
    proc = run(*small, "--dtype", "bfloat16", "--epochs", 1, "--max-steps", 3, "--output-dir", tmp_path,
               "--export", tmp_path / "hf")
    assert_clean(proc)
    assert "bfloat16 compute" in proc.stdout and "epoch 1 | train_loss" in proc.stdout
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert [f.name for f in files] == [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]
    assert {t.dtype for f in files for t in load_file(f).values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("content", [None, "{not json"])
def test_a_bad_model_config_is_one_line(tmp_path, content):
    config = tmp_path / "config.json"
    if content is not None:
        config.write_text(content)
    proc = run("--model-config", config, "--output-dir", tmp_path / "run", nproc=None)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith(f"error: --model-config {config}")


def meta_and_init_worker():
    """Rank r of 2: the script's build_model leaves every parameter a meta DTensor, sharded; after to_empty and
    init_weights, the gathered model equals one process's `to_empty` + `torch.manual_seed(1)` + `init_weights()`."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    spec = importlib.util.spec_from_file_location("digits_lm", SCRIPT)
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)
    dist.init_process_group("gloo")
    config = lm.read_config(ROOT / "08_your_model" / "configs" / "digits_lm.json", "--model-config")
    model = lm.build_model(config, init_device_mesh("cpu", (2,)), torch.float32)
    params = list(model.parameters())
    on_meta = all(p.is_meta and p.to_local().is_meta for p in params)
    local = sum(p.to_local().numel() for p in params)
    model.to_empty(device="cpu")
    lm.init_weights(model, config, seed=1)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.to_empty(device="cpu")
    torch.manual_seed(1)
    plain.init_weights()
    expected = plain.state_dict()
    weight = full["model.layers.0.mlp.up_proj.weight"]
    return {"on_meta": on_meta, "local": local, "total": sum(p.numel() for p in params),
            "keys": sorted(full) == sorted(expected), "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "difference": max((full[k] - expected[k]).abs().max().item() for k in expected),
            "std": weight.std().item(), "halves_differ": not torch.equal(weight[:128], weight[128:]),
            "rotary": torch.equal(model.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)}


def test_built_on_meta_and_initialised_as_one_process_would():
    results = launch(meta_and_init_worker, nprocs=2, timeout_s=120)
    for r in results:
        assert r["on_meta"] and r["keys"] and r["tied"] and r["rotary"], r
        assert r["difference"] == 0.0, r  # bit for bit: the same model on any number of ranks
        assert r["std"] == pytest.approx(0.02, rel=0.1) and r["halves_differ"], r  # not garbage, not repeated
    assert results[0]["local"] + results[1]["local"] == results[0]["total"], results  # each rank holds its half


def test_fine_tuning_from_the_export_starts_at_the_exported_models_loss(trained, small, tmp_path):
    """The lesson's flow: train, export (float32), then --pretrained the export: before its first step the model
    scores the trained run's last test loss, and its first epoch trains below a fresh model's first epoch."""
    _, out = trained
    proc = run(*small, "--dtype", "float32", "--epochs", 1, "--lr", 0.01, "--pretrained", out / "hf",
               "--output-dir", tmp_path)
    assert_clean(proc)
    read = "each rank read its own rows of 29 tensors from 5 safetensors files"
    assert f"pretrained: {out / 'hf'}: {read}" in proc.stdout
    assert f"--pretrained {out / 'hf'}: {LEARNS}" in proc.stdout.splitlines(), proc.stdout  # all 26 ids: no count
    before = next(line for line in proc.stdout.splitlines() if line.startswith("before training | test_loss "))
    trained_rows, continued = metrics(out / "run")["epochs"], metrics(tmp_path)["epochs"]
    assert float(before.split()[4]) == pytest.approx(trained_rows[-1]["test_loss"], abs=1e-4), before
    assert continued[0]["train_loss"] < trained_rows[0]["train_loss"] - 0.1, (continued, trained_rows)


def test_a_text_models_vocabulary_is_said_to_become_pixels_before_training(synthetic_dir, tmp_path):
    """A Qwen2 text model (its vocabulary of 151,936 ids, tiny otherwise) passed as --pretrained: before its first
    step, one line says that it will learn MNIST and what its first 26 token ids will mean."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    Qwen2ForCausalLM(Qwen2Config(vocab_size=151936, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=32, tie_word_embeddings=True)
                     ).save_pretrained(tmp_path / "qwen2")
    proc = run("--data", "synthetic", "--data-dir", synthetic_dir, "--train-samples", 8, "--test-samples", 2,
               "--batch-size", 2, "--test-batch-size", 1, "--dtype", "float32", "--dry-run", "--pretrained",
               tmp_path / "qwen2", "--output-dir", tmp_path / "run", nproc=None)
    assert_clean(proc)
    lines = proc.stdout.splitlines()
    said = f"--pretrained {tmp_path / 'qwen2'}: {LEARNS}; it uses 26 of its 151,936 token ids"
    assert said in lines and lines.index(said) < lines.index(next(l for l in lines if l.startswith("before training")))


def test_activation_checkpointing_and_compile_train_the_same_model(small, tmp_path):
    """--ac recomputes each layer in backward: the same float32 losses; --compile (aot_eager: quick to compile) too."""
    runs = {}
    for name, flags in {"plain": [], "ac": ["--ac"], "compiled": ["--ac", "--compile", "aot_eager"]}.items():
        proc = run(*small, "--dtype", "float32", "--epochs", 1, "--max-steps", 3, "--output-dir", tmp_path / name,
                   *flags)
        assert_clean(proc)
        assert " tokens/s" in proc.stdout.split("epoch 1 |")[1].splitlines()[0], proc.stdout
        runs[name] = metrics(tmp_path / name)["epochs"][0]
    assert runs["ac"]["train_loss"] == pytest.approx(runs["plain"]["train_loss"], abs=1e-6), runs
    assert runs["compiled"]["test_loss"] == pytest.approx(runs["plain"]["test_loss"], abs=1e-4), runs
