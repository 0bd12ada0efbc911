"""08_your_model/will_it_fit.py: the shipped configs' parameters, verdicts, bad input, and the estimate against a
measured step (08_your_model/measure_memory.py: FSDPMemTracker on 2 gloo ranks, on the CPU).

The verdicts are chosen to hold whatever the allowance for the CUDA context and the allocator (CONTEXT_BYTES and
RESERVED_OVER_ALLOCATED, measured on H100s) and the activation formula's last bytes: each "does not fit" exceeds
the GPU with the weights, gradients and AdamW state alone (plus, for 70 B under fsdp2 on 32 GPUs, its activations
alone), and each "fits" leaves a quarter of the GPU free after the tensors and the context.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from lessons import ROOT

LESSON = ROOT / "08_your_model"
CONFIGS = LESSON / "configs"
GIB = 2 ** 30


@pytest.fixture(scope="module")
def fit():
    """will_it_fit as a module; its meta-device count memoised, so that each config is built once."""
    spec = importlib.util.spec_from_file_location("will_it_fit", LESSON / "will_it_fit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    counted, count = {}, module.count

    def memo(config):
        key = config.to_json_string()
        if key not in counted:
            counted[key] = count(config)
        return counted[key]
    module.count = memo
    return module


@pytest.mark.parametrize("name, parameters, billions", [("llama3_8b", 8_030_261_248, "8.03"),
                                                        ("llama3_70b", 70_553_706_496, "70.55"),
                                                        ("qwen2_7b", 7_615_616_512, "7.62")])  # q/k/v biases
def test_shipped_configs_have_the_published_parameter_counts(fit, name, parameters, billions):
    shapes, _ = fit.count(fit.load_config(CONFIGS / f"{name}.json"))
    found = sum(fit.math.prod(shape) for shape in shapes.values())
    print(f"{name}: {found:,} parameters ({found / 1e9:.2f} B)")
    assert found == parameters and f"{found / 1e9:.2f}" == billions


VERDICTS = [  # config, GPUs, strategy, sequence length, fits, what decides it
    ("llama3_8b", 1, "ddp", 4096, False, "state"),  # 16 B x 8.03 B = 120 GiB on the one GPU
    ("llama3_8b", 8, "fsdp2", 4096, True, None),
    ("llama3_70b", 8, "fsdp2", 8192, False, "state"),  # 12 B x 70.6 B / 8 = 99 GiB before any activation
    ("llama3_70b", 8, "fsdp2-ac", 8192, False, "state"),  # checkpointing cannot shrink the state: more GPUs can
    ("llama3_70b", 32, "fsdp2", 8192, False, "activations"),  # 80 layers x 388 KiB x 8192 tokens, on every GPU
    ("llama3_70b", 32, "fsdp2-ac", 8192, True, None),
]


@pytest.mark.parametrize("name, gpus, strategy, seq, fits, decided_by", VERDICTS)
def test_verdicts(fit, capsys, name, gpus, strategy, seq, fits, decided_by):
    result = fit.main([str(CONFIGS / f"{name}.json"), "--gpus", str(gpus), "--gpu-memory", "80",
                       "--strategy", strategy, "--seq-len", str(seq)])
    out = capsys.readouterr().out
    verdict = out.splitlines()[-1]
    print(out)
    assert result["verdict"] == ("fits" if fits else "does not fit") and verdict.startswith(result["verdict"]), out
    part = result["bytes"]
    if decided_by == "state":
        assert part["parameters"] + part["gradients"] + part["optimizer"] > 80 * GIB
    elif decided_by == "activations":
        assert part["activations"] > 80 * GIB
    else:
        assert result["tight_line"] < 0.75 * 80 * GIB
    if (name, gpus, strategy) == ("llama3_70b", 8, "fsdp2"):
        assert verdict.endswith("try --strategy fsdp2-ac --gpus 32 (68.8 GiB)"), verdict
    if (name, gpus, strategy) == ("llama3_8b", 1, "ddp"):
        assert "try --strategy fsdp2 --gpus 4" in verdict


@pytest.mark.parametrize("gib, said", [(60, "fits"), (50, "tight"), (45, "does not fit")])
def test_three_verdicts_at_the_allowances_lines(fit, gib, said):
    """Llama-3-8B, fsdp2 on 8 GPUs, batch 1 x 4096: 43.7 GiB of tensors; "tight" from 45.3 GiB (+ the context),
    "fits" from 58.8 GiB (x the allocator's measured share, + the context)."""
    config = fit.load_config(CONFIGS / "llama3_8b.json")
    result = fit.price(config, "fsdp2", 8, 1, 4096, gpu_memory_gib=gib)
    assert result.tight_line == result.tensors + fit.CONTEXT_BYTES
    assert result.fits_line == result.tensors * fit.RESERVED_OVER_ALLOCATED["fsdp2"] + fit.CONTEXT_BYTES
    assert f"{result.tensors / GIB:.1f} {result.tight_line / GIB:.1f} {result.fits_line / GIB:.1f}" == "43.7 45.3 58.8"
    assert result.verdict == said and result.allowance == result.fits_line - result.tensors


def bad_inputs(tmp):
    (tmp / "notes.json").write_text("hidden_size: 4096\n")
    (tmp / "bert.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"],
                                               "hidden_size": 768, "intermediate_size": 3072, "vocab_size": 30522,
                                               "num_hidden_layers": 12, "num_attention_heads": 12}))
    (tmp / "gpt2.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2}))
    eight_b = str(CONFIGS / "llama3_8b.json")
    llama = json.loads((CONFIGS / "llama3_8b.json").read_text())
    (tmp / "mixtral.json").write_text(json.dumps({**llama, "model_type": "mixtral", "num_local_experts": 8}))
    (tmp / "moe-llama.json").write_text(json.dumps({**llama, "num_local_experts": 8}))
    (tmp / "text-field.json").write_text(json.dumps({**llama, "num_key_value_heads": "8"}))
    return {  # arguments: what the one line must say
        "missing": ([str(tmp / "nope.json")], "No such file"),
        "not-json": ([str(tmp / "notes.json")], "is not JSON"),
        "an-encoder": ([str(tmp / "bert.json")], "'bert' is an encoder or an encoder-decoder"),
        "not-llama-style": ([str(tmp / "gpt2.json")], "this formula cannot price it"),
        "mixture-of-experts": ([str(tmp / "mixtral.json")], "a mixture of experts (num_local_experts 8"),
        "experts-in-a-llama": ([str(tmp / "moe-llama.json")], "a mixture of experts (num_local_experts 8)"),
        "field-of-the-wrong-type": ([str(tmp / "text-field.json")], "Validation error for field 'num_key_value_heads'"),
        "zero-gpus": ([eight_b, "--gpus", "0"], "--gpus: must be >= 1, got 0"),
        "negative-gpus": ([eight_b, "--gpus", "-4"], "--gpus: must be >= 1, got -4"),
        "misspelt-strategy": ([eight_b, "--strategy", "fsdp"], "invalid choice: 'fsdp'"),
        "tp-not-dividing-gpus": ([eight_b, "--strategy", "fsdp2-tp", "--tp", "3", "--gpus", "8"],
                                 "--tp 3 does not divide --gpus 8"),
        "tp-not-dividing-heads": ([eight_b, "--strategy", "fsdp2-tp", "--tp", "16", "--gpus", "16"],
                                  "does not divide the 8 key/value heads"),
        "tp-without-fsdp2-tp": ([eight_b, "--tp", "2"], "--tp is for --strategy fsdp2-tp"),
    }


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    """Each mistake in its own process, all at once: one `error: ...` line naming the fix, exit code 2."""
    rows = bad_inputs(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {name: subprocess.Popen([sys.executable, str(LESSON / "will_it_fit.py"), *args], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, (args, _) in rows.items()}
    for name, proc in procs.items():
        out = proc.communicate(timeout=120)[0]
        lines = out.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, out)
        assert rows[name][1] in lines[0], (name, out)


def test_estimate_within_2_percent_of_the_measured_step():
    """FSDPMemTracker's peak of one step of a tiny Llama (4 layers, hidden 256, vocab 1024, batch 4 x 256; digits_lm's
    logits.float() and F.cross_entropy) on 2 gloo ranks against the estimate, rank 0: the total and each category
    within 2%, the claim of will_it_fit.py (measured here: 0.5% at most, the activations of fsdp2-ac). fsdp2 peaks
    at the loss, fsdp2-ac in the backward of layer 1, so two of the formula's moments are measured."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(LESSON / "measure_memory.py")], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "Warning" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr
    print(proc.stdout)
    rows = {r["strategy"]: r for r in map(json.loads, (x for x in proc.stdout.splitlines() if x.startswith("{")))}
    assert {s: (r["moment"], r["step"]) for s, r in rows.items()} == {"fsdp2": ("loss", "digits_lm"),
                                                                      "fsdp2-ac": ("layer 1", "digits_lm")}
    for row in rows.values():
        measured, estimated = row["measured"], row["estimated"]
        assert sum(estimated.values()) == pytest.approx(sum(measured.values()), rel=0.02)
        pairs = [("parameters",), ("gradients",), ("optimizer",), ("gathered",), ("activations", "unsharded")]
        for keys in pairs:
            m, e = (sum(part[k] for k in keys) for part in (measured, estimated))
            assert e == pytest.approx(m, rel=0.02, abs=1024), (row["strategy"], keys, m, e)
        assert measured["activations"] + measured["unsharded"] > 0.3 * sum(measured.values())  # a real share
