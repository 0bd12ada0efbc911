"""benchmarks.json in, docs/benchmarks.md and plots out: the rows of benchmarks/bench.py, merged over runs.

The page leads with the accuracy target (met or missed, per seed), then one section
per suite. Every table says what it was measured on (GPU, driver, torch, course commit) and every row
says its data (real MNIST or synthetic), because rows from several runs and machines can be merged.
"""
from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

from benchmarks import tables
from benchmarks.tables import TARGET_ACCURACY, TARGET_GPUS, TARGET_SEEDS

MACHINE = ("gpu", "driver", "torch", "commit", "date")


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):  # no git or no nvidia-smi on this machine
        return ""


def machine_info(quick: bool, commit: str | None = None) -> dict:
    """What every row is stamped with. nvidia-smi, not torch, so this process holds no CUDA context."""
    import torch
    if not commit:
        commit = _run(["git", "rev-parse", "--short", "HEAD"]) or "?"
        if commit != "?" and _run(["git", "status", "--porcelain", "--untracked-files=no"]):
            commit += "+uncommitted changes"
    info = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "commit": commit}
    if quick:
        return {**info, "gpu": "CPU (gloo, --quick smoke mode)", "driver": "-"}
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]).splitlines()
    name, _, driver = (smi[0] if smi else "").partition(",")
    return {**info, "gpu": name.strip() or "? GPU", "driver": driver.strip() or "?"}


def load_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = json.loads(path.read_text())["rows"]
    kept = [r for r in rows if "key" in r]
    if len(kept) < len(rows):
        print(f"bench: dropped {len(rows) - len(kept)} rows of the old format from {path}", flush=True)
    return kept


def save_rows(path: Path, old: list[dict], new: list[dict]) -> list[dict]:
    """A new row replaces the old row of the same key (the same measurement); other rows stay."""
    fresh = {r["key"]: r for r in new}  # within `new` too, the last row of a key wins
    merged = [r for r in old if r["key"] not in fresh] + list(fresh.values())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"rows": merged}, indent=1))
    tmp.replace(path)  # a reader (or a kill) never sees half a file
    return merged


def data_label(rows) -> str:
    kinds = {r["data"] for r in rows}
    if not kinds:
        return "-"
    return "real MNIST" if kinds == {"mnist"} else "synthetic" if kinds == {"synthetic"} else \
        "mixed: real MNIST and synthetic"


def measured_on(rows: list[dict]) -> str:
    """One line per table: which machine(s), torch, commit and data its rows come from."""
    machines = sorted({tuple(r.get(k, "?") for k in MACHINE) for r in rows})
    text = "; ".join(f"{g} (driver {d}), torch {t}, course commit {c}, {day}" for g, d, t, c, day in machines)
    warn = " **Rows come from different runs: compare with care.**" if len(machines) > 1 else ""
    return f"_Measured on {text}. Data: {data_label(rows)}._{warn}"


def _by_gpus(rows, suite):
    """{gpus: {seed: row}}; a real-MNIST row wins over a synthetic one of the same seed."""
    out = {}
    for r in sorted((r for r in rows if r["suite"] == suite), key=lambda r: r["data"] == "mnist"):
        out.setdefault(r["gpus"], {})[r["seed"]] = r
    return out


def targets(rows: list[dict]) -> list[str]:
    """The target table: met or missed per GPU count, with each seed's accuracy."""
    recipe = _by_gpus(rows, "recipe")
    lines = ["| target | GPUs | result per seed | data | status |", "|---|---|---|---|---|"]
    for gpus in TARGET_GPUS:  # more GPUs may run the recipe (see its table); the target is for 1 and 2
        got = [recipe.get(gpus, {}).get(s) for s in TARGET_SEEDS]
        ok = [r for r in got if r and r["status"] == "ok"]
        # Only runs that aimed at the target count: one stopped at another --target-accuracy says nothing about it.
        right = [r if r in ok and (r.get("args") or {}).get("target_accuracy") == TARGET_ACCURACY else None for r in got]
        data = data_label(ok or rows)  # not measured: the data of the page's other rows
        accs = [max(e["test_accuracy"] for e in r["epochs"]) if r else None for r in right]
        lines.append(f"| test accuracy >= {TARGET_ACCURACY:.1%} for seeds {', '.join(map(str, TARGET_SEEDS))} | "
                     f"{gpus} | {_per_seed(accs, '{:.2%}')} | {data} | "
                     f"{_status([a is not None and a >= TARGET_ACCURACY for a in accs], ok, right)} |")
    return lines


def _per_seed(values, fmt: str) -> str:
    return ", ".join(f"seed {s}: {'-' if v is None else fmt.format(v)}" for s, v in zip(TARGET_SEEDS, values))


def _status(passed: list[bool], ok: list[dict], right: list) -> str:
    """met only if every seed ran at the target's settings and passed."""
    if not ok:
        return "not measured"
    if None in right:
        missing = sum(r is None for r in right)
        return f"not measured ({missing} seed(s) missing, failed or run at another --target-accuracy)"
    status = "**met**" if all(passed) else "**missed**"
    if len({tuple(r.get(k) for k in MACHINE) for r in right}) > 1:  # the target compares runs of one machine
        status += " (seeds measured in different runs)"
    return status + (" (synthetic data: not a real-MNIST result)" if any(r["data"] != "mnist" for r in ok) else "")


def write_report(out: Path, rows: list[dict]) -> None:
    from benchmarks import plots
    label = data_label(rows) if rows else "no rows"
    title = "# Benchmarks" + ("" if label == "real MNIST" else f" ({label.upper()} data, not real MNIST results)"
                             if label == "synthetic" else f" ({label})")
    lines = [title, "",
             f"Written by `make bench` (`benchmarks/bench.py`) from {len(rows)} runs; each row is one run of a lesson "
             "script, read from its `metrics.json`. GPUs = processes (one GPU each), except lesson 03: one process "
             "driving the GPUs. Times are training seconds: every script warms up (cuDNN autotune, allocator, NCCL) "
             "before its clock starts, and reports that warm-up separately. Each section names its machine and "
             "commit. Measured elsewhere: lesson 05's model that DDP cannot fit and FSDP2 can, with its tools "
             "([`fsdp_gpu.md`](fsdp_gpu.md), `benchmarks/fsdp_gpu.py`), and the time-to-99% recipe over seeds 1-5 on "
             "1, 2 and 4 GPUs with the step profiles ([`recipe.md`](recipe.md), `benchmarks/recipe.py`).", "",
             f"## Target: {TARGET_ACCURACY:.0%} test accuracy for every seed, on "
             f"{' and '.join(map(str, TARGET_GPUS))} GPUs", "",
             f"Lesson 04, data on the GPUs, recipe `{tables.recipe_flags(rows)}`, seeds "
             f"{', '.join(map(str, TARGET_SEEDS))}. How long each seed took to reach it: the next section.", ""]
    recipe_rows = [r for r in rows if r["suite"] == "recipe"]
    lines += ([measured_on(recipe_rows), ""] if recipe_rows else []) + targets(rows) + [""]
    for section in tables.SECTIONS:
        lines += section(rows, measured_on) + [""]
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["## Failed runs", ""]
        for r in failed:
            lines += [f"**{r['key']}**: {r['status']} after {r['wall_seconds']:.0f} s (`{r['command']}`)", "",
                      "```", r.get("error", ""), "```", ""]
    lines += [f"![{name}]({name}.png)\n" for name in plots.write_all(out, rows)]
    (out / "benchmarks.md").write_text("\n".join(lines))
