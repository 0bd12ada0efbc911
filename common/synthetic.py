"""A synthetic stand-in for MNIST, written as genuine IDX files: learnt in an epoch or two, but not trivial.

Each image is a digit glyph (Pillow's built-in font) with a random stroke thickness, affine jitter, a smooth elastic
warp and a little noise, 28x28 uint8 like MNIST. The output depends only on (seed, sizes), and image i is the same
whatever the set size (a 3000-image set is a prefix of a 60000 one).
"""
import json
import math
import struct
from pathlib import Path

import torch
import torch.nn.functional as F

from common.files import atomic_write

GENERATOR_VERSION = 1
FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MARKER = "SYNTHETIC.json"
_CHUNK = 2048   # images drawn per random stream; fixed, so output is independent of set size
_T = 56         # template resolution: rendered at 2x, blurred, sampled at 28x28
_STROKES = (0, 1, 2)  # dilation radius in template pixels: thin to bold digits


def _glyph_templates() -> torch.Tensor:
    """[10, len(_STROKES), _T, _T] float glyphs in [0, 1], centred, ~40 px tall, blurred so that sampling them at
    half resolution does not alias."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    try:
        font = ImageFont.load_default(size=_T)  # scalable font (Pillow >= 10.1 with FreeType)
    except TypeError:
        font = ImageFont.load_default()  # old Pillow: small bitmap font, scaled up below
    out = torch.zeros(10, len(_STROKES), _T, _T)
    for d in range(10):
        for k, stroke in enumerate(_STROKES):
            canvas = Image.new("L", (2 * _T, 2 * _T), 0)
            ImageDraw.Draw(canvas).text((_T // 2, _T // 4), str(d), fill=255, font=font)
            if stroke:  # thicker strokes by dilation (works for bitmap fonts too)
                canvas = canvas.filter(ImageFilter.MaxFilter(2 * stroke + 1))
            glyph = canvas.crop(canvas.getbbox())
            h = 40 + stroke  # MNIST digits fit a 20x20 box of the 28x28 image
            w = max(4, round(glyph.width * h / glyph.height))
            if w > 44:
                w, h = 44, max(4, round(glyph.height * 44 / glyph.width))
            glyph = glyph.resize((w, h), Image.BILINEAR)
            x0, y0 = (_T - w) // 2, (_T - h) // 2
            out[d, k, y0:y0 + h, x0:x0 + w] = torch.frombuffer(
                bytearray(glyph.tobytes()), dtype=torch.uint8).view(h, w).float() / 255
    tent = torch.tensor([1.0, 2.0, 1.0])
    tent = (torch.outer(tent, tent) / 16).view(1, 1, 3, 3)
    return F.conv2d(out.view(-1, 1, _T, _T), tent, padding=1).view(out.shape)


def _render_chunk(templates: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw _CHUNK labels and images from `gen`; images are [_CHUNK, 28, 28] uint8."""
    n = _CHUNK

    def uniform(lo, hi, *shape):
        return lo + (hi - lo) * torch.rand(*(shape or (n,)), generator=gen)

    labels = torch.randint(0, 10, (n,), generator=gen)
    stroke = torch.randint(0, len(_STROKES), (n,), generator=gen)
    src = templates[labels, stroke].unsqueeze(1)  # [n, 1, _T, _T]

    # Affine map from output to template coordinates (normalised to [-1, 1]).
    angle = uniform(-10, 10) * math.pi / 180
    shear = uniform(-0.2, 0.2)
    scale = uniform(0.85, 1.1)
    aspect = uniform(0.85, 1.15)
    sx, sy = 1 / (scale * aspect.sqrt()), aspect.sqrt() / scale
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.stack([
        torch.stack([cos * sx, (-sin + shear * cos) * sy, uniform(-0.1, 0.1)], 1),
        torch.stack([sin * sx, (cos + shear * sin) * sy, uniform(-0.1, 0.1)], 1),
    ], 1)
    grid = F.affine_grid(theta, [n, 1, 28, 28], align_corners=False)
    # Smooth elastic warp: a random 4x4 displacement field, upsampled.
    warp = torch.randn(n, 2, 4, 4, generator=gen) * uniform(0.01, 0.05, n, 1, 1, 1)
    grid = grid + F.interpolate(warp, size=(28, 28), mode="bicubic", align_corners=True).permute(0, 2, 3, 1)
    img = F.grid_sample(src, grid, mode="bilinear", padding_mode="zeros", align_corners=False).squeeze(1)

    # Ink: contrast like MNIST (saturated stroke centres), varying intensity, a little noise.
    img = (img * uniform(1.0, 1.5, n, 1, 1)).clamp(0, 1) * uniform(0.75, 1.0, n, 1, 1)
    img = img + torch.randn(n, 28, 28, generator=gen) * uniform(0.0, 0.06, n, 1, 1)
    return labels.to(torch.uint8), (img.clamp(0, 1) * 255).round().to(torch.uint8)


def generate(size: int, seed: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (images [size, 28, 28] uint8, labels [size] uint8) for one split."""
    templates = _glyph_templates()
    stream = {"train": 0, "test": 1}[split]
    labels, images = [], []
    for c in range(math.ceil(size / _CHUNK)):
        gen = torch.Generator().manual_seed(((seed * 2 + stream) << 20) + c)  # one stream per chunk
        lab, img = _render_chunk(templates, gen)
        labels.append(lab)
        images.append(img)
    return torch.cat(images)[:size].contiguous(), torch.cat(labels)[:size].contiguous()


def write_idx(path: Path, data: torch.Tensor) -> None:
    """Write a uint8 tensor as an IDX file: images [N, 28, 28] (magic 2051) or labels [N] (2049)."""
    magic = 2051 if data.dim() == 3 else 2049
    header = struct.pack(">" + "I" * (1 + data.dim()), magic, *data.shape)
    with atomic_write(path) as f:
        f.write(header)
        f.write(data.contiguous().numpy().tobytes())


def write_synthetic_mnist(root, train_size: int = 60000, test_size: int = 10000, seed: int = 0) -> Path:
    """Write the four MNIST IDX files under ROOT/MNIST/raw/ and return that folder; a marker file records the
    parameters, so calling again with the same ones is a fast no-op."""
    raw = Path(root) / "MNIST" / "raw"
    marker = raw / MARKER
    params = {"generator_version": GENERATOR_VERSION, "seed": seed,
              "train_size": train_size, "test_size": test_size}
    try:
        if json.loads(marker.read_text()) == params and all((raw / f).is_file() for f in FILES):
            return raw
    except (OSError, ValueError):
        pass
    raw.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # a crash below must not leave a marker that claims the old files
    sizes = {"train": train_size, "test": test_size}
    for split in ("train", "test"):
        images, labels = generate(sizes[split], seed, split)
        prefix = "train" if split == "train" else "t10k"
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    with atomic_write(marker, "w") as f:
        f.write(json.dumps(params, indent=1) + "\n")
    return raw
