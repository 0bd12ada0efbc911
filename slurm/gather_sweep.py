#!/usr/bin/env python3
"""Gather the runs of a sweep (04_ddp_training/slurm_sweep_array.sh) into one table and one plot.

    python slurm/gather_sweep.py runs/sweep-<array job id>        # every */metrics.json below it
    python slurm/gather_sweep.py runs/sweep-123 --out results/     # write the files elsewhere

Writes sweep.md (a markdown table, also printed), sweep.csv and sweep.png (test accuracy and test loss per
epoch, one line per run) into the folder (or --out). One row per run, sorted by the swept flags: the flags
that differ between the runs (always lr and seed), then the last epoch's losses and accuracy, the best
test accuracy and the training time. Needs only the standard library and matplotlib.
"""
import argparse
import csv
import json
import sys
from pathlib import Path

PATH_FLAGS = {"output_dir", "data_dir", "resume"}  # differ between runs without being part of the sweep
ALWAYS = ("lr", "seed")
RESULTS = ("epochs", "train_loss", "test_loss", "test_accuracy", "best_test_accuracy", "train_seconds")


def load_runs(folder: Path) -> list[dict]:
    runs = []
    for path in sorted(folder.glob("**/metrics.json")):
        try:
            metrics = json.loads(path.read_text())
            epochs, args = metrics["epochs"], metrics["args"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"error: {path} is not a lesson's metrics.json ({e}): remove it or point at the sweep's folder")
        if epochs:  # a run that has not finished an epoch has nothing to report yet
            runs.append({"run": str(path.parent.relative_to(folder)) or ".", "args": args, "epochs": epochs})
    return runs


def swept_flags(runs: list[dict]) -> list[str]:
    """lr, seed, then every other flag whose value differs between the runs."""
    keys = sorted({k for r in runs for k in r["args"]} - PATH_FLAGS - set(ALWAYS))
    varied = [k for k in keys if len({json.dumps(r["args"].get(k)) for r in runs}) > 1]
    return [*ALWAYS, *varied]


def table_rows(runs: list[dict], flags: list[str]) -> list[dict]:
    rows = []
    for r in runs:
        last = r["epochs"][-1]
        row = {"run": r["run"], **{f: r["args"].get(f) for f in flags}}
        row.update(epochs=len(r["epochs"]), train_loss=last["train_loss"], test_loss=last["test_loss"],
                   test_accuracy=last["test_accuracy"],
                   best_test_accuracy=max(e["test_accuracy"] for e in r["epochs"]),
                   train_seconds=sum(e["epoch_seconds"] for e in r["epochs"]))
        rows.append(row)
    return sorted(rows, key=lambda row: [sort_key(row[f]) for f in flags])


def sort_key(value):
    """Numbers by value, then strings, then unset (None): a column may mix them."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value)) if value is not None else (2, 0.0, "")


def fmt(value) -> str:
    if value is None:
        return "default"  # the flag was not given: the lesson's default
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def markdown(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], flags: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # no display on a login or compute node
    import matplotlib.pyplot as plt
    fig, (acc, loss) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        label = " ".join(f"{f}={fmt(r['args'].get(f))}" for f in flags)
        x = [e["epoch"] for e in r["epochs"]]
        acc.plot(x, [e["test_accuracy"] for e in r["epochs"]], marker="o", label=label)
        loss.plot(x, [e["test_loss"] for e in r["epochs"]], marker="o", label=label)
    for ax, name in ((acc, "test accuracy"), (loss, "test loss")):
        ax.set(xlabel="epoch", ylabel=name, title=f"{name} per epoch")
        ax.grid(alpha=0.3)
    acc.legend(fontsize="small")
    fig.suptitle(f"sweep: {len(runs)} runs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path, help="the sweep's output folder, e.g. runs/sweep-<array job id>")
    p.add_argument("--out", type=Path, default=None, help="where sweep.md, sweep.csv and sweep.png go (default: folder)")
    args = p.parse_args(argv)
    if not args.folder.is_dir():
        sys.exit(f"error: {args.folder} is not a folder: pass the sweep's output folder, runs/sweep-<array job id>")
    runs = load_runs(args.folder)
    if not runs:
        sys.exit(f"error: no metrics.json with a finished epoch below {args.folder}: wait for the tasks (squeue -u $USER)")
    out = args.out or args.folder
    out.mkdir(parents=True, exist_ok=True)
    flags = swept_flags(runs)
    rows = table_rows(runs, flags)
    columns = ["run", *flags, *RESULTS]
    text = markdown(rows, columns)
    (out / "sweep.md").write_text(text)
    with open(out / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    plot(runs, flags, out / "sweep.png")
    print(text + f"\n{len(rows)} runs: {out / 'sweep.md'}, {out / 'sweep.csv'}, {out / 'sweep.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
