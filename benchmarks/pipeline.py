"""The page's "Pipeline parallelism" section (the pp suite's rows: 07_pipeline_parallel/pp_gpu_bench.py) and its
timeline pictures, one per GPU count, drawn from the rows by lesson 07's own bubble.plot."""
from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.tables import block, mib, of, stamp

ORDER = ("ddp", "fsdp2", "tp", "pp")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


def pictures(rows: list[dict]) -> dict[int, list[dict]]:
    """{GPUs: the bubble rows to draw}: every schedule that ran, at the most micro-batches measured on that count."""
    ran = [r for r in of(rows, "pp", program="bubble") if r.get("timelines")]
    most = {n: max(r["microbatches"] for r in ran if r["gpus"] == n) for n in {r["gpus"] for r in ran}}
    return {n: [r for r in ran if r["gpus"] == n and r["microbatches"] == m] for n, m in sorted(most.items())}


def draw(out: Path, rows: list[dict]) -> None:
    """OUT/pp_bubble_N.png for each GPU count with bubble rows; stale ones removed."""
    shown = pictures(rows)
    for old in out.glob("pp_bubble_*.png"):
        if old.stem.rpartition("_")[2] not in {str(n) for n in shown}:
            old.unlink()
    if shown:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "07_pipeline_parallel"))
        from bubble import plot
        for n, rs in shown.items():
            plot(rs, out / f"pp_bubble_{n}.png")


def steps(n: int) -> str:
    return f"{n} step{'s' * (n != 1)}"


def ranks(values, fmt) -> str:
    return " / ".join("-" if v is None else fmt(v) for v in values)


def bubble_table(rows):
    rs = sorted(of(rows, "pp", program="bubble"),
                key=lambda r: (r["gpus"], SCHEDULES.index(r["schedule"]), r["microbatches"]))
    size = (f"{rs[0]['blocks']} blocks of {rs[0]['hidden']}, {rs[0]['batch']:,} images a step; the mean of "
            f"{steps(rs[0]['steps'] - 1)} after a warm-up step") if rs else ""
    note = ("`07_pipeline_parallel/bubble.py`'s `measure` (run by the pp suite): lesson 07's Net (" + size + ") cut "
            "into stages of equal work, one per GPU (interleaved and zb: two per GPU, the loop placement), "
            "forwards and backwards only, no optimizer step. Every "
            "forward and backward of every micro-batch is timed on its rank, a CUDA synchronize after each: "
            "measured idle = 1 - busy / step time, the mean over the ranks, each rank's after it (rank 0 first). "
            "Predicted: (p - 1) / (v m + p - 1) for p GPUs, m micro-batches, v stages per GPU. Peak MiB: "
            "`torch.cuda.max_memory_allocated` during the steps, rank by rank (weights, gradients, the activations "
            "held). Held: the micro-batches whose activations a stage holds at most, by the schedule (1F1B: p - "
            "rank; GPipe: all m; not modelled for the interleaved ones). A schedule this torch could not run keeps "
            "its row, with its error. The pictures below: each rank's forwards (blue), backwards (orange) and "
            "weight backwards (green) in the last step, white where it waits.")
    body = [[r["gpus"], r["schedule"], r["microbatches"], f"{r['s_per_step']:.4f}",
             f"{r['idle_measured']:.0%} ({ranks(r['idle_per_rank'], '{:.0%}'.format)})", f"{r['idle_predicted']:.0%}",
             ranks(r["peak_memory_bytes"], mib), ranks(r["held_microbatches"], str), "ok"] if "error" not in r else
            [r["gpus"], r["schedule"], r["microbatches"], "-", "-", "-", "-", "-", f"failed: `{r['error']}`"]
            for r in rs]
    return block("The bubble, per schedule", note, rs, ["GPUs", "schedule", "micro-batches", "s/step",
                                                        "idle measured (per rank)", "idle predicted",
                                                        "peak MiB per GPU", "held micro-batches", "status"], body) + \
        [line for n in pictures(rows) for line in ("", f"![pp_bubble_{n}](pp_bubble_{n}.png)")]


def compare_table(rows):
    rs = sorted(of(rows, "pp", program="compare"),
                key=lambda r: (r["gpus"], r["transport"] != "default", ORDER.index(r["strategy"])))
    pp = next((r for r in rs if r["strategy"] == "pp" and "error" not in r), None)
    how = f"{pp['schedule']} over {pp['microbatches']} micro-batches" if pp else "1F1B"
    note = ("`07_pipeline_parallel/pp_gpu_bench.py`: ONE model, lesson 06's TPNet with its parameter-heavy head "
            f"({rs[0]['blocks']} blocks of 4 x {rs[0]['hidden']}, {rs[0]['parameters'] / 1e6:,.1f} M parameters), "
            f"and ONE global batch of {rs[0]['batch']} images a step for every strategy: DDP and FSDP2 split it over "
            "the GPUs, TP gives every GPU all of it, PP (" + how + ", lesson 07's even cut into one stage per GPU, "
            "its Stage and schedule) sends it through the stages. DDP, FSDP2 and TP as the tensor parallelism "
            "section measures them (`tp_gpu_bench.measure`); AdamW, MNIST on the GPUs, the mean of "
            + "; ".join(sorted({f"{steps(r['steps'])} after {steps(r['warmup'])} of warm-up ({r['transport']})"
                                for r in rs})) + ". Peak MiB: the most allocated during those steps, less what the "
            "process held before the model was built (the training images, copied to the GPU after, count: all of "
            "them on every GPU); PP: its fullest GPU, the others: rank 0. Wire MB: bytes one rank sends a step "
            "(`06_tensor_parallel/comm_bytes.py`'s; PP: the activations forward and their gradients back, of a "
            "middle stage). Bus GB/s: an "
            "all_reduce of 64 MiB in the same processes. NCCL: its default transport (NVLink, peer to peer), or "
            "`NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1` (its sockets), set for a launch of its own.") if rs else ""
    return block("PP against DDP, FSDP2 and TP: one model, one batch", note, rs,
                 ["GPUs", "NCCL", "strategy", "s/step", "images/s", "peak MiB per GPU", "wire MB/step",
                  "bus GB/s"],
                 [[r["gpus"], r["transport"], r["strategy"], f"{r['s_per_step']:.4f}", f"{r['images_per_s']:,.0f}",
                   mib(r["peak_mib"] * 2**20), f"{r['wire_mb_per_step']:,.2f}", f"{r['busbw'] / 1e9:.1f}"]
                  if "error" not in r else [r["gpus"], r["transport"], r["strategy"], f"failed: `{r['error']}`", "-",
                                            "-", "-", f"{r['busbw'] / 1e9:.1f}"] for r in rs])


def link_table(rows):
    rs = [r for r in of(rows, "pp", program="compare") if "error" not in r]
    pairs = []
    for fast in (r for r in rs if r["transport"] == "default"):
        slow = next((r for r in rs if r["transport"] == "sockets" and stamp(r) == stamp(fast)
                     and (r["gpus"], r["strategy"]) == (fast["gpus"], fast["strategy"])), None)
        if slow:
            pairs.append((fast, slow))
    pairs.sort(key=lambda p: (p[0]["gpus"], ORDER.index(p[0]["strategy"])))
    note = ("Where PP pays: the rows above of one run, at NCCL's default transport and over its sockets, a stand-in "
            "for a slow link between nodes (the bus GB/s columns: what each link gave an all_reduce in the same "
            "processes). A pipeline stage sends only activations, point to point; FSDP2 gathers every weight and "
            "reduce-scatters every gradient each step.")
    return block("Where it pays: a slow link", note, [r for p in pairs for r in p],
                 ["GPUs", "strategy", "wire MB/step", "s/step default", "s/step sockets", "sockets / default",
                  "bus GB/s default", "bus GB/s sockets"],
                 [[f["gpus"], f["strategy"], f"{f['wire_mb_per_step']:,.2f}", f"{f['s_per_step']:.4f}",
                   f"{s['s_per_step']:.4f}", f"{s['s_per_step'] / f['s_per_step']:.1f}x", f"{f['busbw'] / 1e9:.1f}",
                   f"{s['busbw'] / 1e9:.1f}"] for f, s in pairs])


def section(rows):
    return ["## Pipeline parallelism", ""] + bubble_table(rows) + [""] + compare_table(rows) + [""] + link_table(rows)
