"""The page's building blocks (a row's stamp, tables, verdicts, what a run's epochs say), its targets, and the sections
without a ratio against another program (benchmarks/against.py writes those): rows in, markdown lines out. A suite
without rows says so.

Targets, each a ratio within one run (one stamp), on every GPU count measured (1, 2 and 4 on a 4-GPU host):
  * lesson 04's step (median s/epoch) at most 1.10x the plain loop's, and its time to 99% at most 1.10x the plain
    loop's with lesson 04's mean final test accuracy at least 99.1%: each the MEDIAN over at least 3 rounds (seeds
    1-5; a round: one seed's lesson 04 run and the plain loop's run of that seed right after it) of the round's
    ratio, the spread (min-max) beside it;
  * lesson 04's DataLoader scaling (images/s on N GPUs over images/s on 1 GPU, batch 64 per GPU) at least 0.95x
    the peer's (benchmarks/peer_ddp.py: a hand-written DataLoader + DDP loop) on every GPU count above one.
"""
from __future__ import annotations

import statistics

STEP_RATIO, TIME_RATIO, FINAL_ACCURACY, ACCURACY, PEER_SCALING, MIN_ROUNDS = 1.10, 1.10, 0.991, 0.99, 0.95, 3
INF = float("inf")  # 99% not reached: a median time of runs that mostly missed it; a round's ratio where 04 did
NAMES = {"02": "lesson 02 (one GPU)", "03": "lesson 03 (DataParallel)", "04": "lesson 04 (DDP)",
         "05": "lesson 05 (FSDP2)", "plain": "plain loop", "reference": "reference script"}
STAMP = ("device_name", "driver", "torch", "commit", "date", "data")


def stamp(r: dict) -> tuple:
    return tuple(r.get(k) for k in STAMP)


def measured_on(rows: list[dict]) -> str:
    """One line naming every machine/commit the rows come from."""
    runs = sorted({stamp(r) + (r.get("quick"),) for r in rows}, key=str)
    text = "; ".join(f"{gpu}, driver {driver}, torch {torch}, course commit {commit}, {date}, "
                     f"{'real MNIST' if data == 'mnist' else 'SYNTHETIC digits'}"
                     + (" (CPU smoke mode: not a result)" if quick else "")
                     for gpu, driver, torch, commit, date, data, quick in runs)
    return f"_Measured on {text}._" + (" **Rows of different runs: compare with care.**" if len(runs) > 1 else "")


def of(rows, suite, **match) -> list[dict]:
    return [r for r in rows if r["suite"] == suite and all(r.get(k) == v for k, v in match.items())]


def table(head: list[str], body: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(str(c) for c in line) + " |" for line in body]


def block(title: str, note: str, rows: list[dict], head: list[str], body: list[list]) -> list[str]:
    lines = [f"### {title}", "", note, ""]
    return lines + (["_Not measured in these rows._"] if not rows else [measured_on(rows), ""] + table(head, body))


def mib(b) -> str:
    return "-" if not b else f"{b / 2**20:,.0f}"


def summary(epoch_seconds: list, accuracy: list) -> dict:
    """What a run's epochs say: time to 99% (the training seconds of the epochs up to the first whose test
    accuracy reaches it; tested after every epoch), the final accuracy, the median s/epoch. Kept in the row."""
    done, reached = 0.0, None
    for seconds, acc in zip(epoch_seconds, accuracy):
        done += seconds
        if acc >= ACCURACY:
            reached = done
            break
    return {"time_to_99": reached, "final_accuracy": accuracy[-1], "median_epoch_s": statistics.median(epoch_seconds)}


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def speed(rows):
    rs = sorted(of(rows, "throughput"), key=lambda r: (r["variant"], r["program"], r["gpus"]))
    dp = of(rows, "dp")
    one = {r["variant"]: r for r in rs if r["program"] == "02"}
    x02 = lambda r: (f"{r['images_per_second'] / one['dataloader']['images_per_second']:.2f}x"  # noqa: E731
                     if "dataloader" in one and stamp(one["dataloader"]) == stamp(r) else "-")
    return ["## Speed", ""] + block(
        "Throughput", "Training images per second of all GPUs together, in the median epoch of 3 (60,000 images each; the "
        "first also starts the DataLoader's workers); "
        "fp32 with TF32 matmuls.", rs,
        ["program", "GPUs", "data path", "batch per GPU", "s/epoch", "images/s", "peak MiB per GPU"],
        [[NAMES[r["program"]], r["gpus"], r["variant"], r["batch"], f"{r['median_epoch_s']:.3f}",
          f"{r['images_per_second']:,.0f}", mib(r.get("peak_bytes"))] for r in rs]) + [""] + block(
        "DataParallel", "Lesson 03: one process, 64 images per GPU, 100 steps. The path is what it printed; "
        "against lesson 02's DataLoader run (batch 64, one GPU).", dp,
        ["GPUs", "images/s", "against lesson 02", "GPU-to-GPU path"],
        [[r["gpus"], f"{r['images_per_second']:,.0f}", x02(r), "<br>".join(r.get("gpu_paths") or []) or "-"] for r in dp])


def fsdp_memory(rows):
    rs = sorted(of(rows, "fsdp_oom"), key=lambda r: r["program"])
    errors = [f"```\n{r['error']}\n```" for r in rs if r.get("error")]
    return ["## FSDP2 memory", ""] + block(
        "Out of memory under DDP, trained by FSDP2", "The same model (AdamW, 30 steps, data on the GPUs) in each "
        "lesson on 2 GPUs, each process capped at the memory of a smaller card "
        "(`torch.cuda.set_per_process_memory_fraction`). DDP holds 16 bytes per parameter on every GPU (weights, "
        "gradients, AdamW's two buffers); FSDP2 holds half of them per GPU, plus the layers it gathers.", rs,
        ["program", "GPUs", "cap GiB", "parameters", "status", "peak MiB per GPU", "s/step", "test accuracy"],
        [[NAMES[r["program"]], r["gpus"], r.get("cap_gib") or "-", f"{r['parameters'] / 1e6:,.1f} M", r["status"],
          mib(r.get("peak_bytes")), f"{r['s_per_step']:.4f}" if r.get("s_per_step") else "-",
          f"{r['final_accuracy']:.4f}" if r.get("final_accuracy") else "-"] for r in rs]) + \
        (["", "What DDP printed:", ""] + errors if errors else [])


def tools(rows):
    rs = of(rows, "tools")
    growth = sorted((r for r in rs if r["group"] == 0), key=lambda r: (r["hidden"], r["tools"]))
    ratio = []
    for hidden in sorted({r["hidden"] for r in growth}):
        t = {r["tools"]: r for r in growth if r["hidden"] == hidden}
        if {"ddp", "fsdp"} <= set(t) and t["ddp"].get("s_per_step") and t["fsdp"].get("s_per_step"):
            ratio.append([hidden, f"{t['fsdp']['parameters'] / 1e6:,.1f} M", mib(t["ddp"].get("peak_bytes")),
                          mib(t["fsdp"].get("peak_bytes")), f"{t['ddp']['s_per_step']:.4f}",
                          f"{t['fsdp']['s_per_step']:.4f}", f"{t['fsdp']['s_per_step'] / t['ddp']['s_per_step']:.2f}x"])
    each = [r for r in rs if r["group"] != 0]
    return ["## Tools", ""] + block(
        "What each FSDP2 tool holds and costs", "`05_multigpu_fsdp_training/fsdp_memory.py` on 2 GPUs, uncapped: the "
        "largest rank's bytes, the slowest rank's median s/step. Held = weights + gradients + optimizer state of a "
        "rank; peak = `torch.cuda.max_memory_allocated`.", each,
        ["tools", "width", "blocks", "hidden", "batch", "parameters", "held MiB", "peak MiB", "s/step", "status"],
        [[r["tools"], r["width"], r["blocks"], r["hidden"] or "-", r["batch_size"], f"{r['parameters'] / 1e6:,.1f} M"
          if r.get("parameters") else "-", mib(r.get("held_bytes")), mib(r.get("peak_bytes")),
          f"{r['s_per_step']:.4f}" if r.get("s_per_step") else "-", r["status"]] for r in each]) + [""] + block(
        "FSDP2 against DDP as the model grows", "4 blocks of --hidden H, batch 512 per GPU, 2 GPUs: FSDP2's gathers "
        "and reduce-scatters cost most where the model is small.", growth,
        ["--hidden", "parameters", "DDP peak MiB", "FSDP2 peak MiB", "DDP s/step", "FSDP2 s/step", "FSDP2 / DDP"],
        ratio)


def communication(rows):
    ov, bw, par = of(rows, "overlap"), of(rows, "bandwidth"), sorted(of(rows, "parity"), key=lambda r: r["program"])
    return ["## Communication", ""] + block(
        "The gradient all_reduce against backward", "One profiled DDP step per bucket setting, rank 0, batch 512 per "
        "GPU (`benchmarks/overlap.py`). A single step is noisy: read the picture, not the decimals.", ov,
        ["variant", "bucket bytes", "all_reduces", "communication ms", "under compute ms", "step ms"],
        [[r["variant"], r["buckets"], r["comm_kernels"], f"{r['comm_ms']:.3f}", f"{r['overlapped_ms']:.3f}",
          f"{r['step_ms']:.2f}"] for r in ov]) + [""] + block(
        "All-reduce bandwidth per transport", "`troubleshooting/nccl_transports.sh`: NCCL's own choice, then with "
        "peer-to-peer off, then with shared memory off too. Bus bandwidth of float32 all_reduces, 4 KiB to 256 MiB.",
        bw, ["GPUs", "switched off", "NCCL's transport line", "average GB/s", "peak GB/s (at MiB)"],
        [[r["gpus"], f"`{r['env']}`" if r["env"] else "nothing", f"`{r['via'][0]}`" if r["via"] else "-",
          f"{r['avg_busbw']:.1f}", f"{r['peak_busbw']:.1f} ({r['peak_bytes'] / 2**20:g})"]
         for r in bw]) + [""] + block(
        "Parity with pytorch/examples", "Lesson 02's default (14 epochs, DataLoader, batch 64, Adadelta) against the "
        "reference script given to `--reference`, seed 1 each.", par,
        ["program", "seed", "final test accuracy", "best (epoch)", "final test loss"],
        [[NAMES[r["program"]], r["seed"], f"{r['accuracy'][-1]:.2%}", f"{max(r['accuracy']):.2%} "
          f"({r['accuracy'].index(max(r['accuracy'])) + 1})", f"{r['test_loss'][-1]:.4f}"] for r in par if r["accuracy"]])


def tensor_parallel(rows):
    rs = sorted(of(rows, "tp"), key=lambda r: (r["gpus"], ["ddp", "fsdp2", "tp", "2d"].index(r["variant"])))
    return ["## Tensor parallelism", ""] + block(
        "DDP, FSDP2, TP and 2-D on lesson 06's model", "`06_tensor_parallel/tp_gpu_bench.py`: TPNet with the "
        "parameter-heavy head, 64 images per data-parallel rank (TP's ranks share one batch), AdamW, data on the "
        "GPUs; the mean of 20 steps after 5 warm-up steps. 2-D: TP in pairs, FSDP2 across them. Wire MB: "
        "`06_tensor_parallel/comm_bytes.py`'s bytes per rank and step; predicted = wire bytes / the all_reduce bus "
        "bandwidth measured in the same process; profiled = the NCCL kernels' time in 5 profiled steps, waiting "
        "included (docs/communication.md).", rs,
        ["GPUs", "strategy", "parameters", "s/step", "images/s", "peak MiB per GPU", "wire MB/step",
         "predicted comm ms", "profiled comm ms"],
        [[r["gpus"], r["variant"], f"{r['parameters'] / 1e6:,.1f} M", f"{r['s_per_step']:.4f}",
          f"{r['images_per_s']:,.0f}", f"{r['peak_mib']:,.0f}", f"{r['wire_mb_per_step']:,.1f}",
          f"{r['predicted_comm_ms']:.2f}", f"{r['profiled_comm_ms']:.2f}"] for r in rs])

