"""THE table of learner mistakes, and how one row runs in-process and is judged. One place: a new flag gets rows.

Every lesson script (02-05, and 01's download_mnist.py; hello_distributed.py and check_env.py take no flags)
gets the same mistakes, under plain python and under torchrun with 2 ranks:

  values         zero, a negative and a non-number for EVERY numeric flag of the script's own parser, a
                 typo'd flag, a choice out of range, a typo'd --compile backend, --patience without
                 --val-samples, --val-samples that leaves no training images, bad --config files
  paths          a typo'd --data-dir, an --output-dir or --data-dir under a regular file (unwritable even as
                 root), --resume with a checkpoint of another lesson, of another --width, a truncated one, a
                 missing one, a broken sharded one; lesson 05's --init-from with a truncated or mismatched file
  launches       lessons 04/05 under plain python (one process, exit 0: not a mistake), more ranks than the
                 data has batches (exit 0, test_samples exactly 1)
  interruptions  a second run into a used --output-dir (refused at once, before data is loaded), Ctrl-C
                 while the data loads (outside a checkpointing stop: exit 130, one line)

How the numeric flags are found: `lesson_parser(script)` runs the script's own main() until its FIRST call
of `Parser.parse_known_args` (lessons 02-05 reach it through common.cli.parse, download_mnist.py through
parse_args) and keeps the parser there, unparsed. That is exactly the parser a learner's command meets,
base_parser plus the lesson's own flags, built by the lesson's own code, with no side effect: the lessons
build their parser first, before anything else. A flag is numeric when its argparse `type` turns "1" into an
int or a float (common.cli's range-checked types and plain int/float alike). Which numeric flags may be ZERO
is a decision, so it is written down here (ZERO_ALLOWED), not read back from the code under test.

A row is run by `run_in_process`: common.errors.run(main, argv) as the script's `__main__` does, with stdout
and stderr captured, SystemExit caught, the environment, sys.excepthook and SIGINT handler restored, and any
process group left behind destroyed (and reported). `problems` judges a row's results (one per rank).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
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

from lessons import ROOT, SCRIPTS as LESSON_SCRIPTS

SCRIPTS = {**{k: v for k, v in LESSON_SCRIPTS.items() if k != "01"}, "download": ROOT / "01_setup" / "download_mnist.py"}
LESSONS = ("02", "03", "04", "05")
MODES = ("python", "torchrun")

# Counts: zero is a sensible value (no validation, no warm-up, seed 0, no DataLoader workers, no extra blocks).
ZERO_ALLOWED = frozenset({"--val-samples", "--warmup-steps", "--seed", "--num-workers", "--blocks"})
# A tiny run on the session's synthetic data: every lesson row starts from it, the row's flags come after it
# (argparse: the last value wins). The artifacts (checkpoints) are written with exactly these flags.
SMALL = ("--data", "synthetic", "--data-dir", "{data}", "--num-workers", "0", "--train-samples", "64",
         "--test-samples", "16", "--batch-size", "32", "--epochs", "1", "--max-steps", "1")
NO_NETWORK = (("MNIST_MIRROR", "http://127.0.0.1:9/"),)  # a refused connection: a download fails at once
OTHER_LESSON = {"02": "04", "03": "02", "04": "02", "05": "04"}  # whose checkpoint a row hands to --resume

@dataclass(frozen=True)
class Case:
    """One mistake of one script. argv/absent may hold {data}, {art}, {case} and {out} (see Context.paths)."""
    id: str
    script: str
    what: str  # what the learner did, in words
    argv: tuple[str, ...]
    expect: str = "error"  # error (exit 2) | interrupted (exit 130) | ok (exit 0) | accepted (the parser takes it)
    needles: tuple[str, ...] = ()  # must all be in the one `error:` line
    modes: tuple[str, ...] = MODES
    env: tuple[tuple[str, str], ...] = ()
    setup: str | None = None  # "used-output-dir" | "file-in-the-way"
    inject: str | None = None  # "ctrl-c-while-loading"
    absent: tuple[str, ...] = ()  # paths that must not exist afterwards
    max_seconds: float | None = None  # in-process wall time
    forbid: tuple[str, ...] = ()  # line prefixes that must not appear (e.g. nothing slow started)
    test_samples: int | None = None  # expect == "ok": metrics.json's every epoch
    world_size: int | None = None  # expect == "ok": metrics.json's world_size


# ---- the scripts and their parsers ----------------------------------------------------------------------

_modules: dict = {}


def load_script(script: str):
    """The script as a module (importlib from its file; its `if __name__ == "__main__"` does not run)."""
    if script not in _modules:
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        spec = importlib.util.spec_from_file_location(f"bad_inputs_{script}", SCRIPTS[script])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _modules[script] = module
    return _modules[script]


class _ParserBuilt(Exception):
    pass


def lesson_parser(script: str) -> argparse.ArgumentParser:
    """The parser the script's main() builds, taken at its first parse call (see the module docstring)."""
    from common.cli import Parser
    module = load_script(script)
    captured = []

    def capture(self, *args, **kwargs):
        captured.append(self)
        raise _ParserBuilt

    original = Parser.parse_known_args
    Parser.parse_known_args = capture
    try:
        module.main([])
    except _ParserBuilt:
        pass
    finally:
        Parser.parse_known_args = original
    if not captured:
        raise AssertionError(f"{SCRIPTS[script]}: main() did not parse its command line with common.cli.Parser")
    return captured[0]


def numeric_flags(parser) -> list[tuple[str, str]]:
    """(flag, "int" or "float") for every option whose type turns "1" into a number."""
    found = []
    for action in parser._actions:
        if not action.option_strings or action.type is None:
            continue
        try:
            value = action.type("1")
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            long = max(action.option_strings, key=len)
            found.append((long, "int" if isinstance(value, int) else "float"))
    return found


# ---- the table ------------------------------------------------------------------------------------------

def _slug(flag: str) -> str:
    return flag.lstrip("-")


def _value_rows(script: str) -> list[Case]:
    rows = []
    for flag, kind in numeric_flags(lesson_parser(script)):
        base = (*SMALL, "--output-dir", "{out}") if script in LESSONS else ()
        if flag in ZERO_ALLOWED:
            rows.append(Case(f"{script}-{_slug(flag)}-zero", script, f"{flag} 0 (a count: allowed)",
                             (*base, flag, "0"), expect="accepted"))
        else:
            rows.append(Case(f"{script}-{_slug(flag)}-zero", script, f"{flag} 0", (*base, flag, "0"),
                             needles=(f"argument {flag}: must be ", "got 0")))
        rows.append(Case(f"{script}-{_slug(flag)}-negative", script, f"{flag} -1", (*base, flag, "-1"),
                         needles=(f"argument {flag}: must be ", "got -1")))
        noun = "an integer" if kind == "int" else "a number"
        rows.append(Case(f"{script}-{_slug(flag)}-not-a-number", script, f"{flag} ten", (*base, flag, "ten"),
                         needles=(f"argument {flag}: 'ten' is not {noun}",)))
    return rows


def _lesson_rows(lesson: str) -> list[Case]:
    base = (*SMALL, "--output-dir", "{out}")
    other = OTHER_LESSON[lesson]
    rows = _value_rows(lesson) + [
        Case(f"{lesson}-typo-flag", lesson, "--epoch 1 (for --epochs)", (*base, "--epoch", "1"),
             needles=("unrecognized arguments: --epoch 1",)),
        Case(f"{lesson}-choice-out-of-range", lesson, "--optimizer adam", (*base, "--optimizer", "adam"),
             needles=("argument --optimizer: invalid choice: 'adam'",)),
        Case(f"{lesson}-compile-backend-typo", lesson, "--compile inductr (for inductor)",
             (*base, "--compile", "inductr"), needles=("--compile", "inductr", "inductor")),
        Case(f"{lesson}-patience-without-validation", lesson, "--patience 2 without --val-samples",
             (*base, "--patience", "2"), needles=("--patience needs a validation set", "--val-samples")),
        Case(f"{lesson}-val-samples-eat-all-training", lesson, "--val-samples 64 with --train-samples 64",
             (*base, "--val-samples", "64"), needles=("--val-samples 64 leaves no training images out of 64",)),
        Case(f"{lesson}-config-missing", lesson, "--config of a file that is not there",
             (*base, "--config", "{case}/run.yaml"), needles=("--config {case}/run.yaml", "check the path")),
        Case(f"{lesson}-config-bad-value", lesson, "--config with `epochs: 0`",
             (*base, "--config", "{art}/epochs-zero.yaml"), needles=("epochs: must be >= 1, got 0",)),
        Case(f"{lesson}-config-typo-key", lesson, "--config with `epoch: 2`",
             (*base, "--config", "{art}/typo-key.yaml"), needles=("unknown key 'epoch'", "did you mean epochs?")),
        Case(f"{lesson}-data-dir-typo", lesson, "--data mnist --data-dir dta (for data), offline",
             (*base, "--data", "mnist", "--data-dir", "{case}/dta"), env=NO_NETWORK, absent=("{case}/dta",),
             needles=("MNIST not found in {case}/dta/MNIST/raw", "check --data-dir")),
        Case(f"{lesson}-data-dir-under-a-file", lesson, "--data synthetic --data-dir FILE/data",
             (*base, "--data-dir", "{case}/afile/data"), setup="file-in-the-way",
             needles=("{case}/afile/data",)),
        Case(f"{lesson}-output-dir-under-a-file", lesson, "--output-dir FILE/out (cannot be created)",
             (*SMALL, "--output-dir", "{case}/afile/out"), setup="file-in-the-way",
             needles=("{case}/afile/out",)),
        Case(f"{lesson}-resume-other-lesson", lesson, f"--resume a lesson {other} checkpoint",
             (*base, "--resume", f"{{art}}/ckpt-{other}"),
             needles=("is from another kind of run", f"lesson '{SCRIPTS[other].parent.name}' there")),
        Case(f"{lesson}-resume-other-width", lesson, "--resume a --width 1 checkpoint with --width 2",
             (*base, "--resume", f"{{art}}/ckpt-{lesson}", "--width", "2"),
             needles=("is from another kind of run (width 1 there, 2 here)",)),
        Case(f"{lesson}-resume-truncated", lesson, "--resume a truncated .pt",
             (*base, "--resume", "{art}/truncated.pt"),
             needles=("{art}/truncated.pt is not a readable checkpoint",)),
        Case(f"{lesson}-resume-missing", lesson, "--resume a path that is not there",
             (*base, "--resume", "{case}/ckpt.pt"), needles=("checkpoint {case}/ckpt.pt does not exist",)),
        Case(f"{lesson}-used-output-dir", lesson, "the same command again, into the used --output-dir",
             base, setup="used-output-dir", max_seconds=2.0, forbid=("lesson 0", "[rank "),
             needles=("{out}/checkpoints holds checkpoints of an earlier run", "--resume auto")),
        Case(f"{lesson}-ctrl-c-while-loading", lesson, "Ctrl-C while the data loads (before training)",
             base, expect="interrupted", inject="ctrl-c-while-loading"),
    ]
    if lesson != "05":
        rows.append(Case(f"{lesson}-resume-sharded-checkpoint", lesson, "--resume lesson 05's DCP folder",
                         (*base, "--resume", "{art}/ckpt-05"),
                         needles=("lesson '05_multigpu_fsdp_training' there",)))
    if lesson == "05":
        rows += [
            Case("05-resume-broken-sharded", "05", "--resume a DCP folder whose .metadata is truncated",
                 (*base, "--resume", "{art}/broken-dcp"), needles=("{art}/broken-dcp is not a readable checkpoint",)),
            Case("05-init-from-truncated", "05", "--init-from a truncated .pt (read after init_process_group)",
                 (*base, "--init-from", "{art}/truncated.pt"),
                 needles=("--init-from {art}/truncated.pt: not a readable weights file",)),
            # Not in the torchrun driver: rank 0 fails after init while rank 1 waits in a broadcast. In a real
            # launch rank 0 EXITS, which closes its sockets (rank 1 hears "Connection closed by peer") and
            # torchrun stops rank 1; in-process, rank 0 lives on and its FSDP state (state_dict() was called)
            # keeps the dead group's sockets open, so rank 1 waits for DIST_TIMEOUT_SECONDS. test_bad_inputs
            # launches this row for real under torchrun instead.
            Case("05-init-from-other-width", "05", "--init-from a --width 1 checkpoint with --width 2",
                 (*base, "--init-from", "{art}/ckpt-04", "--width", "2"), modes=("python",),
                 needles=("--init-from {art}/ckpt-04: not the weights of this Net",)),
        ]
    if lesson in ("04", "05"):
        rows += [
            Case(f"{lesson}-under-plain-python", lesson, "python on a torchrun lesson: ONE process, not a mistake",
                 base, expect="ok", modes=("python",), test_samples=16, world_size=1),
            Case(f"{lesson}-more-ranks-than-batches", lesson, "--train-samples 1 --test-samples 1 on 2 ranks",
                 (*base, "--train-samples", "1", "--test-samples", "1"), expect="ok", test_samples=1,
                 modes=("torchrun",), world_size=2),
        ]
    return rows


def _download_rows() -> list[Case]:
    # Not under torchrun: it is a one-process tool (two ranks would race to create and remove the same folder).
    only = ("python",)
    return _value_rows("download") + [
        Case("download-typo-flag", "download", "--synthtic", ("--data-dir", "{case}/data", "--synthtic"),
             modes=only, needles=("unrecognized arguments: --synthtic",), absent=("{case}/data",)),
        Case("download-data-dir-offline", "download", "download into a typo'd folder, offline",
             ("--data-dir", "{case}/dta",), env=NO_NETWORK, modes=only, absent=("{case}/dta",),
             needles=("MNIST not found in {case}/dta/MNIST/raw",)),
        Case("download-data-dir-under-a-file", "download", "download into FILE/data, offline",
             ("--data-dir", "{case}/afile/data"), env=NO_NETWORK, setup="file-in-the-way", modes=only,
             needles=("{case}/afile/data",)),
        Case("download-synthetic-under-a-file", "download", "--synthetic --data-dir FILE/data",
             ("--synthetic", "--data-dir", "{case}/afile/data"), setup="file-in-the-way", modes=only,
             needles=("{case}/afile/data",)),
    ]


def build_table() -> list[Case]:
    rows = [row for lesson in LESSONS for row in _lesson_rows(lesson)] + _download_rows()
    ids = [row.id for row in rows]
    assert len(ids) == len(set(ids)), "duplicate row ids"
    return rows


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


def make_artifacts(art: Path, data: str) -> None:
    """Real checkpoints of every lesson (the SMALL run, in-process), a truncated one, a broken DCP folder,
    and two --config files."""
    from unittest import mock

    art.mkdir(parents=True, exist_ok=True)
    ctx = Context(data, str(art), str(art / "runs"))
    for lesson in LESSONS:
        case = Case(f"artifact-{lesson}", lesson, "", (*SMALL, "--output-dir", "{out}"), expect="ok")
        with mock.patch("common.history.plot_curves"):  # an input, not under test: its curves.png costs ~1.5 s
            result = run_in_process(case, ctx)
        if result["code"] != 0:
            raise AssertionError(f"making the lesson {lesson} checkpoint failed: {result}")
        produced = sorted((Path(ctx.paths(case)["out"]) / "checkpoints").iterdir())[-1]
        (shutil.copytree if produced.is_dir() else shutil.copyfile)(produced, art / f"ckpt-{lesson}")
    (art / "truncated.pt").write_bytes((art / "ckpt-02").read_bytes()[:2000])
    shutil.copytree(art / "ckpt-05", art / "broken-dcp")
    metadata = art / "broken-dcp" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[: metadata.stat().st_size // 2])
    (art / "epochs-zero.yaml").write_text("epochs: 0\n")
    (art / "typo-key.yaml").write_text("epoch: 2\n")


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
    original = module.load_mnist

    def interrupted(*args, **kwargs):
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
    from common.errors import run

    module = load_script(case.script)
    argv = ctx.resolve(case, case.argv)
    saved_env, saved_hook, saved_argv0 = dict(os.environ), sys.excepthook, sys.argv[0]
    saved_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.update(dict(case.env), **(env or {}))
    sys.argv[0] = str(SCRIPTS[case.script])  # "(see mnist_ddpmodel.py --help)", as in a real run
    out, err = io.StringIO(), io.StringIO()
    code, escaped, left_group, caught = None, None, False, []
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _injected(case, module), \
                warnings.catch_warnings(record=True) as caught:
            _python_default_warning_filters()
            if case.expect == "accepted":
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
