"""The files the bad-input rows (tests/bad_inputs.py) hand to the scripts, made once per session under one folder.

make_artifacts: a real checkpoint of every lesson (a small run, each in this process as bad_input_runs.run_in_process
runs a row; the TWO_RANKS lessons with a 2-rank torchrun), a truncated one, a broken DCP folder of each sharded
lesson, lesson 08's --pretrained folders (make_pretrained_folders) and two --config files.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bad_input_runs import Context, run_in_process
from bad_inputs import LESSONS, SHARDED, TWO_RANKS, Case, command_line, small


def make_artifacts(art: Path, data: str) -> None:
    """Real checkpoints of every lesson (the small() run, in-process; TWO_RANKS lessons: a 2-rank torchrun, started
    first so that it overlaps the others), a truncated one, a broken DCP folder of each sharded lesson, and two
    --config files."""
    from unittest import mock

    art.mkdir(parents=True, exist_ok=True)
    ctx = Context(data, str(art), str(art / "runs"))
    cases = {lesson: Case(f"artifact-{lesson}", lesson, "", (*small(lesson), "--output-dir", "{out}"), expect="ok")
             for lesson in LESSONS}
    launched = {lesson: subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *command_line(lesson),
         *ctx.resolve(cases[lesson], cases[lesson].argv)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"}) for lesson in TWO_RANKS}
    for lesson in LESSONS:
        if lesson in launched:
            output = launched[lesson].communicate(timeout=300)[0]
            result = {"code": launched[lesson].returncode, "output": output[-3000:]}
        else:
            with mock.patch("common.history.plot_curves"):  # an input, not under test: its curves.png costs ~1.5 s
                result = run_in_process(cases[lesson], ctx)
        if result["code"] != 0:
            raise AssertionError(f"making the lesson {lesson} checkpoint failed: {result}")
        produced = sorted((Path(ctx.paths(cases[lesson])["out"]) / "checkpoints").iterdir())[-1]
        (shutil.copytree if produced.is_dir() else shutil.copyfile)(produced, art / f"ckpt-{lesson}")
    (art / "truncated.pt").write_bytes((art / "ckpt-02").read_bytes()[:2000])
    for lesson in SHARDED:
        shutil.copytree(art / f"ckpt-{lesson}", art / f"broken-dcp-{lesson}")
        metadata = art / f"broken-dcp-{lesson}" / ".metadata"
        metadata.write_bytes(metadata.read_bytes()[: metadata.stat().st_size // 2])
    make_pretrained_folders(art)
    (art / "epochs-zero.yaml").write_text("epochs: 0\n")
    (art / "typo-key.yaml").write_text("epoch: 2\n")


def make_pretrained_folders(art: Path) -> None:
    """Lesson 08's --pretrained mistakes: a vision transformer's and BERT's config.json, a tiny Llama's folder
    (save_pretrained) whose config.json then says 2 layers or another intermediate_size, a config.json alone, Gemma
    3's multimodal config.json beside a model.safetensors that is not one (refused before any weight is read)."""
    from transformers import BertConfig, Gemma3Config, LlamaConfig, LlamaForCausalLM, ViTConfig

    ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=32).save_pretrained(art / "hf-vit")
    BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32).save_pretrained(art / "hf-bert")  # AutoModelForCausalLM builds it, an encoder
    config = LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=32)
    for name, change in (("hf-more-layers", {"num_hidden_layers": 2}), ("hf-other-shape", {"intermediate_size": 48})):
        LlamaForCausalLM(config).save_pretrained(art / name)
        path = art / name / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    config.save_pretrained(art / "hf-no-weights")
    Gemma3Config().save_pretrained(art / "hf-gemma3")
    (art / "hf-gemma3" / "model.safetensors").write_text("not a safetensors file: read_config stops before it\n")
