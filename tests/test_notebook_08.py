"""Lesson 08's notebook, executed headless on the CPU (2 gloo ranks per launch): what it showed the learner."""
import re

import nbformat

from lessons import ROOT
from test_notebooks import execute

NOTEBOOK = "08_your_model/your_model.ipynb"


def test_committed_without_outputs():
    book = nbformat.read(ROOT / NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in book.cells if c.cell_type == "code")
    ids = [c.get("id") for c in book.cells]
    assert None not in ids and len(set(ids)) == len(ids), ids


def test_meta_shards_and_a_load_equal_to_from_pretrained(synthetic_dir, tmp_path, monkeypatch):
    nb = execute(NOTEBOOK, synthetic_dir, tmp_path, monkeypatch)
    folder = nb.lines("nw.write_folder")
    files = [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]
    assert folder[0] == str(["config.json", "generation_config.json", *files, "model.safetensors.index.json"])
    assert folder[1] == ("26 tensors in 5 files; model.layers.0.self_attn.q_proj.bias is in "
                         "model-00001-of-00005.safetensors; lm_head.weight stored: False"), folder
    assert "Writing model shards" not in nb.text  # the progress bar is off
    text = nb.cell("nw.shards")
    ranks = re.split(r"(?=rank \d/2: )", text)[1:]
    assert len(ranks) == 2, text
    for rank, rows in enumerate(((22, 21))):
        lines = ranks[rank].splitlines()
        assert lines[0] == (f"rank {rank}/2: FSDPQwen2ForCausalLM on the meta device, FSDP2 units: (the root), "
                            "model.layers.0, model.layers.1"), lines
        assert lines[1:6] == [f"  model.embed_tokens.weight: full [43, 32], mine [{rows}, 32]",
                              "  model.layers.0.self_attn.q_proj.weight: full [32, 32], mine [16, 32]",
                              "  model.layers.0.self_attn.q_proj.bias: full [32], mine [16]",
                              "  model.layers.0.self_attn.k_proj.weight: full [16, 32], mine [8, 32]",
                              "  model.norm.weight: full [32], mine [16]"], lines
        stored = 10_064 if rank == 0 else 10_032  # 20,096 in all: rank 0's extra embedding row is 32 numbers
        assert lines[6] == f"  parameters: 20,096 in all, {stored:,} stored here; lm_head is embed_tokens: True"
    loaded = nb.lines("nw.load_and_compare")
    for rank in (0, 1):
        assert f"rank {rank}: read 26 tensors from 5 safetensors files" in loaded, loaded
        line = next(x for x in loaded if x.startswith(f"rank {rank}: logits"))
        assert line.startswith(f"rank {rank}: logits [2, 24, 43], max |sharded - from_pretrained| = "), line
        assert float(re.search(r"= (\S+);", line).group(1)) <= 1e-5 and line.endswith("RoPE inv_freq equal: True")
    assert float(loaded[-1].split(": ")[1]) <= 1e-5, loaded
    assert "Loading weights" not in nb.text
