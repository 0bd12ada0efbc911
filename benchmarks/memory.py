"""CUDA memory over time, by what it holds, from a torch.cuda.memory._record_memory_history snapshot.

The pickle itself opens in https://pytorch.org/memory_viz (every block with its stack); the PNG is the summary a
page can quote: GiB allocated against seconds, stacked by category (parameters, data, gradients, optimizer state,
activations, FSDP2's gathered units), with the cap as a line and the OOM, if any, marked where it struck.
"""
from __future__ import annotations

import pickle

BEFORE = "before recording"
CATEGORIES = (BEFORE, "parameters", "data", "optimizer state", "gradients", "gathered units", "activations", "other")


def categorize(entry: dict) -> str:
    """What an alloc entry is for, from its Python frames (stacks="python"); the first rule that matches wins."""
    frames = entry.get("frames") or []
    if not frames:  # backward kernels run on the autograd engine's own C++ thread: no Python stack at all
        return "gradients"
    files, names = [f["filename"] for f in frames], {f["name"] for f in frames}
    if any("torch/optim/" in f for f in files):  # AdamW's _init_group (exp_avg, exp_avg_sq) and its step's temporaries
        return "optimizer state"
    if names & {"unshard", "wait_for_unshard"}:  # FSDP2's all-gather buffer and unsharded parameters, forward and
        return "gathered units"                  # backward (prefetch); freed again at reshard
    if names & {"post_backward", "_ddp_init_helper", "_make_grads"}:  # FSDP2's reduce-scatter buffers (a Python
        return "gradients"  # hook), DDP's buckets (the .grad views, gradient_as_bucket_view=True), the loss's seed grad
    if any(f.endswith("common/loaders.py") for f in files):  # DeviceLoader: the data set on the GPU, its shuffles
        return "data"
    if names & {"to", "to_empty", "fully_shard", "distribute_tensor", "_sync_module_states"}:  # Module.to, FSDP2's
        return "parameters"  # to_empty + init_weights' distribute_tensor (built on meta), DDP's broadcast from rank 0
    if any("torch/nn/" in f for f in files):  # what is left under a module or nn.functional: forward outputs
        return "activations"
    return "other"  # barriers, the checkpoint's gathered state dict, small tensors made in the lesson's own code


def _bytes(size: int) -> int:
    """What the allocator counts (max_memory_allocated) for a request: the trace records the requested size."""
    return max(512, -(-size // 512) * 512)


def _before(snapshot: dict, trace: list, device: int) -> int:
    """Bytes allocated before recording began: frees of addresses the trace never allocated, plus blocks still
    allocated at the dump that the trace did not allocate (they appear only in snapshot["segments"])."""
    live, freed_unknown = set(), 0
    for e in trace:
        if e["action"] == "alloc":
            live.add(e["addr"])
        elif e["action"] == "free_completed":
            if e["addr"] in live:
                live.remove(e["addr"])
            else:
                freed_unknown += _bytes(e["size"])
    still = sum(_bytes(b["requested_size"]) for s in snapshot["segments"] if s["device"] == device
                for b in s["blocks"] if b["state"] == "active_allocated" and b["address"] not in live)
    return freed_unknown + still


def timeline(snapshot: dict, device: int = 0) -> tuple[list[float], dict[str, list[int]], list[float]]:
    """Replay the trace: seconds since the first event, bytes per category after each alloc/free, the OOMs' seconds.
    A block counts until free_completed (as torch.cuda._memory_viz.trace does), not free_requested."""
    trace = snapshot["device_traces"][device]
    t0 = trace[0].get("time_us", 0) if trace else 0
    now = {c: 0 for c in CATEGORIES}
    now[BEFORE] = _before(snapshot, trace, device)
    live, seconds, bands, ooms = {}, [0.0], {c: [now[c]] for c in CATEGORIES}, []
    for i, e in enumerate(trace):
        t = (e["time_us"] - t0) / 1e6 if "time_us" in e else float(i)  # old snapshots: the event's index
        if e["action"] == "alloc":
            category, size = live[e["addr"]] = categorize(e), _bytes(e["size"])
            now[category] += size
        elif e["action"] == "free_completed":
            category, size = live.pop(e["addr"], (BEFORE, _bytes(e["size"])))
            now[category] -= size
        elif e["action"] == "oom":
            ooms.append(t)
        else:
            continue  # segment_alloc/free (reserved, not allocated), free_requested, annotate
        seconds.append(t)
        for c in CATEGORIES:
            bands[c].append(now[c])
    return seconds, bands, ooms


def draw(pickle_path, png_path, title: str, cap_gib: float | None = None, device: int = 0) -> dict[str, int]:
    """The stacked plot of one snapshot; returns each category's peak bytes and "total" (the peak of the sum, which
    is at most the sum of the peaks: categories peak at different moments)."""
    import matplotlib
    matplotlib.use("Agg")  # files only: GPU nodes have no display
    import matplotlib.pyplot as plt
    with open(pickle_path, "rb") as f:
        snapshot = pickle.load(f)
    seconds, bands, ooms = timeline(snapshot, device)
    shown = [c for c in CATEGORIES if any(bands[c])]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.stackplot(seconds, [[b / 2**30 for b in bands[c]] for c in shown], labels=shown, step="post",
                 colors=[f"C{CATEGORIES.index(c)}" for c in shown])  # the same colour per category in every plot
    if cap_gib is not None:
        ax.axhline(cap_gib, color="black", ls="--", lw=1, label=f"cap {cap_gib:g} GiB")
    for t in ooms:
        ax.axvline(t, color="red", lw=1.5)
        ax.annotate("OOM", (t, 1), xycoords=("data", "axes fraction"), xytext=(-4, -4), textcoords="offset points",
                    ha="right", va="top", color="red", fontweight="bold")
    ax.set(xlabel="seconds since the first recorded event", ylabel="GiB allocated", title=title,
           xlim=(0, seconds[-1] or 1))
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    totals = [sum(bands[c][i] for c in CATEGORIES) for i in range(len(seconds))]
    return {**{c: max(bands[c]) for c in shown}, "total": max(totals)}


def section(out, cap_gib: float | None) -> list[str]:
    """The page's lines for the snapshots the fsdp_oom suite left in `out` (memory_05.pickle, memory_04.pickle)."""
    lines = []
    for path in sorted(out.glob("memory_*.pickle"), reverse=True):  # lesson 05 (fits) first, then 04 (OOM)
        lesson = path.stem.split("_")[1]
        name = {"05": "lesson 05 (FSDP2)", "04": "lesson 04 (DDP)"}.get(lesson, path.stem)
        peaks = draw(path, out / f"{path.stem}.png", f"{name}, rank 0, by what the memory holds", cap_gib)
        lines += [f"#### {name}: memory over time", "", f"![{path.stem}]({path.stem}.png)", "",
                  f"Snapshot: [`{path.name}`]({path.name}) (open it in https://pytorch.org/memory_viz: every block "
                  "with its Python stack). Peak of each category and of their sum, MiB:", "",
                  "| " + " | ".join(peaks) + " |", "|" + "---|" * len(peaks),
                  "| " + " | ".join(f"{b / 2**20:,.0f}" for b in peaks.values()) + " |", ""]
    if lines:
        lines = ["### Memory over time, by category", "", "The runs above, recorded with "
                 "`torch.cuda.memory._record_memory_history(stacks=\"python\")` and dumped on rank 0 "
                 "(`benchmarks/suites.py: snapshot`). Each allocation is put in a category by its Python stack "
                 "(`benchmarks/memory.py: categorize`): none (the autograd engine's thread) is a gradient, "
                 "`torch/optim` optimizer state, FSDP2's `unshard` gathered units, `torch/nn` activations.", ""] + lines
    return lines
