"""Lesson 08: the sharded model exported as a Hugging Face folder (config.json + safetensors) without gathering it.

Every rank writes its own shards with DCP's HuggingFaceStorageWriter (save_distributed). Its consolidation, on
rank 0 once all are written, stitches them into whole tensors one tensor at a time through the files, in
model-0000i-of-0000N.safetensors (one file per decoder layer), and writes model.safetensors.index.json:
from_pretrained loads the folder. No rank holds more than its shards and one tensor; the gather to rank 0 this
replaces held the whole model twice there (a full state dict and a plain model): 64 GB of one host for an 8 B model.
--export-dtype: bfloat16 halves the files and is what a GPU loads for inference; float32 keeps the training's master
weights bit for bit (for a continued training run, or a check against the trained model's logits).
"""
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from common.files import replace_folder
from hf_shards import decoder_layers, plain_name

SHARDS = "sharded"  # the subfolder HuggingFaceStorageWriter writes each rank's pieces into, before consolidating


def file_of_each(model, names) -> dict[str, int]:
    """The file (1, 2, ...) of each tensor: the tensors before the decoder layers (the embeddings) in the first, one
    file per layer, the rest (final norm, lm_head) in the last. DCP serialises one file's pieces at a time, at about
    twice their bytes: one file for all would cost each rank twice its shards (measured); from_pretrained reads any."""
    layers = {getattr(parent, name) for parent, name in decoder_layers(model)}
    prefixes = [plain_name(n) + "." for n, module in model.named_modules() if module in layers]
    index, files = 1, {}
    for name in names:  # in the model's order: embeddings, layers, the rest
        layer = next((i for i, prefix in enumerate(prefixes) if name.startswith(prefix)), None)
        index = layer + 2 if layer is not None else 1 if index == 1 else len(prefixes) + 2
        files[name] = index
    return files


def export(model, config, folder, dtype: torch.dtype, extras=None) -> None:
    """Every rank calls it. The folder appears, complete, only at the end (a crash leaves the previous one).
    extras(scratch): rank 0 writes more files into it (a tokenizer, a generation_config.json) before the rename."""
    folder = Path(folder)
    scratch = folder.with_name(folder.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    tied = {plain_name(n) for n, _ in model.named_parameters(remove_duplicate=False)} - \
        {plain_name(n) for n, _ in model.named_parameters()}  # a tied lm_head.weight: stored once, as save_pretrained
    state = {name: tensor.to(dtype) for name, tensor in get_model_state_dict(model).items() if name not in tied}
    # this rank's shards (DTensors), cast: the writer stores what it is given; names without wrappers
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(scratch), save_distributed=True,
                                                            fqn_to_index_mapping=file_of_each(model, state),
                                                            enable_consolidation=True))
    if dist.get_rank() == 0:  # dcp.save returned: every rank's pieces written and consolidated
        shutil.rmtree(scratch / SHARDS)
        config = type(config).from_dict(config.to_dict())  # a copy that says the files' dtype
        config.dtype = dtype
        config.save_pretrained(scratch)  # config.json
        if extras:
            extras(scratch)
        replace_folder(scratch, folder)
    dist.barrier()
