"""Lesson 08's digits as tokens, and tokens back as digits: MNIST rows for the language model, and its drawings.

An image is 197 tokens: its class (16 + digit), then its 14x14 pixels row by row, in 16 gray levels (tokens 0-15).
"""
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Subset, TensorDataset

from common.log import log0

LEVELS, PIXELS = 16, 14 * 14  # tokens 0-15: the gray levels; 16-25: the digit's class


def pixel_tokens(dataset) -> TensorDataset:
    """MNIST images (MNISTFiles, or load_mnist's Subset of it) as rows of 197 tokens: the class, then 196 pixels."""
    indices = torch.arange(len(dataset))
    while isinstance(dataset, Subset):  # back to the raw uint8 images, not the normalised items
        indices, dataset = torch.as_tensor(dataset.indices)[indices], dataset.dataset
    images = F.avg_pool2d(dataset.data[indices].unsqueeze(1).float(), 2)  # 28x28 -> 14x14, still 0-255
    pixels = images.flatten(1).div(256 / LEVELS).long()  # 16 gray levels, 0-15
    return TensorDataset(torch.cat([LEVELS + dataset.targets[indices, None], pixels], dim=1))


@torch.no_grad()
def draw(model, temperature: float, seed: int, path: Path, device) -> None:
    """One digit per class, pixel after pixel from the class token, each gray level sampled at `temperature`.
    Every rank runs it on the SHARDED model (FSDP gathers each unit inside forward, nothing is gathered to keep);
    rank 0 samples and broadcasts each pixel, so that every rank feeds the same tokens; rank 0 draws."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    tokens = (LEVELS + torch.arange(10)[:, None]).to(device)  # the 10 class tokens
    for _ in range(PIXELS):  # the whole sequence again at each pixel: 196 small forwards, no cache to manage
        logits = model(input_ids=tokens, use_cache=False).logits[:, -1, :LEVELS].float().cpu()  # gray levels only
        level = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1, generator=generator).to(device)
        dist.broadcast(level, src=0)  # rank 0's draw for everyone
        tokens = torch.cat([tokens, level], dim=1)
    if dist.get_rank() != 0:
        return
    import matplotlib
    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 10, figsize=(10, 1.4))
    for digit, ax in enumerate(axes):
        ax.imshow(tokens[digit, 1:].reshape(14, 14).cpu(), cmap="gray", vmin=0, vmax=LEVELS - 1)
        ax.set(title=str(digit), xticks=[], yticks=[])
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    log0(f"drawn: {path} (one digit per class, temperature {temperature})")


def what_it_learns(config, pretrained) -> str | None:
    """Before training, for a --pretrained model or a vocabulary larger than the task's: what its token ids will mean
    (pixel_tokens). A text model's ids 0-25 stop meaning their text; its other ids are never trained on."""
    used, vocab = LEVELS + 10, config.vocab_size
    if not pretrained and vocab == used:
        return None
    ids = f"{LEVELS} gray levels, {LEVELS}-{used - 1} the digit classes"
    if pretrained:
        what = f"--pretrained {pretrained}: trained to draw MNIST digits, p(pixels | digit), whatever it learned " \
               f"before: its token ids 0-{LEVELS - 1} become {ids}"
    else:
        what = f"the model learns to draw MNIST digits, p(pixels | digit): token ids 0-{LEVELS - 1} are {ids}"
    return what + (f"; it uses {used} of its {vocab:,} token ids" if vocab > used else "")
