r"""The pipeline bubble of lesson 07, predicted and measured: how long each rank waits while the pipeline fills and
drains, and how many micro-batches' activations each stage holds at once.

Predicted: GPipe and 1F1B idle (p - 1) / (m + p - 1) of a step on p stages with m micro-batches (the same bubble:
1F1B only reorders the backwards), interleaved with v stages per rank (p - 1) / (v m + p - 1). GPipe keeps all m
micro-batches' activations until the backwards start; 1F1B at most p - rank of them (p on rank 0).
Measured: each forward and backward of each micro-batch timed on each rank; idle = 1 - busy / step time. From the
course folder (a table; --plot draws the timelines):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 07_pipeline_parallel/bubble.py --microbatches 1 2 4 8 \
        --plot runs/bubble.png
    python 07_pipeline_parallel/bubble.py --predict      # the formulas alone, no processes
"""
import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the course folder: `common` without pip install
sys.path.insert(1, str(Path(__file__).resolve().parent))  # this folder, also when this file is imported from elsewhere

import torch
import torch.distributed as dist

import trainer.pp as pipeline  # the trainer's build (stages on the meta device) and make_schedule: all 4 schedules
from common.errors import CourseError
from common.exits import run
from torch_floor import require_torch_2_10

INTERLEAVED = {"interleaved": 2, "zb": 2}  # stages per rank; gpipe and 1f1b: 1


def predict_idle(schedule: str, p: int, m: int) -> float:
    """The fraction of a step each rank idles: p - 1 slots of fill and drain among its v m busy ones."""
    v = INTERLEAVED.get(schedule, 1)
    return (p - 1) / (v * m + p - 1)


def predict_idle_stages(busy: list[float], m: int) -> list[float]:
    """Unequal stages (GPipe, 1F1B): each micro-batch waits for the slowest stage, whose time t_max sets the pace.
    A step lasts about (m - 1) t_max + sum(t); rank r works m t_r of it. Equal t_r: the formula above."""
    per_mb = [b / m for b in busy]  # forward + backward of one micro-batch, rank by rank
    step = (m - 1) * max(per_mb) + sum(per_mb)
    return [1 - m * t / step for t in per_mb]


def held_microbatches(schedule: str, p: int, m: int, rank: int = 0) -> int | None:
    """Micro-batches whose activations a stage holds at its peak: GPipe all m, 1F1B at most p - rank in flight.
    Interleaved schedules run more forwards before their first backward: not modelled here (None)."""
    if schedule in INTERLEAVED:
        return None
    return m if schedule == "gpipe" else min(m, p - rank)


def balanced_blocks(blocks: int, stages: int, hidden: int) -> list[range]:
    """The formulas assume equal stages; the lesson's cut is not (stage 0 holds the convolutions and fc1). This one
    gives stage 0 fewer blocks, so that each stage does about the same multiply-adds per image."""
    head, block = 32 * 9 * 26 * 26 + 64 * 32 * 9 * 24 * 24 + 9216 * hidden, hidden * hidden  # convs + fc1; a block
    first = max(0, min(blocks, round(((head + blocks * block) / stages - head) / block)))
    rest, others = blocks - first, stages - 1
    sizes = [first] + [rest // others + (s >= others - rest % others) for s in range(others)]
    return [range(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(stages)]


def _timed(method, kind: str, events: list, device: torch.device):
    """The stage's own method, recording (kind, micro-batch, start, end) around it."""
    @functools.wraps(method)
    def wrapper(chunk_id, *args, **kwargs):
        start = time.perf_counter()
        result = method(chunk_id, *args, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the GPU's work, not just its launch
        events.append((kind, chunk_id, start, time.perf_counter()))
        return result
    return wrapper


def measure(schedule: str, microbatches: int, device="cpu", steps: int = 3, blocks: int = 24, hidden: int = 1024,
            batch: int = 32, seed: int = 1, balance: bool = True) -> dict:
    """Time `steps` training steps of lesson 07's pipeline, as trainer/pp.py builds it (the first is a warm-up, not counted) on the ranks of the
    current process group (one pipeline: pp = world size). Every rank must call it; every rank gets the same row:
    s/step, idle measured (mean over ranks, and per rank), idle predicted, peak GPU memory (None on CPU), timelines.
    balance: stages of equal work (balanced_blocks), else the lesson's own cut."""
    from argparse import Namespace

    from torch.distributed.device_mesh import init_device_mesh

    if steps < 2:
        raise ValueError(f"steps={steps}: the first step is a warm-up, measure needs 2 or more")
    L, device = pipeline, torch.device(device)
    p = dist.get_world_size()
    mesh = init_device_mesh(device.type, (p, 1), mesh_dim_names=("pp", "dp"))
    args = Namespace(pp_schedule=schedule, blocks=blocks, hidden=hidden, width=1, seed=seed, compile=None,
                     microbatches=microbatches)
    cut = L.stage_blocks
    L.stage_blocks = functools.partial(balanced_blocks, hidden=hidden) if balance else cut
    try:
        stages, ids, count, model, _ = L.build(args, mesh, device)
    finally:
        L.stage_blocks = cut
    pipe = L.make_schedule(args, stages, ids, count, mesh["pp"].get_group(), device, training=True)
    events: list = []
    for stage in getattr(pipe, "_stages", None) or [pipe._stage]:  # the PipelineStages the schedule drives
        stage.forward_one_chunk = _timed(stage.forward_one_chunk, "F", events, device)
        stage.backward_one_chunk = _timed(stage.backward_one_chunk, "B", events, device)
        stage.backward_weight_one_chunk = _timed(stage.backward_weight_one_chunk, "W", events, device)
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 1, 28, 28, generator=g).to(device)
    labels = torch.randint(0, 10, (batch,), generator=g).to(device)
    first, last = 0 in ids, count - 1 in ids
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    walls, busy, timeline = [], [], []
    for step in range(steps):
        events.clear()
        dist.barrier()  # the ranks start each step together
        start = time.perf_counter()
        pipe.step(*[images] * first, target=labels if last else None, return_outputs=False)
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()  # ...and the step ends when the last rank is done
        if step:  # the first step infers shapes and warms up: not counted
            walls.append(time.perf_counter() - start)
            busy.append(sum(end - begin for _, _, begin, end in events))
            timeline = [(kind, mb, begin - start, end - start) for kind, mb, begin, end in events]
    mine = {"idle": 1 - sum(busy) / sum(walls), "busy": sum(busy) / len(busy), "wall": sum(walls) / len(walls),
            "timeline": timeline, "stages": ids,
            "peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    every = [None] * p
    dist.all_gather_object(every, mine)  # every rank's numbers to every rank
    return {"schedule": schedule, "microbatches": microbatches, "pp": p, "device": str(device),
            "s_per_step": max(r["wall"] for r in every), "idle_measured": sum(r["idle"] for r in every) / p,
            "idle_per_rank": [r["idle"] for r in every], "idle_predicted": predict_idle(schedule, p, microbatches),
            "idle_predicted_per_rank": predict_idle_stages([r["busy"] for r in every], microbatches),
            "held_microbatches": [held_microbatches(schedule, p, microbatches, r) for r in range(p)],
            "peak_memory_bytes": [r["peak"] for r in every], "timelines": [r["timeline"] for r in every],
            "stages": [r["stages"] for r in every]}


def sweep(schedule: str, microbatches: list[int], steps: int = 3, blocks: int = 8, hidden: int = 256,
         batch: int = 32) -> list[dict]:
    """measure() for each micro-batch count, on the ranks of this launch (one pipeline of world-size stages): the
    notebook and exercise 1 start it in 2 gloo processes with common.launcher.launch."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return [measure(schedule, m, "cpu", steps=steps, blocks=blocks, hidden=hidden, batch=batch) for m in microbatches]


def table(rows: list[dict]) -> str:
    """Idle fractions: the balanced formula, then per rank predicted from each stage's measured time and measured."""
    lines = [f"{'schedule':<12} {'m':>3} {'balanced':>8}  {'per rank: predicted':<20} {'measured':<16} "
             f"{'s/step':>8}  held micro-batches per rank"]
    for r in rows:
        predicted, measured = (" ".join(f"{x:.2f}" for x in r[k]) for k in ("idle_predicted_per_rank", "idle_per_rank"))
        lines.append(f"{r['schedule']:<12} {r['microbatches']:>3} {r['idle_predicted']:>8.3f}  {predicted:<20} "
                     f"{measured:<16} {r['s_per_step']:>8.4f}  {r['held_microbatches']}")
    return "\n".join(lines)


def plot(rows: list[dict], path) -> None:
    """One timeline per row: a line per rank, forwards blue, backwards orange, weight backwards green (the legend
    says so); white is idle."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.patches import Patch

    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    names = {"F": "forward", "B": "backward", "W": "weight backward"}
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.5 + 0.5 * rows[0]["pp"] * len(rows)), squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        for rank, events in enumerate(r["timelines"]):
            for kind, mb, begin, end in events:
                ax.broken_barh([(begin * 1e3, (end - begin) * 1e3)], (rank - 0.4, 0.8), color=colors[kind])
                ax.text((begin + end) / 2 * 1e3, rank, str(mb), ha="center", va="center", fontsize=7)
        ax.set(yticks=range(r["pp"]), yticklabels=[f"rank {k}" for k in range(r["pp"])], xlabel="ms")
        ax.invert_yaxis()
        ax.set_title(f"{r['schedule']}, {r['microbatches']} micro-batches: idle {r['idle_measured']:.0%} measured, "
                     f"{r['idle_predicted']:.0%} predicted", fontsize=9)
    kinds = sorted({kind for r in rows for t in r["timelines"] for kind, *_ in t}, key="FBW".index)
    fig.legend(handles=[Patch(color=colors[k], label=f"{names[k]} of micro-batch n") for k in kinds]
               + [Patch(facecolor="white", edgecolor="grey", label="idle: the bubble")],
               loc="upper center", ncol=len(kinds) + 1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # room for the legend at the top
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--microbatches", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--stages", type=int, default=2, help="p for --predict (default: 2)")
    parser.add_argument("--predict", action="store_true", help="the formulas only, no processes")
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lesson-cut", action="store_true", help="the lesson's stages, not balanced ones")
    parser.add_argument("--plot", metavar="PNG", help="draw the measured timelines")
    args = parser.parse_args(argv)
    if args.predict:
        for s in args.schedules:
            for m in args.microbatches:
                print(f"{s:<12} p {args.stages} m {m:>3}: idle {predict_idle(s, args.stages, m):.3f}, held micro-"
                      f"batches {[held_microbatches(s, args.stages, m, r) for r in range(args.stages)]}")
        return
    require_torch_2_10()
    dist.init_process_group("gloo")
    rows = []
    for s in args.schedules:
        for m in args.microbatches:
            try:
                rows.append(measure(s, m, "cpu", blocks=args.blocks, hidden=args.hidden, batch=args.batch_size,
                                    balance=not args.lesson_cut))
            except CourseError as e:  # e.g. 1F1B needs as many micro-batches as stages: every rank skips it
                print(f"skipped: {e}") if dist.get_rank() == 0 else None
    if dist.get_rank() == 0:
        print(table(rows))
        if args.plot:
            plot(rows, args.plot)
            print(f"timelines: {args.plot}")
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
