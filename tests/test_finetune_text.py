"""Lesson 08 fine-tunes text_model.py's decoder on the course's own pages (--data text), on 2 and 4 gloo ranks: the
validation loss falls, the export checks itself (logits and greedy generate) and a fresh process's from_pretrained +
generate continues --prompt as the sharded model did; --clip-grad's norm is the norm over all shards; a stop and
--resume auto on text end as the uninterrupted run, learning-rate schedule included; bad input is one line."""
import json
import math
import re
import subprocess
import sys

import pytest

import finetune_workers
from common.launcher import launch
from lessons import INJECT, ROOT, assert_clean, metrics

pytestmark = pytest.mark.timeout(600)
SCRIPT = ROOT / "08_your_model" / "digits_lm.py"
PAGES = ["08_your_model/README.md", "08_your_model/reference.md"]  # ~9,000 tokens: ~130 blocks of 64
SMALL = ["--seq-len", 64, "--batch-size", 8, "--epochs", 2, "--lr", 1e-3, "--dtype", "float32"]
PROMPT = "Sharding a model"
FRESH = """import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = tokenizer(sys.argv[2], return_tensors="pt")
out = model.generate(**ids, max_new_tokens=16, do_sample=False)
print(repr(tokenizer.decode(out[0, ids.input_ids.shape[1]:])))
"""


def run(*args, nproc=None, env=None, cwd=ROOT):
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                                   if nproc else [])
    full_env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                **(env or {})}
    return subprocess.run([*launcher, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=300,
                          env=full_env, cwd=cwd)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("text_model") / "model"
    assert_clean(subprocess.run([sys.executable, str(ROOT / "08_your_model" / "text_model.py"), "--out", str(out)],
                                capture_output=True, text=True, timeout=300))
    return out


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "pages.txt"
    path.write_text("".join((ROOT / page).read_text(encoding="utf-8") for page in PAGES), encoding="utf-8")
    return path


def validation(stdout) -> dict[str, tuple[float, float, int]]:
    """{'before training' / 'after epoch N': (loss, perplexity, tokens)} from the lines rank 0 printed."""
    found = re.findall(r"^(.+?): validation loss ([\d.]+), perplexity ([\d.]+) \((\d+) tokens\)$", stdout, re.M)
    return {label: (float(loss), float(ppl), int(n)) for label, loss, ppl, n in found}


@pytest.mark.parametrize("nproc", [2, 4])
def test_fine_tune_on_the_pages_exports_a_folder_that_generates_the_same(nproc, model_dir, pages, tmp_path):
    export = tmp_path / "hf"
    proc = run("--data", "text", "--pretrained", model_dir, "--text", pages, *SMALL, "--export-dtype", "float32",
               "--output-dir", tmp_path / "run", "--export", export, "--prompt", PROMPT, nproc=nproc)
    assert_clean(proc)
    summary = re.findall(r"^text: 1 documents, (\d+) tokens .*-> (\d+) blocks of 64 \((\d+) train / (\d+) "
                         r"validation\)", proc.stdout, re.M)
    assert len(summary) == 1, proc.stdout  # printed once, by rank 0
    tokens, blocks, train, val = map(int, summary[0])
    assert blocks == tokens // 64 and train + val == blocks
    losses = validation(proc.stdout)
    assert list(losses) == ["before training", "after epoch 1", "after epoch 2"], proc.stdout
    for loss, perplexity, count in losses.values():
        assert count == val * 63  # every validation block's 63 next tokens, counted once over the ranks
        assert perplexity == pytest.approx(math.exp(loss), rel=1e-3)
    assert losses["after epoch 2"][0] < losses["after epoch 1"][0] < losses["before training"][0] - 0.3, losses
    check = [line for line in proc.stdout.splitlines() if line.startswith("export check:")]
    assert len(check) == 1 and "within 0.0001" in check[0] and "its greedy generate the same 16 tokens" in check[0]
    assert {"tokenizer.json", "generation_config.json", "config.json"} <= {p.name for p in export.iterdir()}
    said = re.findall(rf"^--prompt '{PROMPT}' -> greedy, (\d+) tokens: (.*)$", proc.stdout, re.M)
    assert len(said) == 1, proc.stdout
    (tmp_path / "fresh").mkdir()  # a process with no other file: only the export folder
    fresh = subprocess.run([sys.executable, "-c", FRESH, str(export), PROMPT], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path / "fresh", env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin"})
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert fresh.stdout.strip() == said[0][1]


@pytest.mark.parametrize("nproc", [2, 4])
def test_clip_grad_norm_is_the_norm_over_all_shards(nproc):
    """The global batch split over the ranks: the norm clip_gradients returns is one process's norm of the whole
    batch's gradients, and the clipped gradients are that process's clipped gradients."""
    result = launch(finetune_workers.clip_on_shards, nprocs=nproc, args=(8, 16), timeout_s=240)[0]
    assert result["norm"] > 10 * finetune_workers.MAX_NORM  # clipping happened
    assert result["norm"] == pytest.approx(result["plain_norm"], rel=1e-5)
    assert result["clipped_norm"] == pytest.approx(finetune_workers.MAX_NORM, rel=1e-4)
    assert result["grad_diff"] < 1e-7


def test_a_stop_on_text_resumes_as_the_uninterrupted_run_schedule_included(model_dir, pages, tmp_path):
    """SIGUSR1 on rank 1 at step 3 of epoch 1: the vote of step 10, read at step 20, stops both (async checkpoints,
    warm-up, cosine, clipping); --resume auto ends with the same losses and the cosine's last learning rate."""
    flags = ["--data", "text", "--pretrained", model_dir, "--text", pages, *SMALL, "--warmup-steps", 4,
             "--min-lr", 1e-4, "--clip-grad", 1, "--async-checkpoint", "--batch-size", 2]  # 31 steps an epoch
    assert_clean(run(*flags, "--output-dir", tmp_path / "whole", nproc=2))
    stopped = run(*flags, "--output-dir", tmp_path / "cut", nproc=2, env={**INJECT, "FAIL_AT_STEP": "1:3:USR1"})
    assert_clean(stopped)
    assert "stopped by SIGUSR1 at epoch 1 step 20" in stopped.stdout, stopped.stdout
    resumed = run(*flags, "--output-dir", tmp_path / "cut", "--resume", "auto", nproc=2)
    assert_clean(resumed)
    assert "continuing at epoch 1 step 20" in resumed.stdout, resumed.stdout
    whole, cut = metrics(tmp_path / "whole")["epochs"], metrics(tmp_path / "cut")["epochs"]
    assert [r["epoch"] for r in cut] == [1, 2]
    for got, want in zip(cut, whole):
        for key in ("train_loss", "test_loss", "lr"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (key, got, want)
    assert cut[-1]["lr"] == pytest.approx(1e-4)  # the schedule's end: --min-lr
    assert cut[0]["lr"] < 1e-3  # mid-way down the cosine


def bad_text(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    return path


@pytest.mark.parametrize("case", ["missing", "empty", "jsonl-without-text", "no-tokenizer", "seq-len", "short",
                                  "no-pretrained"])
def test_bad_text_input_is_one_line(case, model_dir, pages, tmp_path):
    text, folder, extra, nproc = [pages], model_dir, [], None
    if case == "missing":
        text, needle = [tmp_path / "nope.txt"], f"{tmp_path / 'nope.txt'}: no such file"
    elif case == "empty":
        text, needle = [bad_text(tmp_path, "empty.txt", "")], "empty.txt is empty"
    elif case == "jsonl-without-text":
        text = [bad_text(tmp_path, "a.jsonl", json.dumps({"body": "x"}) + "\n")]
        needle = 'a.jsonl line 1 has no string "text" field'
    elif case == "no-tokenizer":
        folder = tmp_path / "bare"
        folder.mkdir()
        for p in model_dir.iterdir():
            if not p.name.startswith("tokenizer"):
                (folder / p.name).symlink_to(p)
        needle = "has no tokenizer (tokenizer.json / tokenizer_config.json)"
    elif case == "seq-len":
        extra, needle = ["--seq-len", 257], "--seq-len 257 is above the model's max_position_embeddings (256)"
    elif case == "short":  # 4 ranks, blocks of 64: a few lines are fewer blocks than ranks
        text, nproc = [bad_text(tmp_path, "short.txt", pages.read_text()[:600])], 4
        extra, needle = ["--seq-len", 64], "fewer than one per rank (4)"
    else:
        folder, needle = None, "--data text needs --pretrained (a folder with a tokenizer)"
    proc = run("--data", "text", *(["--pretrained", folder] if folder else []), "--text", *text, *extra,
               "--output-dir", tmp_path / "out", nproc=nproc)
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stdout + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout and "Warning" not in proc.stdout + proc.stderr


def test_an_export_that_is_not_the_trained_model_names_the_first_difference(model_dir, monkeypatch):
    """generate.check_export against logits and tokens that the folder does not give: one line each, naming the
    first differing prompt position, or the first differing new token."""
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.syspath_prepend(str(ROOT / "08_your_model"))
    from common.errors import CourseError
    from generate import check_export

    ids = torch.tensor([[5, 17, 42]])
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                do_sample=False)[0, 3:].tolist()
    assert "the same 4 tokens" in check_export(model_dir, ids, logits, tokens, torch.float32, lossy=False)
    moved = logits.clone()
    moved[0, 1] += 1.0  # the second prompt position's logits, as a wrong export would give them
    with pytest.raises(CourseError, match="first at prompt position 1: the export is not the trained model"):
        check_export(model_dir, ids, moved, tokens, torch.float32, lossy=False)
    other = tokens[:2] + [(tokens[2] + 1) % model.config.vocab_size] + tokens[3:]
    with pytest.raises(CourseError, match=r"greedy generate differs from the sharded model's at new token 2 "):
        check_export(model_dir, ids, logits, other, torch.float32, lossy=False)
