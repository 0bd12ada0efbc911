"""The page's section on lesson 08's model class, from the llm suites' rows (benchmarks/llm_suites.py): tokens/s and
MFU, the matmul ceiling, what limits the step, float8, and will_it_fit.py's verdict at the margin. With no llm rows
the section is left out, and the page is as the MNIST suites write it.

Targets (compiled rows, H100 or H200): MFU at least 55% for the hidden-4096 shape on 2 GPUs and more, at least 43%
for the 1.1 B shape on any count.
"""
from __future__ import annotations

from benchmarks.tables import of, table, verdict

TARGETS = {"h4096": (2, 0.55), "1.1B": (1, 0.43)}  # shape: (from this many GPUs, MFU at least)
SUITES = ("llm_speed", "llm_trace", "llm_fp8", "llm_fit")
RUN = ("device_name", "driver", "torch", "commit", "date")
INTRO = (
    "`benchmarks/bench.py --suite llm` (`benchmarks/llm_suites.py`): `LlamaForCausalLM` built from its config (no "
    "download), trained on synthetic tokens (each sequence a random 64-token segment repeated: a copy task), sequence "
    "2,048; `fully_shard` per decoder layer, then the root, bf16 parameters, fp32 gradient reduction, AdamW. Shapes: "
    "**1.1B** is TinyLlama's (hidden 2,048, 22 layers, intermediate 5,632, 32 heads, 4 key/value heads, vocabulary "
    "32,000); **h4096** is 8 layers of hidden 4,096 (intermediate 14,336, 32 heads, 8 key/value heads, vocabulary "
    "32,000; 2.0 B parameters). A run takes 3 untimed warm-up steps (the compiling happens there), then 10 timed "
    "between two `torch.cuda.synchronize`. The batch per GPU is the largest that `08_your_model/will_it_fit.py` says "
    "fits the GPU (fsdp2).",
    "**MFU** = (6 N + 12 L a s) x tokens/s per GPU / peak (`08_your_model/flops.py`): N the parameters without the "
    "input embedding (a lookup; lm_head, a matmul, counts), L layers, a = heads x head_dim (here the hidden size: "
    "32 x 64 and 32 x 128), s = 2,048. **Peak**: 989.4 TFLOP/s, "
    "the dense bf16 figure of an H100 SXM (an H200 has the same). **Ceiling**, the second denominator: the best bf16 "
    "`torch.mm` of the sweep on the same GPUs (the launch's own).")


def gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.1f}"


def pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def run_of(r: dict) -> tuple:
    return tuple(r.get(k) for k in RUN)


def measured(rows: list[dict]) -> str:
    runs = sorted({run_of(r) for r in rows}, key=str)
    return "_Measured on " + "; ".join(f"{g}, driver {d}, torch {t}, course commit {c}, {day}" for g, d, t, c, day
                                      in runs) + (" (CPU smoke mode: not a result)" if any(r.get("quick") for r in rows)
                                                  else "") + "._"


def part(title: str, note: str, rows: list[dict], head: list[str], body: list[list]) -> list[str]:
    return [f"### {title}", "", note, ""] + (["_Not measured in these rows._"] if not rows else
                                             [measured(rows), ""] + table(head, body)) + [""]


def ceiling(rows: list[dict], r: dict) -> float | None:
    """The best TFLOP/s of the matmul sweep in r's run and launch."""
    best = [m["tflops"] for m in of(rows, "llm_speed", program="matmul", gpus=r["gpus"]) if run_of(m) == run_of(r)]
    return max(best) * 1e12 if best else None


def target(r: dict) -> str:
    gpus, least = TARGETS.get(r["program"], (None, None))
    if not r.get("compile") or least is None or r["gpus"] < gpus or r.get("mfu") is None:
        return "-"
    return f"{verdict(r['mfu'] >= least)} ({least:.0%})"


def card(row) -> str:
    """The GPU a row ran on, short ("H100", "H200"): rows of several runs share a table."""
    name = row.get("device_name") or "-"
    return next((word for word in name.split() if word[:1] in "ABHL" and word[1:2].isdigit()), name)


def speed(rows, fast):
    sweep = sorted(of(rows, "llm_speed", program="matmul"), key=lambda r: (r["gpus"], -r["n"]))
    fast = sorted(fast, key=lambda r: (r["program"], r["gpus"], not r.get("compile")))

    def of_ceiling(r):
        top = ceiling(rows, r)
        return pct(r["mfu"] * r["peak_flops"] / top) if top and r.get("mfu") is not None else "-"
    allocator = ", ".join(sorted({f"`{r.get('allocator')}`" for r in fast}))
    return part("Tokens/s and MFU", "Per GPU. Compile: `torch.compile` of each decoder layer and of the loss; eager: "
                "neither. Estimate: will_it_fit.py's tensors at that batch; allocated and reserved: the peaks "
                "(`torch.cuda.max_memory_allocated`, `max_memory_reserved`). PYTORCH_CUDA_ALLOC_CONF: " + allocator
                +
                " (here and in the next two parts; the verdict's runs below keep the default allocator).", fast,
                ["GPUs", "shape", "compile", "batch per GPU", "tokens/s per GPU", "MFU", "of the ceiling", "s/step",
                 "warm-up s", "estimate GiB", "allocated GiB", "reserved GiB", "target", "GPU"],
                [[r["gpus"], r["program"], "per layer + loss" if r.get("compile") else "eager", r["batch"],
                  f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else r["outcome"], pct(r.get("mfu")),
                  of_ceiling(r), f"{r['step_s']:.3f}" if r.get("step_s") else "-",
                  f"{r['warmup_s']:.0f}" if r.get("warmup_s") else "-", gib(r.get("estimate")),
                  gib(r.get("peak_allocated")), gib(r.get("peak_reserved")), target(r), card(r)] for r in fast]) + part(
        "The matmul ceiling", "`torch.mm` of two random bf16 n x n matrices, the best of 10 after 3 warm-up products, "
        "on the first GPU of each launch.", sweep, ["GPUs in the launch", "n", "TFLOP/s", "of the 989.4 peak", "GPU"],
        [[r["gpus"], r["n"], f"{r['tflops']:.0f}", pct(r["tflops"] / 989.4), card(r)] for r in sweep])


def limits(rows):
    rs = sorted(of(rows, "llm_trace"), key=lambda r: (r["gpus"], r["order"]))
    body, traced = [], [r for r in rs if r.get("shares")]
    for r in rs:
        before = next((p for p in rs if p["gpus"] == r["gpus"] and p["order"] == r["order"] - 1), None)
        gain = f"{r['tokens_per_s'] / before['tokens_per_s']:.2f}x" if before and r.get("tokens_per_s") and \
            before.get("tokens_per_s") else "-"
        body.append([r["gpus"], r["order"], r["change"], r["batch"], f"{r['tokens_per_s']:,.0f}" if
                     r.get("tokens_per_s") else r["outcome"], pct(r.get("mfu")), gain])
    share = lambda s, k: f"{s[k]:.1f} ({s[k] / s['step_ms']:.0%})"  # noqa: E731
    kinds = ("matmul", "attention", "loss", "optimizer", "other", "communication", "exposed_communication", "idle")
    lines = part("What limits the step", "The h4096 shape from a plain start (eager, batch 2, foreach AdamW, every "
                 "layer resharded after forward, transformers' loss), one change at a time, each kept; gain = tokens/s "
                 "over the row before.", rs, ["GPUs", "#", "change", "batch per GPU", "tokens/s per GPU", "MFU",
                                              "gain"], body)
    lines += part("Where the step's time goes", "Two steps under `torch.profiler` after the timed ones, rank 0, the "
                  "first and the last run above; kernels classified by name (`benchmarks/llm_trace.py`); ms per step "
                  "(share of the step). Exposed communication: NCCL kernel time with no compute kernel on any stream; "
                  "idle: no kernel at all.", traced,
                  ["GPUs", "run", "step ms"] + [k.replace("_", " ") for k in kinds],
                  [[r["gpus"], r["change"], f"{r['shares']['step_ms']:.1f}"] + [share(r["shares"], f"{k}_ms")
                                                                                  for k in kinds] for r in traced])
    for r in traced:
        lines += [f"Busiest kernels, {r['gpus']} GPUs, after '{r['change']}': " + "; ".join(
            f"`{name[:60]}` ({kind}, {ms:.1f} ms)" for name, kind, ms in r.get("busiest", [])), ""]
    return lines


def float8(rows):
    rs = of(rows, "llm_fp8")
    skipped = [r for r in rs if r["outcome"] == "skipped"]
    speed8 = sorted((r for r in rs if r.get("float8") and r.get("steps", 0) < 100), key=lambda r: (r["gpus"],
                                                                                                     r["program"]))
    loss = sorted((r for r in rs if r["variant"].startswith("loss")), key=lambda r: (r["gpus"], r["variant"]))

    def against(r):
        bf16 = [b for b in of(rows, "llm_speed", program=r["program"], gpus=r["gpus"], compile=True)
                if run_of(b) == run_of(r) and b.get("tokens_per_s")]
        return f"{r['tokens_per_s'] / bf16[0]['tokens_per_s']:.2f}x" if bf16 and r.get("tokens_per_s") else "-"

    def last(r):
        return sum(r["losses"][-20:]) / len(r["losses"][-20:]) if r.get("losses") else None

    def gap(r):
        bf16 = next((b for b in loss if b["variant"] == "loss bf16" and b["gpus"] == r["gpus"]), None)
        return f"{last(r) / last(bf16) - 1:+.2%}" if bf16 and last(bf16) and last(r) is not None else "-"
    at = lambda r, i: f"{r['losses'][i - 1]:.3f}" if len(r.get("losses") or []) >= i else "-"  # noqa: E731
    return part("float8 training (torchao)", "`torchao.float8.convert_to_float8_training` (every Linear of the decoder "
                "layers; lm_head stays bf16) before `fully_shard` and the per-layer compile, on the rows above: "
                "against bf16 = tokens/s over the compiled bf16 row of the same GPUs and shape. MFU against the bf16 "
                "peak." + "".join(f" Skipped: {r['error']}." for r in skipped), speed8 or skipped,
                ["GPUs", "shape", "recipe", "batch per GPU", "tokens/s per GPU", "against bf16", "MFU",
                 "allocated GiB"],
                [[r["gpus"], r["program"], r["float8"], r["batch"],
                  f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else r["outcome"], against(r),
                  pct(r.get("mfu")), gib(r.get("peak_allocated"))] for r in speed8]) + \
        part("float8's loss against bf16's", "200 steps from the same model, seed and data (h4096, batch 1 per GPU, "
             "eager); the mean loss of the last 20 steps against bf16's. The copy task's loss falls as the model "
             "learns to copy: a float8 curve on bf16's means its casts lost nothing that these steps needed; a gap "
             "that grows with the steps would be rounding that compounds.", loss,
             ["GPUs", "run", "step 1", "step 50", "step 100", "step 200", "last 20 steps", "against bf16"],
             [[r["gpus"], r["variant"][5:], at(r, 1), at(r, 50), at(r, 100), at(r, 200),
               f"{last(r):.3f}" if last(r) is not None else r["outcome"], gap(r)] for r in loss])


def agrees(r: dict) -> str:
    """A capped run agrees with the estimate when it did what its cap says it must: train at the fits total, run out
    of memory at 90% of the tight line (the estimate's tensors and context: below it nothing trains)."""
    if not r.get("cap_bytes"):
        return "-"
    return "yes" if r["outcome"] == ("trained" if "of fits" in r["variant"] else "out of memory") else "**no**"


def fit(rows):
    rs = sorted(of(rows, "llm_fit"),
                key=lambda r: (r["gpus"], r["program"], r["strategy"], -r.get("cap_bytes", float("inf"))))
    ratio = lambda a, b: f"{a / b:.3f}" if a and b else "-"  # noqa: E731
    errors = [f"- {r['gpus']} GPU(s), {r['variant']}: `{r['error']}`" for r in rs if r.get("error")]
    return part("Will it fit, at the margin", "`08_your_model/will_it_fit.py` against the GPU: each case uncapped "
                "first (its peaks, and the context: the device's used memory less the reserved bytes, i.e. CUDA, "
                "cuBLAS and NCCL), then, on one GPU, capped (`torch.cuda.set_per_process_memory_fraction`) at the "
                "estimate's fits total less that context (it must train) and at 90% of the tight line less the "
                "context (it must run out of memory: the tight line is the estimate's tensors and context, below it "
                "nothing trains). Verdict: what will_it_fit.py says of that cap and context; agrees: the run did what "
                "its cap says it must. 3 steps each.", rs,
                ["GPUs", "shape", "strategy", "batch", "run", "estimate GiB", "fits GiB", "tight GiB", "cap GiB",
                 "verdict", "allocated GiB", "reserved GiB", "reserved / allocated", "allocated / estimate",
                 "context GiB", "outcome", "agrees"],
                [[r["gpus"], r["program"], r["strategy"], r["batch"], r["variant"].partition(" ")[2],
                  gib(r["estimate"]), gib(r["fits_line"]), gib(r["tight_line"]), gib(r.get("cap_bytes")),
                  r.get("verdict") or "-", gib(r.get("peak_allocated")), gib(r.get("peak_reserved")),
                  ratio(r.get("peak_reserved"), r.get("peak_allocated")), ratio(r.get("peak_allocated"), r["estimate"]),
                  gib(r.get("context")), r["outcome"], agrees(r)] for r in rs]) + errors + ([""] if errors else [])


def section(rows):
    if not any(r["suite"] in SUITES for r in rows):
        return []
    fast = [r for r in of(rows, "llm_speed") if r["program"] != "matmul"]
    return ["## Lesson 08's model class", ""] + [p + "\n" for p in INTRO] + speed(rows, fast) + limits(rows) + \
        float8(rows) + fit(rows)
