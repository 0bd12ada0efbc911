"""Lesson 08's text after training: greedy continuations from the sharded model, and an export that proves itself.

The sharded model generates with a loop of full forwards (no KV cache), every rank running each one: FSDP gathers
each layer's weights inside forward, so a rank that skipped one would leave the others waiting. Rank 0's choice is
broadcast, so every rank feeds the same next token. After --export, rank 0 loads the folder with from_pretrained and
compares: its logits on a fixed prompt against the sharded model's, and its greedy `generate` against the loop.
"""
from pathlib import Path

import torch
import torch.distributed as dist

from common.errors import CourseError

NEW_TOKENS = 16  # greedy tokens generated for --prompt and for the export's check
CHECK_PROMPT = "Distributed training"  # the export check's prompt when there is no --prompt
# max |logit difference| allowed between the export, loaded by from_pretrained in the compute dtype, and the sharded
# model. The same weights in the same dtype: measured 0 (2 and 4 gloo ranks, a CPU; float32 and bfloat16), 1e-4 leaves
# room for other kernels. A bfloat16 export of float32 training rounds every weight to 8 bits of mantissa: measured
# up to 0.0036 on text_model.py's decoder after 2 epochs (2 and 4 gloo ranks, seeds 1 and 2, a CPU, 2026-11-28);
# it can flip a near tie in greedy decoding, which the check then reports instead of failing.
EXACT, LOSSY = 1e-4, 0.02
HINT = " (bfloat16's rounding of the float32 weights: --export-dtype float32 compares exactly)"


def prompt_ids(tokenizer, text: str) -> torch.Tensor:
    """[1, n] token ids, as a user's `tokenizer(text, return_tensors="pt")` gives them."""
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise CourseError(f"--prompt {text!r} has no tokens: give some text")
    return ids


def eos_ids(generation_config) -> set[int]:
    eos = generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


@torch.no_grad()
def sharded_logits(model, ids: torch.Tensor, device) -> torch.Tensor:
    """Every rank calls it: float32 logits [1, n, V] on the CPU."""
    model.eval()
    return model(input_ids=ids.to(device), use_cache=False).logits.float().cpu()


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new_tokens: int, eos: set[int], device) -> list[int]:
    """Every rank calls it: up to new_tokens argmax tokens after ids, stopping after an EOS (as generate does)."""
    model.eval()
    ids, out = ids.to(device), []
    for _ in range(new_tokens):
        token = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        dist.broadcast(token, src=0)  # rank 0's choice, on every rank: the next forward is the same everywhere
        ids = torch.cat([ids, token], 1)
        out.append(token.item())
        if out[-1] in eos:
            break
    return out


def generation_config_for(pretrained, config):
    """The pretrained folder's generation_config.json if it has one, else the one from_pretrained would derive."""
    from transformers import GenerationConfig

    if (Path(pretrained) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(pretrained, local_files_only=True)
    return GenerationConfig.from_model_config(config)


def first_difference(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_export(folder, ids: torch.Tensor, logits: torch.Tensor, tokens: list[int], dtype, lossy: bool) -> str:
    """Rank 0: from_pretrained(folder)'s logits on ids against the sharded model's, and its greedy generate against
    `tokens`, loaded in the compute `dtype`; lossy: a bfloat16 export of float32 training. Returns the line that says
    both held; a CourseError names the first differing position."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bar
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype).eval()
    with torch.no_grad():
        theirs = model(input_ids=ids, use_cache=False).logits.float()
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(tokens),
                                   do_sample=False)[0, ids.shape[1]:].tolist()
    diff, tolerance = (theirs - logits).abs(), LOSSY if lossy else EXACT
    if diff.max() > tolerance:
        position = int((diff > tolerance).any(-1)[0].nonzero()[0])
        raise CourseError(f"--export {folder}: from_pretrained's logits differ from the sharded model's by "
                          f"{diff.max():.3g} (above {tolerance:g}) first at prompt position {position}: the export "
                          f"is not the trained model")
    same = first_difference(generated, tokens)
    if generated != tokens and not lossy:
        raise CourseError(f"--export {folder}: from_pretrained's greedy generate differs from the sharded model's at "
                          f"new token {same} ({generated} vs {tokens}): the export is not the trained model")
    greedy_said = f"the same {len(tokens)} tokens" if generated == tokens else \
        f"the same first {same} of {len(tokens)} tokens{HINT}"  # a near tie, flipped by the rounding
    return (f"export check: from_pretrained({folder}) gives the sharded model's logits on {ids.shape[1]} prompt "
            f"tokens within {tolerance:g} (max |diff| {diff.max():.2g}) and its greedy generate {greedy_said}")


def on_every_rank(check) -> str:
    """Rank 0 runs `check`; its line, or its CourseError, reaches every rank (no rank waits on one that raised)."""
    result = [None]
    if dist.get_rank() == 0:
        try:
            result[0] = check()
        except CourseError as exc:
            result[0] = exc
    dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], CourseError):
        raise result[0]
    return result[0]
