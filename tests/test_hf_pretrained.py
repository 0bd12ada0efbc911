"""Lesson 08's --pretrained (08_your_model/hf_shards.py): a save_pretrained folder read shard by shard into an FSDP2
model, for Llama (untied, sharded over several files), Qwen2 (q/k/v biases, tied embeddings, stored in bf16) and
Mistral, on 2 and 4 gloo ranks: the sharded model's float32 logits equal from_pretrained's (1e-5), RoPE's inv_freq
computed again; GPT-NeoX's stored names renamed and older conversions' leftovers skipped, as from_pretrained does.
Every checkpoint is written here by save_pretrained from a random model: nothing is downloaded."""
import sys
from pathlib import Path

import pytest
import torch

from common.errors import CourseError
from common.launcher import launch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "08_your_model"))

SHAPE = dict(vocab_size=43, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)  # 43 rows: uneven shards on 2 and 4 ranks
MODELS = {  # model_type: (its own settings, save_pretrained's arguments)
    "llama": ({"tie_word_embeddings": False}, {"max_shard_size": "20KB"}),  # several files + an index
    "qwen2": ({"tie_word_embeddings": True}, {}),  # q, k, v with biases; lm_head IS the embedding
    "mistral": ({"tie_word_embeddings": False}, {}),
}
INPUT = torch.arange(2 * 24).remainder(43).reshape(2, 24)
STALE = {  # what older conversions stored beside the weights (per layer i); from_pretrained skips it without a word
    "llama": ("model.layers.{i}.self_attn.rotary_emb.inv_freq",),  # transformers' rule for any rotary_emb buffer
    "gpt_neox": ("gpt_neox.layers.{i}.attention.rotary_emb.inv_freq", "gpt_neox.layers.{i}.attention.bias",
                 "gpt_neox.layers.{i}.attention.masked_bias"),  # Pythia's files; the last two: GPT-NeoX's own list
}


def config_of(kind: str, **changes):
    from transformers import CONFIG_MAPPING
    return CONFIG_MAPPING[kind](**{**SHAPE, **MODELS.get(kind, ({}, {}))[0], **changes})


def write_checkpoint(kind: str, folder: Path, dtype=torch.float32):
    """A random model, every tensor moved off its initial value (biases are zeros, norms ones), save_pretrained."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(kind))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(folder, **MODELS.get(kind, ({}, {}))[1])


def rewrite_with(folder: Path, extra: dict) -> None:
    """One model.safetensors holding the folder's tensors and `extra`, as an older conversion wrote it."""
    from safetensors.torch import load_file, save_file
    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(file))
        file.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({**tensors, **extra}, folder / "model.safetensors", metadata={"format": "pt"})


def reference_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=INPUT).logits


def sharded_worker(folder: str):
    """Rank r of N: build on meta, fully_shard, to_empty, then read its own rows of each tensor; forward."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import digits_lm
    from hf_shards import build_model, load_pretrained

    dist.init_process_group("gloo")
    config = digits_lm.read_config(folder, "--pretrained")
    model = build_model(config, init_device_mesh("cpu", (dist.get_world_size(),)), torch.float32)
    model.to_empty(device="cpu")  # garbage everywhere, inv_freq included
    read = load_pretrained(model, config, folder)
    local = sum(p.to_local().numel() for p in model.parameters())
    with torch.no_grad():
        logits = model.eval()(input_ids=INPUT, use_cache=False).logits
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    dist.destroy_process_group()
    return {"logits": logits, "read": read, "local": local, "tied": tied,
            "total": sum(p.numel() for p in model.parameters())}


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("kind", list(MODELS))
def test_sharded_logits_equal_from_pretrained(kind, nprocs, tmp_path):
    write_checkpoint(kind, tmp_path, torch.bfloat16 if kind == "qwen2" else torch.float32)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 if kind == "llama" else files == ["model.safetensors"], files
    expected = reference_logits(tmp_path)
    results = launch(sharded_worker, nprocs=nprocs, args=(str(tmp_path),), timeout_s=240)
    for r in results:
        assert (r["logits"] - expected).abs().max().item() < 1e-5, kind
        assert r["tied"] == (kind == "qwen2") and f"from {len(files)} safetensors file" in r["read"], r["read"]
    assert sum(r["local"] for r in results) == results[0]["total"]  # each rank holds its rows, none holds all


@pytest.mark.parametrize("kind", list(STALE))
def test_stored_names_are_renamed_and_skipped_as_from_pretrained_does(kind, tmp_path):
    """Llama with each layer's stale inv_freq; GPT-NeoX as save_pretrained writes it (its lm_head stored as
    embed_out, renamed back on load) with Pythia's leftovers. The note says what was renamed and skipped."""
    write_checkpoint(kind, tmp_path)
    stale = sorted(name.format(i=i) for name in STALE[kind] for i in range(2))
    rewrite_with(tmp_path, {name: torch.zeros(3) for name in stale})
    expected = reference_logits(tmp_path)
    results = launch(sharded_worker, nprocs=2, args=(str(tmp_path),), timeout_s=240)
    renamed = "; 1 renamed as from_pretrained renames them (embed_out.weight -> lm_head.weight)" * (kind == "gpt_neox")
    for r in results:
        assert (r["logits"] - expected).abs().max().item() < 1e-5, kind
        assert r["read"].endswith(f"safetensors file{renamed}; {len(stale)} skipped as from_pretrained skips them "
                                  f"({', '.join(stale[:2])})"), r["read"]


def test_tensors_transformers_merges_or_splits_on_load_are_one_line(tmp_path):
    """HRM-Text's files hold fused q/k/v and gate/up tensors that from_pretrained splits (a WeightConverter)."""
    from hf_shards import load_pretrained, meta_model
    write_checkpoint("hrm_text", tmp_path)
    config = config_of("hrm_text")
    with pytest.raises(CourseError, match=r"^--pretrained \S+: HrmTextForCausalLM converts model\.H_module\.layers"
                                          r"\.0\.attn\.gqkv_proj\.weight on load \(transformers merges or splits"):
        load_pretrained(meta_model(config).to_empty(device="cpu"), config, tmp_path)


def test_the_decoder_layers_are_found_by_class_then_by_list():
    from hf_shards import decoder_layers, meta_model
    for kind in MODELS:
        model = meta_model(config_of(kind))
        assert [f"{type(p).__name__}.{n}" for p, n in decoder_layers(model)] == ["ModuleList.0", "ModuleList.1"]
        model._no_split_modules = []  # no class named: the longest ModuleList of one kind of module
        assert len(decoder_layers(model)) == 2
    with pytest.raises(CourseError, match=r"^Linear: no decoder layers found \(looked for modules of the classes"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_weights_that_do_not_match_the_config_are_one_line(tmp_path):
    from hf_shards import load_pretrained, meta_model
    write_checkpoint("llama", tmp_path)
    deeper = config_of("llama", num_hidden_layers=3)
    model = meta_model(deeper).to_empty(device="cpu")
    with pytest.raises(CourseError, match=r"its weights do not match its config.json: 9 missing \(model.layers.2"):
        load_pretrained(model, deeper, tmp_path)
    wider = config_of("llama", intermediate_size=96)
    model = meta_model(wider).to_empty(device="cpu")
    with pytest.raises(CourseError, match=r"is \[\d+, \d+\] in model-\d+-of-\d+\.safetensors, \[\d+, \d+\] in the"):
        load_pretrained(model, wider, tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(CourseError, match="no model.safetensors or model.safetensors.index.json"):
        load_pretrained(model, wider, tmp_path)


def test_flops_per_token_and_mfu():
    from flops import flops_per_token, mfu, peak_flops
    assert flops_per_token(1_000_000, 2, 64, 196) == 6_000_000 + 12 * 2 * 64 * 196
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989.4e12 and peak_flops("Some GPU") is None
    assert mfu(1e5, 2, 10**8, 12, 768, 196, "NVIDIA H200") == pytest.approx(1e5 * (6e8 + 12 * 12 * 768 * 196) /
                                                                            (2 * 989.4e12))


@pytest.mark.parametrize("kind, head_dim", [("gemma", 32), ("mistral", 24), ("llama", None)])
def test_the_formula_is_what_torch_counts(kind, head_dim):
    """A training step's FLOPs as torch's FlopCounterMode counts them (its matmuls: eager attention's scores and their
    product with v are two) are 6 N + 12 L a s per token, a = heads x head_dim: 128 and 96 wide in a hidden size of
    32 (Gemma, Mistral), 32 for a Llama without head_dim. Norm weights multiply elementwise: no matmul, left out."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from flops import attention_width, flops_per_token, multiplying_parameters
    config = CONFIG_MAPPING[kind](**SHAPE, head_dim=head_dim)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert attention_width(config) == 4 * (head_dim or 8)
    with FlopCounterMode(display=False) as counter:
        model(input_ids=INPUT, labels=INPUT).loss.backward()
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    per_token = flops_per_token(multiplying_parameters(model) - norms, 2, attention_width(config), INPUT.shape[1])
    assert counter.get_total_flops() == per_token * INPUT.numel()


def test_the_epoch_line_says_its_mfu_is_the_whole_epochs(monkeypatch):
    """On a GPU in the table the epoch line adds the MFU over the epoch's whole time, and says so; a = 4 x 32."""
    from flops import rates
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    config = config_of("mistral", head_dim=32)
    used = 2e8 * (6e6 + 12 * 2 * 128 * 196) / (2 * 989.4e12)  # 66.7% (62.2% with the hidden size, 32, for a)
    assert rates(2e8, 10**6, config, 196, torch.device("cuda")) == \
        f" | 200,000,000 tokens/s | MFU {used:.1%} (whole epoch: first step and any compile in it)"
    assert rates(2e8, 10**6, config, 196, torch.device("cpu")) == " | 200,000,000 tokens/s"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_formula_counts_what_multiplies(kind):
    """N: every parameter but the input embedding (a lookup); a tied lm_head is that matrix and multiplies."""
    from flops import multiplying_parameters
    from hf_shards import meta_model
    model = meta_model(config_of(kind))
    total, embedding = sum(p.numel() for p in model.parameters()), model.get_input_embeddings().weight.numel()
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert tied == (kind == "qwen2")
    assert multiplying_parameters(model) == (total if tied else total - embedding)
