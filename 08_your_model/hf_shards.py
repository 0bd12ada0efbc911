"""Lesson 08: any Hugging Face decoder, built on the meta device, sharded with FSDP2, then filled one piece at a time.

build_model: AutoModelForCausalLM.from_config on meta (shapes, no memory), each decoder layer its own fully_shard unit
(in checkpoint_wrapper with --ac, compiled with --compile), then the root. Its values come from either
  init_weights      transformers' own initialisation, one module at a time: a fresh model, the same on any rank count;
  load_pretrained   a save_pretrained folder: each rank reads only its own rows of each tensor (safetensors slices).
Both leave the non-persistent buffers (RoPE's inv_freq) right: `to_empty` leaves them garbage, and no checkpoint
stores them (transformers#34234), so they are computed again from the config. load_pretrained names the stored
tensors as from_pretrained does: the renames transformers registers for the class, and the stored tensors it skips.
"""
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from transformers import AutoModelForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

from common.errors import CourseError

WRAPPED = "_checkpoint_wrapped_module."  # what checkpoint_wrapper adds to names; files and DCP checkpoints lack it


def plain_name(name: str) -> str:
    return name.replace(WRAPPED, "")


def meta_model(config) -> nn.Module:
    """The model's shapes only; float32 whatever config.json's dtype says: the master weights FSDP2 keeps."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def decoder_layers(model) -> list[tuple[nn.Module, str]]:
    """(parent, name) of each decoder layer: the modules of the classes the model's `_no_split_modules` names
    (transformers' own list of blocks that must stay whole), else the entries of its longest ModuleList."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    found = [name for name, module in model.named_modules() if type(module).__name__ in kinds]
    found = [n for n in found if not any(n.startswith(outer + ".") for outer in found)]  # outermost only
    if not found:
        lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)
                 and len({type(x) for x in m}) == 1]
        found = [f"{n}.{i}" for n, m in sorted(lists, key=lambda x: -len(x[1]))[:1] for i in range(len(m))]
    if not found:
        raise CourseError(f"{type(model).__name__}: no decoder layers found (looked for modules of the classes in its "
                          f"_no_split_modules {sorted(kinds)}, then for a ModuleList of one kind of module): "
                          f"this lesson shards decoder-only transformers")
    return [(model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in found]


def build_model(config, mesh, dtype, ac: bool = False, compile_backend: str | None = None) -> nn.Module:
    """The decoder on the meta device, sharded: still no memory and no values anywhere."""
    model = meta_model(config)
    # bfloat16: the gathered weights and the compute in bf16; gradients reduced and master shards kept in fp32.
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layers = []
    for parent, name in decoder_layers(model):  # one unit per decoder layer: all-gathered just before it runs
        layer = getattr(parent, name)
        if ac:  # before fully_shard: the wrapper sits inside the unit (will_it_fit.py's fsdp2-ac)
            layer = checkpoint_wrapper(layer)  # keeps the layer's input only; backward runs its forward again
            setattr(parent, name, layer)
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        layers.append(layer)
    # The root: embeddings, final norm, lm_head. A tied lm_head IS the embedding's parameter, in this one unit: it
    # stays one DTensor (sharding the embedding or lm_head in a unit of its own would split the tie).
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if compile_backend:
        for layer in layers:  # per layer, in place, after fully_shard (lesson 05 compiles after fully_shard too)
            layer.compile(backend=compile_backend)
    return model


def modules_by_name(model) -> dict:
    """name -> module, names as a plain model has them: a checkpoint_wrapper is replaced by what it wraps."""
    return {plain_name(name): module for name, module in model.named_modules()}  # the wrapped module comes last


@torch.no_grad()
def init_weights(model, config, seed: int) -> None:
    """What one process gets from to_empty, `torch.manual_seed(seed)` and the model's own init_weights(), one module
    at a time, each rank keeping its piece: the same model on any number of ranks. (DTensor's random ops on a CPU
    mesh warn, and draw the same numbers on every rank for its own piece.)"""
    twin = meta_model(config)  # an unsharded twin, shapes only
    names, mine = {module: name for name, module in twin.named_modules()}, modules_by_name(model)
    filled = set()  # the tensors already initialised: a tied lm_head.weight IS the embedding
    torch.manual_seed(seed)

    def init(full):  # module.apply's order, children first: the order of transformers' initialize_weights
        full.to_empty(device="cpu", recurse=False)  # this module's full tensors for a moment, never the whole model
        twin._init_weights(full)  # transformers' own: normal(0, initializer_range), norms at 1, rotary frequencies
        for key, value in [*full.named_parameters(recurse=False), *full.named_buffers(recurse=False)]:
            target = getattr(mine[names[full]], key)
            if id(target) in filled:  # tied: keeps the embedding's values, as transformers' tie_weights() does
                continue
            filled.add(id(target))
            if isinstance(target, DTensor):  # a sharded parameter: cut my piece, no messages (buffers are whole)
                value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None).to_local()
                target = target.to_local()
            target.copy_(value)
        full.to_empty(device="meta", recurse=False)  # and free it

    twin.apply(init)


@torch.no_grad()
def fill_buffers(model, twin) -> None:
    """The non-persistent buffers (RoPE's inv_freq), which no checkpoint stores: computed again from the config by
    transformers' own _init_weights on the unsharded meta twin, module by module, as from_pretrained does."""
    mine = modules_by_name(model)
    for name, full in twin.named_modules():
        if full._non_persistent_buffers_set:
            full.to_empty(device="cpu", recurse=False)
            twin._init_weights(full)
            for key in full._non_persistent_buffers_set:
                getattr(mine[name], key).copy_(getattr(full, key))


def stored_tensors(folder: Path) -> dict[str, Path]:
    """name -> the safetensors file holding it: one model.safetensors, or several listed by their index."""
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if index.is_file():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    if single.is_file():
        with safe_open(single, "pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise CourseError(f"--pretrained {folder}: no model.safetensors or model.safetensors.index.json: "
                      f"pass a folder written by save_pretrained (safetensors)")


def names_in_the_model(twin, stored, folder: Path) -> dict[str, str]:
    """The model's name for each stored tensor, as from_pretrained renames it (core_model_loading.py's
    rename_source_key, with the same arguments, in its order): the renames transformers registers for the class
    (conversion_mapping.py, e.g. GPT-NeoX's stored embed_out -> lm_head) and the base model's prefix added or dropped.
    A tensor it merges or splits on load (a WeightConverter: fused q/k/v, experts) is refused: here rows are read
    as they are stored."""
    transforms = get_model_conversion_mapping(twin)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected, prefix, names = twin.state_dict(), twin.base_model_prefix, {}
    for key in sorted(stored, key=dot_natural_key):
        name, converted = rename_source_key(key, renamings, converters, prefix, expected)
        if name not in expected and key in expected:  # as from_pretrained: the stored name was right, prefix aside
            name, converted = rename_source_key(key, [], [], prefix, expected)
        if converted is not None:
            raise CourseError(f"--pretrained {folder}: {type(twin).__name__} converts {key} on load (transformers "
                              f"merges or splits the tensors that match {converted!r}): this loader reads stored "
                              f"rows as they are; give a model whose files hold its own tensors, e.g. llama, qwen2")
        names[key] = name
    return names


def skipped_as_from_pretrained(twin, unexpected: set[str]) -> set[str]:
    """The tensors not in the model that from_pretrained skips without a word: those matching the class's
    _keys_to_ignore_on_load_unexpected patterns, and stale rotary_emb.inv_freq and position_ids buffers (its own
    additions). Its own method decides (PreTrainedModel._adjust_missing_and_unexpected_keys, modeling_utils.py)."""
    report = SimpleNamespace(missing_keys=set(), unexpected_keys=set(unexpected))
    twin._adjust_missing_and_unexpected_keys(report)
    return unexpected - report.unexpected_keys


def my_rows(tensor: DTensor) -> slice:
    """The rows of the full tensor this rank holds: FSDP2 shards dim 0 as torch.chunk does, ceil(rows / N) each."""
    if tuple(tensor.placements) != (Shard(0),):
        raise CourseError(f"a parameter sharded as {tensor.placements}: load_pretrained reads FSDP2's Shard(0) only")
    mesh, rows = tensor.device_mesh, tensor.shape[0]
    chunk = -(-rows // mesh.size())
    start = min(mesh.get_local_rank() * chunk, rows)
    return slice(start, min(start + chunk, rows))


@torch.no_grad()
def load_pretrained(model, config, folder) -> str:
    """Every rank reads its own rows of each tensor straight from the files (safetensors slices), into its shards.
    No rank ever holds the whole model; a tied lm_head is its embedding, stored once. Returns what was read, and
    what was renamed or skipped as from_pretrained renames or skips it."""
    folder, stored = Path(folder), stored_tensors(Path(folder))
    twin = meta_model(config)  # unsharded, its own class: the renames and the skips from_pretrained finds for it
    source = {name: key for key, name in names_in_the_model(twin, stored, folder).items()}  # model's -> the files'
    stored_names = {plain_name(name) for name in model.state_dict()}  # no non-persistent buffers, both tied names
    targets = {plain_name(n): t for n, t in [*model.named_parameters(), *model.named_buffers()]
               if plain_name(n) in stored_names}  # each tensor once: a tied lm_head.weight is the embedding's
    aliases = stored_names - targets.keys()  # lm_head.weight when tied: from_pretrained accepts it stored or not
    missing = sorted(targets.keys() - source.keys())
    extra = source.keys() - targets.keys() - aliases
    skip = skipped_as_from_pretrained(twin, extra)  # stale buffers of older conversions, e.g. each layer's inv_freq
    skipped, unexpected = sorted(source[name] for name in skip), sorted(source[name] for name in extra - skip)
    if missing or unexpected:
        what = [f"{len(missing)} missing ({', '.join(missing[:3])})"] * bool(missing) + \
               [f"{len(unexpected)} not in the model ({', '.join(unexpected[:3])})"] * bool(unexpected)
        raise CourseError(f"--pretrained {folder}: its weights do not match its config.json: {'; '.join(what)}")
    for file in sorted(set(stored[source[name]] for name in targets)):
        with safe_open(file, "pt") as f:  # memory-mapped: only the bytes sliced are read
            for name in [n for n in targets if stored[source[n]] == file]:
                target, piece = targets[name], f.get_slice(source[name])
                if tuple(piece.get_shape()) != tuple(target.shape):
                    raise CourseError(f"--pretrained {folder}: {source[name]} is {list(piece.get_shape())} in "
                                      f"{file.name}, {list(target.shape)} in the model: its weights do not match "
                                      f"its config.json")
                if isinstance(target, DTensor):
                    target, rows = target.to_local(), my_rows(target)  # my shard's storage, my rows of the file
                    if rows.stop > rows.start:
                        target.copy_(piece[rows.start:rows.stop])  # bf16 on disk -> the fp32 master shard
                else:
                    target.copy_(piece[:])
    fill_buffers(model, twin)
    files = len(set(stored.values()))
    renamed = [f"{key} -> {name}" for name, key in source.items() if name != key and name in targets]
    return f"{len(targets)} tensors from {files} safetensors file{'s' if files > 1 else ''}" + \
        (f"; {len(renamed)} renamed as from_pretrained renames them ({', '.join(renamed[:2])})" if renamed else "") + \
        (f"; {len(skipped)} skipped as from_pretrained skips them ({', '.join(skipped[:2])})" if skipped else "")
