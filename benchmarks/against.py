"""The page's sections that hold lesson 04 against another program, rows in, markdown lines out: Scaling (against
lesson 02, the peer and the plain loop's step; large batches) and Time to 99% (against the plain loop).

A ratio is taken within one run (one stamp) only. Against the plain loop, round by round: a round is one seed's
lesson 04 run and the plain loop's run of that seed right after it (benchmarks/suites.py: recipe), the verdict on the
median over the rounds. The targets: benchmarks/tables.py.
"""
from __future__ import annotations

import statistics

from benchmarks.tables import (ACCURACY, FINAL_ACCURACY, INF, MIN_ROUNDS, NAMES, PEER_SCALING, STEP_RATIO,
                               TIME_RATIO, block, of, stamp, verdict)


def scaling(rows):
    rs = of(rows, "throughput")
    body = []
    for path in ("dataloader", "on-device"):
        base = {(r["program"], r["gpus"]): r for r in rs if r["variant"] == path}
        l02, l04 = base.get(("02", 1)), base.get(("04", 1))
        for (program, n), r in sorted(base.items()):
            if program == "04" and n > 1:
                vs = lambda a, b: f"{a['images_per_second'] / b['images_per_second']:.2f}x" \
                    if a and b and stamp(a) == stamp(b) == stamp(r) else "-"  # noqa: E731
                body.append([path, n, f"{r['images_per_second']:,.0f}", vs(r, l02), vs(r, l04), vs(l04, l02)])
    big = sorted(of(rows, "scaling"), key=lambda r: (r["variant"], r["gpus"]))
    n = max((len(r["accuracy"]) for r in big), default=0)
    return ["## Scaling", ""] + block(
        "Against lesson 02, the one-GPU program", "Lesson 04 on N GPUs against lesson 02 on one GPU, and against "
        "lesson 04 itself on one GPU (images/s of the throughput rows above).", rs,
        ["data path", "GPUs", "lesson 04 images/s", "against lesson 02 (1 GPU)", "against lesson 04 (1 GPU)",
         "lesson 04 (1 GPU) against lesson 02"], body) + [""] + peer(rows) + [""] + step(rows) + [""] + block(
        "Large batches: test accuracy per epoch", "Lesson 04, data on the GPUs, Adadelta, a fixed 512 images per GPU: "
        "the global batch grows with the GPUs. `lr-linear` multiplies the lr by the GPUs, with a 100-step warm-up.",
        big, ["GPUs", "lr scaling"] + [f"epoch {i + 1}" for i in range(n)],
        [[r["gpus"], r["variant"]] + [f"{a:.4f}" for a in r["accuracy"]] for r in big])


def peer(rows):
    """Lesson 04's DataLoader scaling beside the peer's, GPU count by GPU count, within each run."""
    course, body, used = of(rows, "throughput", program="04", variant="dataloader"), [], []
    for run in sorted({stamp(r) for r in of(rows, "peer")}, key=str):
        mine = {r["gpus"]: r for r in course if stamp(r) == run}
        theirs = {r["gpus"]: r for r in of(rows, "peer") if stamp(r) == run}
        up = lambda side, n: side[n]["images_per_second"] / side[1]["images_per_second"] \
            if n in side and 1 in side else None  # noqa: E731
        for n, r in sorted(theirs.items()):
            a, b = up(mine, n), up(theirs, n)
            status = "-" if n == 1 else "not measured (no lesson 04 scaling in this run)" if a is None else \
                "no 1-GPU peer row in this run" if b is None else verdict(a / b >= PEER_SCALING)
            used += [r] + ([mine[n]] if n in mine else [])
            body.append([n, r["device_name"], f"{mine[n]['images_per_second']:,.0f}" if n in mine else "-", times(a),
                         f"{r['images_per_second']:,.0f}", times(b), times(a / b if a and b else None),
                         f"{r['test_accuracy']:.2%}", status])
    return block("Lesson 04 against a hand-written DDP loop (the peer)", "Images/s of the median epoch of 3, batch "
                 "64 per GPU, a DataLoader: lesson 04's `dataloader` throughput row (its default workers: its share of "
                 "the CPUs, at most 8) and the peer (`benchmarks/peer_ddp.py`: torch and torchvision only; "
                 "torchvision's MNIST, a DistributedSampler, a DataLoader with 8 workers started every epoch and "
                 "pinned memory, pytorch/examples' CNN and Adadelta), in the same launch. Scaling: images/s on N GPUs "
                 f"over images/s on 1 GPU, in the same run. Target: lesson 04's scaling at least {PEER_SCALING:.2f}x "
                 "the peer's on every GPU count above one.", used, ["GPUs", "GPU", "lesson 04 images/s",
                 "lesson 04 scaling", "peer images/s", "peer scaling", "lesson 04 / peer scaling",
                 "peer test accuracy", "target"], body)


def rounds(rows) -> list[tuple[tuple, list[dict], list[tuple[dict, dict]]]]:
    """Per (GPUs, batch x lr, run): lesson 04's recipe runs, and the rounds: each seed's run paired with the plain
    loop's run of that seed in that run (bench.py runs it right after, so a drift of the machine reaches both)."""
    course, out = of(rows, "recipe", program="04"), []
    for group in sorted({(r["gpus"], r["variant"], stamp(r)) for r in course}, key=str):
        c = sorted((r for r in course if (r["gpus"], r["variant"], stamp(r)) == group), key=lambda r: r["seed"])
        plain = {r["seed"]: r for r in of(rows, "plain") if (r["gpus"], r["variant"], stamp(r)) == group}
        out.append((group, c, [(r, plain[r["seed"]]) for r in c if r["seed"] in plain]))
    return out


def times(x) -> str:
    """A ratio; of times to 99%, INF where only lesson 04 missed 99%, 0 where only the plain loop did."""
    return "-" if x is None else "04 missed 99%" if x == INF else "plain missed 99%" if x == 0 else f"{x:.2f}x"


def over_rounds(ratios: list, target: float, extra: bool = True) -> list[str]:
    """[per round, median, spread (min-max), verdict]; a round without a ratio (both missed 99%) is listed, not
    counted. The median of an even count is the higher middle one."""
    known = [x for x in ratios if x is not None]
    each = ", ".join(times(x) if x is not None else "both missed 99%" for x in ratios)
    if not ratios:
        return ["-", "-", "-", "not measured (no plain loop in this run)"]
    if not known:
        return [each, "-", "-", "no ratio (both missed 99% in every round)"]
    middle = statistics.median_high(known)
    status = f"too few rounds ({len(known)} of {MIN_ROUNDS})" if len(known) < MIN_ROUNDS else \
        verdict(middle <= target and extra)
    return [each, times(middle), f"{times(min(known))} to {times(max(known))}", status]


def step(rows):
    body, used = [], []
    for (n, variant, _), c, pairs in rounds(rows):
        if pairs:
            cs, ps = (statistics.median(pair[i]["median_epoch_s"] for pair in pairs) for i in (0, 1))
            used += [r for pair in pairs for r in pair]
            body.append([n, c[0]["device_name"], variant, len(pairs), f"{cs:.3f}",
                         f"{1e3 * cs / c[0]['steps_per_epoch']:.2f}", f"{ps:.3f}",
                         f"{1e3 * ps / pairs[0][1]['steps_per_epoch']:.2f}"]
                        + over_rounds([a["median_epoch_s"] / b["median_epoch_s"] for a, b in pairs], STEP_RATIO))
    return block("Lesson 04's step against the plain loop", "The time-to-99% runs below (batch x lr per GPU), round by "
                 "round: a round is one seed's lesson 04 run and the plain loop's run of that seed right after it. "
                 "Ratio: lesson 04's median s/epoch over the plain loop's; s/epoch and ms/step: the median over the "
                 "rounds; of an even count of rounds, the median is the higher middle ratio. Target: the median ratio "
                 f"over at least {MIN_ROUNDS} rounds at most {STEP_RATIO:.2f}x.",
                 used, ["GPUs", "GPU", "batch x lr", "rounds", "lesson 04 s/epoch", "lesson 04 ms/step",
                        "plain loop s/epoch", "plain loop ms/step", "ratio per round", "median ratio",
                        "spread (min-max)", "target"], body)


def time_to_99(rows):
    body, used = [], []
    for (n, variant, _), c, pairs in rounds(rows):
        p = [b for _, b in pairs]
        ct, pt = [r["time_to_99"] for r in c], [r["time_to_99"] for r in p]
        final = statistics.mean(r["final_accuracy"] for r in c)
        cm, pm = (statistics.median(t if t is not None else INF for t in x) if x else None for x in (ct, pt))
        per = [None if a["time_to_99"] is None and b["time_to_99"] is None else INF if a["time_to_99"] is None
               else 0.0 if b["time_to_99"] is None else a["time_to_99"] / b["time_to_99"] for a, b in pairs]
        used += c + p
        body.append([n, c[0]["device_name"], variant, len(c), len(pairs), "-" if cm == INF else f"{cm:.2f} s",
                     "-" if pm in (None, INF) else f"{pm:.2f} s",
                     times(cm / pm) if pm not in (None, INF) and cm != INF else "-", f"{final:.2%}"]
                    + over_rounds(per, TIME_RATIO, final >= FINAL_ACCURACY))
    seeds = sorted(of(rows, "recipe", program="04") + of(rows, "plain"),
                   key=lambda r: (str(stamp(r)), r["gpus"], r["program"], r["variant"], r["seed"]))
    fmt = lambda t: "not reached" if t is None else f"{t:.2f} s"  # noqa: E731
    return ["## Time to 99%", ""] + block(
        "The ratio", f"Training seconds until the test accuracy first reaches {ACCURACY:.0%} (tested after every "
        "epoch, 6 epochs, data on the GPUs, AdamW + OneCycle; the plain loop draws lesson 04's initial weights, data "
        "order and dropout masks), lesson 04 against the plain loop on the same GPUs in the same run: the medians "
        "over the seeds and their ratio, then round by round (one seed's lesson 04 run and the plain loop's right "
        "after it) the ratio of the two times; a round where both missed 99% is listed, not counted; of an even count "
        f"the median is the higher middle ratio. Target: the median ratio over at least {MIN_ROUNDS} rounds at most "
        f"{TIME_RATIO:.2f}x, with lesson 04's mean final test accuracy at least {FINAL_ACCURACY:.1%}.", used,
        ["GPUs", "GPU", "batch x lr per GPU", "seeds", "rounds", "lesson 04 median", "plain loop median",
         "ratio of medians", "lesson 04 mean final", "ratio per round", "median ratio", "spread (min-max)", "target"],
        body) + [""] + block(
        "Per seed", "Test accuracy after each epoch.", seeds, ["GPUs", "program", "batch x lr", "seed",
        "test accuracy per epoch", f"time to {ACCURACY:.0%}", "s/epoch (median)"],
        [[r["gpus"], NAMES[r["program"]], r["variant"], r["seed"], ", ".join(f"{a:.4f}" for a in r.get("accuracy", []))
          or f"final {r['final_accuracy']:.4f}", fmt(r["time_to_99"]), f"{r['median_epoch_s']:.3f}"] for r in seeds])
