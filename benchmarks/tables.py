"""One markdown section per benchmark suite, and the memory breakdown the memory table and plot share.

Each section function takes all rows and `measured_on` (rows -> the machine/data line) and returns lines;
a suite without rows says so instead of vanishing, so a missing measurement is visible on the page.
"""
from __future__ import annotations

from functools import lru_cache

# The recipe's target, read by the report: real MNIST, lesson 04 recipe, data on the GPUs, every seed at 99%.
# Its time to 99% is reported per seed against no limit in seconds: such a limit depends on the machine.
TARGET_ACCURACY = 0.99
TARGET_GPUS = (1, 2)
TARGET_SEEDS = (1, 2, 3)

LESSON_NAMES = {"02": "02 single GPU", "03": "03 DataParallel", "04": "04 DDP", "05": "05 FSDP2"}
DATA = {"mnist": "real MNIST", "synthetic": "synthetic"}
OPTIMIZER_STATE_BYTES = {"adadelta": 8, "adamw": 8, "sgd": 4}  # fp32 per parameter: 2 buffers, 2, momentum 1
IMAGE_BYTES = 28 * 28 * 4 + 8  # a float32 image and its int64 label, as --data-on-device holds them
MNIST_SIZES = (60_000, 10_000)
RUN_FLAGS = ("--data", "--data-dir", "--output-dir", "--device", "--seed")  # set per run, not part of a recipe


def _suite(rows, suite):
    return [r for r in rows if r["suite"] == suite]


def _f(value, fmt="{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:,.0f} MiB"


def _head(title, rows, measured_on, note, columns) -> list[str]:
    lines = [f"## {title}", "", note, ""]
    if not rows:
        return lines + ["_Not measured in these runs._"]
    return lines + [measured_on(rows), "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _failed(r, n_before, n_after) -> str:
    return "| " + " | ".join(n_before + [f"**{r['status'].upper()}**"] + ["-"] * n_after) + " |"


def recipe_flags(rows) -> str:
    """The recipe as it was run: the flags of a recipe row, without those that differ per run."""
    r = next((r for r in rows if r["suite"] == "recipe"), None)
    if r is None:
        return "(not run)"
    words = r["command"].split()
    words, out = words[next(i for i, w in enumerate(words) if w.endswith(".py")) + 1:], []
    while words:
        w = words.pop(0)
        if w in RUN_FLAGS:
            words.pop(0)
        else:
            out.append(w)
    return " ".join(out)


def recipe(rows, measured_on):
    rs = sorted(_suite(rows, "recipe"), key=lambda r: (r["gpus"], r["seed"]))
    lines = _head("Time to target per seed (lesson 04 recipe)", rs, measured_on,
                  f"`{recipe_flags(rows)}`: each run stops after the first epoch at its target accuracy.",
                  ["GPUs", "global batch", "seed", "data", "test accuracy per epoch", "time to target",
                   "warm-up (untimed)", "process wall s"])
    for r in rs:
        if r["status"] != "ok":
            lines.append(_failed(r, [str(r["gpus"]), "-", str(r["seed"]), DATA[r["data"]]], 4))
            continue
        accs = ", ".join(f"{e['test_accuracy']:.4f}" for e in r["epochs"])
        t = r.get("time_to_target_seconds")
        lines.append(f"| {r['gpus']} | {r['args']['batch_size'] * r['world_size']} | {r['seed']} | {DATA[r['data']]} | "
                     f"{accs} | {'not reached' if t is None else f'{t:.2f} s'} | {_f(r['warmup_seconds'])} s | "
                     f"{r['wall_seconds']:.0f} |")
    return lines


def classic(rows, measured_on):
    rs = sorted(_suite(rows, "classic"), key=lambda r: (r["gpus"], r["lesson"]))
    lines = _head("The classic recipe: 14 epochs of the default", rs, measured_on,
                  "pytorch/examples' recipe (DataLoader, batch 64 per GPU, Adadelta lr 1.0, StepLR 0.7) as the "
                  "lessons run it by default: lesson 02 on 1 GPU, lesson 04 on 2.",
                  ["lesson", "GPUs", "batch per GPU", "data", "epochs", "final test accuracy", "best (epoch)",
                   "training s", "process wall s"])
    for r in rs:
        if r["status"] != "ok":
            lines.append(_failed(r, [LESSON_NAMES[r["lesson"]], str(r["gpus"]), str(r["bs"]), DATA[r["data"]]], 4))
            continue
        best = max(r["epochs"], key=lambda e: e["test_accuracy"])
        lines.append(f"| {LESSON_NAMES[r['lesson']]} | {r['gpus']} | {r['bs']} | {DATA[r['data']]} | {len(r['epochs'])} | "
                     f"{r['final_accuracy']:.4f} | {best['test_accuracy']:.4f} ({best['epoch']}) | "
                     f"{r['train_seconds']:.1f} | {r['wall_seconds']:.0f} |")
    return lines


def scaling(rows, measured_on):
    rs = sorted(_suite(rows, "scaling"), key=lambda r: (r["variant"], r["gpus"]))
    n = max((len(r.get("epochs") or []) for r in rs), default=0)
    lines = _head("Large-batch scaling: test accuracy per epoch", rs, measured_on,
                  "Lesson 04, data on the GPUs, Adadelta (lr 1.0 per process), a FIXED 512 images per GPU: the global "
                  "batch grows with the GPUs, so each epoch has fewer optimizer steps. `--lr-scaling linear` multiplies "
                  "the lr by the GPUs, with a linear warm-up.",
                  ["GPUs", "global batch", "lr scaling", "warm-up steps", "data"] + [f"epoch {i}" for i in range(1, n + 1)])
    for r in rs:
        if r["status"] != "ok":
            lines.append(_failed(r, [str(r["gpus"]), "-", r["variant"][3:], "-", DATA[r["data"]]], max(n - 1, 0)))
            continue
        accs = [f"{e['test_accuracy']:.4f}" for e in r["epochs"]] + ["-"] * (n - len(r["epochs"]))
        lines.append(f"| {r['gpus']} | {r['args']['batch_size'] * r['world_size']} | {r['args']['lr_scaling']} | "
                     f"{r['args']['warmup_steps']} | {DATA[r['data']]} | " + " | ".join(accs) + " |")
    return lines


def _baseline(rows, r):
    for b in rows:
        if b["status"] == "ok" and b["gpus"] == 1 and \
                (b["lesson"], b["path"], b["bs"], b["data"]) == (r["lesson"], r["path"], r["bs"], r["data"]):
            return b
    return None


def throughput(rows, measured_on):
    rs = sorted(_suite(rows, "throughput"), key=lambda r: (r["lesson"], r["path"], r["gpus"]))
    lines = _head("Throughput", rs, measured_on,
                  "s/epoch is the fastest epoch (60k images); epoch 1 is timed after the warm-up and shown apart. "
                  "images/s counts all GPUs together; scaling compares with the same lesson and data path on 1 GPU. "
                  "fp32 (TF32 matmuls) everywhere.",
                  ["lesson", "GPUs", "batch per GPU", "data path", "data", "s/epoch", "epoch 1 s", "warm-up s",
                   "images/s", "scaling vs 1 GPU", "peak memory per GPU", "test accuracy"])
    for r in rs:
        before = [LESSON_NAMES[r["lesson"]], str(r["gpus"]), str(r["bs"]), r["path"], DATA[r["data"]]]
        if r["status"] != "ok":
            lines.append(_failed(r, before, 6))
            continue
        base = _baseline(rs, r)
        scale = f"{r['images_per_second'] / base['images_per_second']:.2f}x" if base else "-"
        lines.append("| " + " | ".join(before) + f" | {r['seconds_per_epoch']:.2f} | {r['epoch1_seconds']:.2f} | "
                     f"{_f(r['warmup_seconds'])} | {r['images_per_second']:,.0f} | {scale} | "
                     f"{_mib(r['peak_memory_bytes'])} | {r['final_accuracy']:.4f} |")
    return lines


def dp(rows, measured_on):
    rs = sorted(_suite(rows, "dp"), key=lambda r: r["gpus"])
    lines = _head("DataParallel (lesson 03): one process, the GPU-to-GPU path it uses", rs, measured_on,
                  "One epoch capped at a few optimizer steps (DataLoader, 64 images per GPU). The path is what lesson 03 "
                  "printed: DataParallel copies inputs, weights and outputs through GPU 0 at every step.",
                  ["GPUs", "batch per GPU", "steps", "data", "images/s", "vs the same script on 1 GPU", "GPU-to-GPU path"])
    one = next((r for r in rs if r["gpus"] == 1 and r["status"] == "ok"), None)
    for r in rs:
        if r["status"] != "ok":
            lines.append(_failed(r, [str(r["gpus"]), str(r["bs"]), "-", DATA[r["data"]]], 2))
            continue
        steps = r["args"].get("max_steps") or "epoch"
        vs = f"{r['images_per_second'] / one['images_per_second']:.2f}x" if one and r is not one else "-"
        path = "<br>".join(line.replace("|", "/") for line in r.get("gpu_paths") or []) or \
            ("one GPU" if r["gpus"] == 1 else "not printed (CPU, or a single device)")
        lines.append(f"| {r['gpus']} | {r['bs']} | {steps} | {DATA[r['data']]} | {r['images_per_second']:,.0f} | {vs} | "
                     f"{path} |")
    return lines


@lru_cache(maxsize=None)
def parameter_count(width: int) -> int:
    import torch
    from common.model import Net, count_parameters
    with torch.device("meta"):  # shapes only: no memory, no time, even for width 10
        return count_parameters(Net(width=width))


def memory_breakdown(r: dict) -> dict:
    """Bytes per GPU: parameters, gradients, optimizer state (fp32, FSDP: 1/N each), data set, and the rest.

    The rest = measured peak minus the others: activations, autocast's bf16 weight copies, FSDP's all-gathered
    layers and unsharded gradients before the reduce-scatter, communication buckets, allocator rounding.
    """
    n, args = parameter_count(r["width"]), r.get("args") or {}
    shards = r["gpus"] if r["lesson"] == "05" else 1
    out = {"parameters": 4 * n / shards, "gradients": 4 * n / shards,
           "optimizer state": OPTIMIZER_STATE_BYTES[args.get("optimizer") or "adadelta"] * n / shards,
           "data set": 0.0}
    if args.get("data_on_device", True):  # every rank holds the whole set; the sampler only picks indices
        out["data set"] = IMAGE_BYTES * ((args.get("train_samples") or MNIST_SIZES[0]) + (args.get("test_samples") or MNIST_SIZES[1]))
    peak = r.get("peak_memory_bytes")
    out["activations and the rest"] = None if peak is None else peak - sum(out.values())
    return {"n_parameters": n, "peak": peak, **out}


def memory(rows, measured_on):
    rs = sorted(_suite(rows, "memory"), key=lambda r: (r["precision"], r["width"], r["lesson"]))
    lines = _head("Memory per GPU: DDP against FSDP2, like for like (2 GPUs, 30 steps)", rs, measured_on,
                  "30 training steps of 512 images per GPU, then the test set in batches of 512. "
                  "Peak = `torch.cuda.max_memory_allocated` on rank 0. Parameters, gradients and optimizer state "
                  "(Adadelta: 2 fp32 buffers) are computed from the parameter count, fp32 in both precisions (FSDP2: "
                  "1/2 of each per GPU); the data set is the whole MNIST on every GPU; the rest is the peak minus all "
                  "of these. bf16 = `--amp` in both lessons.",
                  ["width", "parameters", "precision", "lesson", "data", "peak per GPU", "parameters", "gradients",
                   "optimizer state", "data set", "activations and the rest", "peak vs DDP"])
    for r in rs:
        before = [str(r["width"]), f"{parameter_count(r['width']) / 1e6:.1f} M", r["precision"],
                  LESSON_NAMES[r["lesson"]], DATA[r["data"]]]
        if r["status"] != "ok":
            lines.append(_failed(r, before, 6))
            continue
        b = memory_breakdown(r)
        ddp = next((d for d in rs if d["lesson"] == "04" and d["status"] == "ok" and
                    (d["width"], d["precision"], d["data"]) == (r["width"], r["precision"], r["data"])), None)
        ratio = f"{r['peak_memory_bytes'] / ddp['peak_memory_bytes']:.2f}" \
            if ddp and ddp["peak_memory_bytes"] and r["peak_memory_bytes"] else "-"
        lines.append("| " + " | ".join(before + [_mib(b["peak"])] + [_mib(b[k]) for k in
                     ("parameters", "gradients", "optimizer state", "data set", "activations and the rest")]) +
                     f" | {ratio} |")
    return lines


SECTIONS = (recipe, classic, scaling, throughput, dp, memory)
