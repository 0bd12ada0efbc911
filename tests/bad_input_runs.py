"""How one row of the bad-input table (tests/bad_inputs.py) runs, and how its results are judged.

A row is run by `run_in_process`: common.exits.run(main, argv) as the script's `__main__` does, with stdout
and stderr captured, SystemExit caught, the environment, sys.excepthook and SIGINT handler restored, and any
process group left behind destroyed (and reported). `problems` judges a row's results (one per rank).
The folders a row reads and writes come from its Context; prepare makes a row's own folder (the checkpoints and
files the rows hand to the scripts: tests/bad_input_artifacts.py).
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import shutil
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from bad_inputs import Case, command_line, lesson_parser, load_script


# ---- where a row runs -----------------------------------------------------------------------------------

@dataclass
class Context:
    """data: the synthetic MNIST folder; art: shared read-only artifacts; root: this mode's per-row folders."""
    data: str
    art: str
    root: str

    def paths(self, case: Case) -> dict:
        folder = Path(self.root) / case.id
        return {"data": self.data, "art": self.art, "case": str(folder), "out": str(folder / "out")}

    def resolve(self, case: Case, texts) -> list[str]:
        paths = self.paths(case)
        return [text.format(**paths) for text in texts]

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> "Context":
        return cls(**json.loads(text))


def _checkpoint_name(ctx: Context, lesson: str) -> str:
    return sorted((Path(ctx.art) / "runs" / f"artifact-{lesson}" / "out" / "checkpoints").iterdir())[-1].name


def prepare(case: Case, ctx: Context) -> None:
    """Create the row's folder and what its setup needs (run once per mode, before any rank runs the row)."""
    paths = ctx.paths(case)
    folder = Path(paths["case"])
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if case.setup == "file-in-the-way":
        (folder / "afile").write_text("a regular file, not a folder\n")
    elif case.setup == "used-output-dir":  # an earlier run's checkpoint, under its own name
        ckpts = Path(paths["out"]) / "checkpoints"
        ckpts.mkdir(parents=True)
        source = Path(ctx.art) / f"ckpt-{case.script}"
        target = ckpts / _checkpoint_name(ctx, case.script)
        (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)
        (Path(paths["case"]) / "listing.json").write_text(json.dumps(listing(paths["out"])))


def listing(folder) -> dict:
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- running a row in this process --------------------------------------------------------------------

@contextlib.contextmanager
def _injected(case: Case, module):
    """ctrl-c-while-loading: SIGINT to this process as the lesson starts loading data (no StopSignals yet)."""
    if case.inject != "ctrl-c-while-loading":
        yield
        return
    if not hasattr(module, "load_mnist"):  # the trainer's strategies load their data through trainer/data.py
        module = importlib.import_module("trainer.data")
    original = module.load_mnist

    def interrupted(*args, **kwargs):
        if dist.is_initialized():  # a real Ctrl-C reaches every rank at once: none may still be connecting (a
            dist.barrier()         # rank that leaves first would end a slower peer's connect, not its Ctrl-C)
        signal.raise_signal(signal.SIGINT)  # the default handler raises KeyboardInterrupt right here
        return original(*args, **kwargs)

    module.load_mnist = interrupted
    try:
        yield
    finally:
        module.load_mnist = original


def _python_default_warning_filters() -> None:
    """What a fresh `python script.py` shows (pytest's own filters aside), every time rather than once."""
    warnings.resetwarnings()
    warnings.simplefilter("always")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category)


def run_in_process(case: Case, ctx: Context, env: dict | None = None) -> dict:
    """Run one row as `python SCRIPT ARGV` would (common.errors.run), here; return what happened."""
    import torch.distributed as dist

    from common.cli import parse
    from common.exits import run

    module = load_script(case.script)
    argv = ctx.resolve(case, case.argv)
    saved_env, saved_hook, saved_argv0 = dict(os.environ), sys.excepthook, sys.argv[0]
    saved_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.update(dict(case.env), **(env or {}))
    sys.argv[0] = command_line(case.script)[0]  # "(see train.py --help)", as in a real run
    out, err = io.StringIO(), io.StringIO()
    code, escaped, left_group, caught = None, None, False, []
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _injected(case, module), \
                warnings.catch_warnings(record=True) as caught:
            _python_default_warning_filters()
            if case.expect == "accepted" and case.script == "08":  # digits_lm's own parser (no --config)
                module.parse_args(argv)
            elif case.expect == "accepted":
                parse(lesson_parser(case.script), argv)
            else:
                run(module.main, argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # noqa: B902 - what escapes run() is a traceback in a real process
        code = 1
        escaped = "".join(traceback.format_exception(exc))
    finally:
        seconds = time.monotonic() - start
        if dist.is_initialized():  # run() destroys it on exit 2 and 130; main() on success
            left_group = True
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)
        sys.excepthook, sys.argv[0] = saved_hook, saved_argv0  # init_process_group wraps the hook each time
        signal.signal(signal.SIGINT, saved_sigint)
    text = out.getvalue() + err.getvalue() + "".join(  # a real process prints them on stderr
        warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in caught)
    return {"id": case.id, "rank": int(os.environ.get("RANK", "0")), "code": code, "seconds": round(seconds, 3),
            "lines": text.splitlines(), "escaped": escaped, "left_group": left_group}


# ---- judging ----------------------------------------------------------------------------------------------

def _metrics(ctx: Context, case: Case) -> dict | None:
    path = Path(ctx.paths(case)["out"]) / "metrics.json"
    return json.loads(path.read_text()) if path.is_file() else None


def leftovers(case: Case, ctx: Context) -> list[str]:
    """What a failed row left behind that would change the next run."""
    paths = ctx.paths(case)
    found = [f"{p} exists" for p in ctx.resolve(case, case.absent) if Path(p).exists()]
    out = Path(paths["out"])
    if case.setup == "used-output-dir":
        before = json.loads((Path(paths["case"]) / "listing.json").read_text())
        if listing(out) != before:
            found.append(f"the used {out} changed: {before} -> {listing(out)}")
    elif case.expect != "ok" and out.exists():
        found.append(f"{out} was created: {sorted(listing(out))}")
    if case.setup == "file-in-the-way" and not (Path(paths["case"]) / "afile").is_file():
        found.append("the regular file in the way is gone")
    return found


def problems(case: Case, results: list[dict], ctx: Context, mode: str) -> list[str]:
    """Everything wrong with a row's results (one per rank, rank 0 first); [] when it behaved."""
    found = []
    by_rank = sorted(results, key=lambda r: r["rank"])
    ranks = [r["rank"] for r in by_rank]
    if ranks != list(range(1 if mode == "python" else 2)):
        return [f"results for ranks {ranks}"]
    every = [line for r in by_rank for line in r["lines"]]
    for r in by_rank:
        if r["escaped"]:
            found.append(f"rank {r['rank']}: an exception escaped run() (a traceback): {r['escaped'][-1500:]}")
        if any("Traceback" in line for line in r["lines"]):
            found.append(f"rank {r['rank']}: 'Traceback' in its output: {r['lines'][-20:]}")
        shown = [line for line in r["lines"] if re.search(r"\w+Warning: ", line)]
        if shown:
            found.append(f"rank {r['rank']}: a Python warning in its output: {shown}")
        for prefix in case.forbid:
            if any(line.startswith(prefix) for line in r["lines"]):
                found.append(f"rank {r['rank']}: printed a line starting {prefix!r}: {r['lines']}")
    errors = [line for line in every if line.startswith("error:")]
    lead, rest = by_rank[0], by_rank[1:]
    if case.expect in ("ok", "accepted"):
        if any(r["code"] != 0 for r in by_rank):
            found.append(f"exit codes {[r['code'] for r in by_rank]}, expected 0: {every[-10:]}")
        if errors:
            found.append(f"error lines: {errors}")
    elif case.expect == "error":
        if lead["code"] != 2:
            found.append(f"rank 0 exit code {lead['code']}, expected 2: {lead['lines'][-10:]}")
        if len(errors) != 1:
            found.append(f"{len(errors)} lines start with 'error:', expected exactly one: {every[-15:]}")
        elif not all(n in errors[0] for n in ctx.resolve(case, case.needles)):
            found.append(f"the error line lacks {ctx.resolve(case, case.needles)}: {errors[0]}")
        elif not lead["lines"] or errors[0] not in lead["lines"]:
            found.append(f"the error line is not rank 0's: {errors[0]}")
        for r in rest:  # quiet with exit 2, or one line saying another rank failed (exit 1)
            stopping = [line for line in r["lines"] if line.startswith(f"rank {r['rank']}: stopping, a collective failed")]
            if not (r["code"] == 2 and not stopping) and not (r["code"] == 1 and len(stopping) == 1):
                found.append(f"rank {r['rank']}: exit {r['code']} with {stopping}, expected 2 (quiet) or 1 with "
                             f"one 'stopping, a collective failed' line: {r['lines'][-5:]}")
    elif case.expect == "interrupted":
        said = [line for line in every if line.startswith("interrupted (Ctrl-C)")]
        if lead["code"] != 130:
            found.append(f"rank 0 exit code {lead['code']}, expected 130")
        if len(said) != 1 or said[0] not in lead["lines"] or errors:
            found.append(f"expected one 'interrupted (Ctrl-C)' line from rank 0 and no error line: {every[-10:]}")
        for r in rest:  # its own Ctrl-C (130, quiet), or rank 0 left first: its collective broke (1, one line)
            stopping = [line for line in r["lines"] if line.startswith(f"rank {r['rank']}: stopping, a collective failed")]
            loud = [line for line in r["lines"] if line.startswith(("interrupted", "error:", f"rank {r['rank']}:"))]
            if not (r["code"] == 130 and not loud) and not (r["code"] == 1 and loud == stopping and len(stopping) == 1):
                found.append(f"rank {r['rank']}: exit {r['code']} with {r['lines'][-3:]}, expected 130 (quiet) or 1 "
                             f"with one 'stopping, a collective failed' line")
    if case.max_seconds is not None and lead["seconds"] > case.max_seconds:
        found.append(f"took {lead['seconds']:.2f} s, expected under {case.max_seconds} s")
    for r in by_rank:
        if r["left_group"] and r["code"] != 1:  # run() keeps the (broken) group on exit 1: see the report
            found.append(f"rank {r['rank']}: left its process group initialised")
    if case.expect == "ok":
        metrics = _metrics(ctx, case)
        if metrics is None:
            found.append("no metrics.json")
        else:
            if case.test_samples is not None and [e["test_samples"] for e in metrics["epochs"]] != [case.test_samples]:
                found.append(f"test_samples {[e['test_samples'] for e in metrics['epochs']]}, expected [{case.test_samples}]")
            if case.world_size is not None and metrics["world_size"] != case.world_size:
                found.append(f"world_size {metrics['world_size']}, expected {case.world_size}")
    elif case.expect != "accepted":
        found += leftovers(case, ctx)
    return found


# ---- real launches: the course's lines vs torchrun's own report ----------------------------------------

TORCH_FRAME = ("/torch/distributed/", "<frozen runpy>")


def tracebacks(lines: list[str]) -> list[tuple[list[str], str]]:
    """Each Python traceback in the output: (its frame file names, its final exception line)."""
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("Traceback (most recent call last):"):
            files, i = [], i + 1
            while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
                if lines[i].startswith('  File "'):
                    files.append(lines[i].split('"')[1])
                i += 1
            found.append((files, lines[i] if i < len(lines) else ""))
        else:
            i += 1
    return found


def torchrun_report_problems(lines: list[str], exception: str) -> list[str]:
    """What we accept from torchrun itself: exactly ONE traceback, every frame of it in torch/distributed (its
    launcher and elastic agent) or runpy, ending in `exception` (e.g. ...errors.ChildFailedError). Anything
    else with a traceback came from the course's processes."""
    found = []
    seen = tracebacks(lines)
    if len(seen) != 1:
        found.append(f"{len(seen)} tracebacks, expected only torchrun's own: {[last for _, last in seen]}")
    for files, last in seen:
        if not last.startswith(exception):
            found.append(f"a traceback ending in {last!r}, not torchrun's {exception}")
        outside = [f for f in files if not any(part in f for part in TORCH_FRAME)]
        if outside:
            found.append(f"a traceback through {outside}: not torchrun's own")
    return found
