"""One reader of a Hugging Face config.json, for digits_lm.py and will_it_fit.py: local files only, nothing downloaded.

read_config(path, flag) takes a config.json or a folder holding one (a save_pretrained folder) and returns the
transformers config (AutoConfig.for_model(model_type, **fields)) of a decoder-only causal LM that
AutoModelForCausalLM can build, or raises a one-line CourseError that names the flag, the file and the fix.
Mixture-of-experts configs are refused: the course's formulas and sharding (one FSDP2 unit per decoder layer, the
MLP's bytes from intermediate_size) describe dense decoders only. So are multimodal ones (AutoModelForCausalLM builds
"gemma3" as Gemma3ForConditionalGeneration, a vision tower included), told by their config class's parts.
"""
import json
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from transformers import CONFIG_MAPPING, AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from common.errors import CourseError, one_line

MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
              "moe_intermediate_size")  # any one set (not None or 0) marks a mixture of experts (transformers 5)
MODALITIES = ("vision", "audio")  # a sub-config named for one, or a text_config: a text model is one part of several
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_config(path, flag: str = "--model-config"):
    """The config of a dense decoder-only causal LM, from a config.json or a folder holding one."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        fields = json.loads(file.read_text())
    except OSError as exc:
        raise CourseError(f"{flag} {path}: {exc.strerror or exc}: give a config.json, or a folder holding one") \
            from None
    except ValueError as exc:  # JSONDecodeError, or bytes that are not text at all
        raise CourseError(f"{flag} {path} is not JSON ({one_line(exc, 120)}): give a config.json") from None
    kind = fields.pop("model_type", None) if isinstance(fields, dict) else None
    if kind is None:
        raise CourseError(f'{flag} {path} has no "model_type": give a Hugging Face decoder\'s config.json')
    parts = sorted(CONFIG_MAPPING[kind].sub_configs) if kind in CONFIG_MAPPING else []
    other = [part for part in parts if part == "text_config" or any(word in part for word in MODALITIES)]
    if other:  # before any weight is read: the folder's safetensors hold a vision or audio tower too
        text = getattr(CONFIG_MAPPING[kind].sub_configs.get("text_config"), "model_type", None)
        alone = f' (its text decoder alone: "model_type" {text!r})' * (text in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        raise CourseError(f'{flag} {path}: "model_type" {kind!r} is a multimodal model ({", ".join(other)}): this '
                          f'lesson builds text-only decoders; give a text-only config.json{alone}, e.g. "llama"')
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise CourseError(f'{flag} {path}: "model_type" {kind!r} is not one that AutoModelForCausalLM builds '
                          f'(looked for in transformers\' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES): give a decoder\'s '
                          f'config.json, e.g. "llama", "qwen2", "mistral"')
    try:
        config = AutoConfig.for_model(kind, **fields)
    except (StrictDataclassError, TypeError, ValueError) as exc:  # transformers 5 checks types: StrictDataclassError
        raise CourseError(f"{flag} {path}: {one_line(exc, 200)}: fix that field") from None
    if config.is_encoder_decoder or kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES:  # BERT, BART...: causal only as a part
        raise CourseError(f'{flag} {path}: "model_type" {kind!r} is an encoder or an encoder-decoder: give a '
                          f'decoder-only config, e.g. "llama", "qwen2", "mistral"')
    experts = {name: getattr(config, name) for name in MOE_FIELDS if getattr(config, name, None)}
    if experts:
        named = ", ".join(f"{name} {value}" for name, value in experts.items())
        raise CourseError(f"{flag} {path}: a mixture of experts ({named}): the course prices and shards dense "
                          f"decoders only; give a dense config (e.g. llama, qwen2, mistral)")
    small = [name for name in SIZES if isinstance(getattr(config, name, None), int) and getattr(config, name) < 1]
    if small:
        raise CourseError(f"{flag} {path}: {', '.join(small)} must be at least 1")
    return config
