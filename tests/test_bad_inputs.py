"""The bad-input matrix: every row of tests/bad_inputs.py under plain python, its TORCHRUN_ROWS under torchrun.

How it stays inside its time budget (a subprocess per row would take ~5 s, a torchrun launch ~10 s):
  * plain python: every row runs IN this process (bad_input_runs.run_in_process: common.exits.run(main, argv),
    SystemExit caught, output captured), against each lesson's own main() and so its own parser; one test per
    lesson checks that parser has every shared flag with the shared checks;
  * torchrun: ONE launch of tests/bad_input_driver.py with 2 ranks runs the rows where the ranks must agree
    (those whose modes include torchrun) in each worker and writes per-rank results; it starts in the background
    as soon as the artifacts exist;
  * a few REAL launches (also in the background) prove the in-process verdicts match real processes: one
    argparse error, the used --output-dir, a typo'd --data-dir (plain python), and a checkpoint-level error
    after init_process_group (lesson 05 --init-from, torchrun with 2 ranks).

What is accepted from torchrun's own output (torchrun_report_problems in bad_input_runs.py): torchrun exits 1 and
prints its ChildFailedError report, which holds exactly one traceback, every frame of it in torch/distributed
(its launcher and elastic agent) or runpy. The course's processes print no traceback at all: their one
`error:` line comes BEFORE torchrun's report; a worker other than the failing one exits 2 quietly, or 1 with
one `rank R: stopping, a collective failed (...)` line, or is stopped by torchrun's SIGTERM (-15).
"""
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bad_input_artifacts import make_artifacts
from bad_input_runs import Context, leftovers, prepare, problems, run_in_process, torchrun_report_problems
from bad_inputs import (LESSONS, ROOT, ZERO_ALLOWED, build_table, command_line, lesson_parser, load_script,
                        numeric_flags)

pytestmark = pytest.mark.timeout(300)  # the first test also pays for the module's setup (artifacts, launches)
TABLE = build_table()
ROWS = {case.id: case for case in TABLE}
DRIVER = Path(__file__).resolve().parent / "bad_input_driver.py"
DRIVER_DEADLINE_S = 300  # a safety net far above its ~20-40 s; the driver's own collectives time out after 30 s
REAL_DEADLINE_S = 120
OWN_DEFAULTS = {"07": {"blocks"}}  # lesson 07 cuts its --blocks into stages: 4 by default, not base_parser's 0
# (launcher, row): the rows launched for real as well, each judged like a learner's terminal would show it
REAL_RUNS = [("python", "04-epochs-zero"), ("python", "02-used-output-dir"), ("python", "02-data-dir-typo"),
             ("torchrun", "05-init-from-other-width")]


def params(mode):
    return [pytest.param(case, id=case.id) for case in TABLE if mode in case.modes]


def command(launcher, case, ctx):
    script = [*command_line(case.script), *ctx.resolve(case, case.argv)]
    if launcher == "python":
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *script]


def environment(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


class Launch:
    """A background process group, its output in a file, waited on with a deadline."""

    def __init__(self, argv, env, log: Path):
        self.log, self.start = log, time.monotonic()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                         start_new_session=True)
        self.seconds = None

    def wait(self, deadline_s) -> int:
        try:
            code = self.proc.wait(timeout=max(1.0, deadline_s - (time.monotonic() - self.start)))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
            pytest.fail(f"{self.proc.args} still running after {deadline_s} s:\n{self.log.read_text()[-3000:]}")
        if self.seconds is None:
            self.seconds = time.monotonic() - self.start
        return code

    @property
    def lines(self):
        return self.log.read_text().splitlines()


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, synthetic_dir):
    """The background launches (the torchrun driver and the real runs), artifacts (real checkpoints of every
    lesson, made in-process) and every row's folder. What needs no artifact starts first: the driver's workers
    import torch while this process makes the artifacts, then begin when the ready file appears."""
    base = tmp_path_factory.mktemp("bad_inputs")
    art, results, ready = base / "art", base / "results", base / "ready"
    results.mkdir()
    ctx = {mode: Context(synthetic_dir, str(art), str(base / mode)) for mode in ("python", "torchrun")}
    ctx.update({f"real-{launcher}": Context(synthetic_dir, str(art), str(base / f"real-{launcher}"))
                for launcher in ("python", "torchrun")})
    launches = {"driver": Launch([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc_per_node=2", str(DRIVER), ctx["torchrun"].to_json(), str(results),
                                  str(ready)], environment(DIST_TIMEOUT_SECONDS="30"), base / "driver.log")}

    def launch(launcher, row):
        case, context = ROWS[row], ctx[f"real-{launcher}"]
        prepare(case, context)
        launches[(launcher, row)] = Launch(command(launcher, case, context), environment(**dict(case.env)),
                                           base / f"real-{launcher}-{row}.log")

    gc.collect()
    gc.freeze()  # run() calls gc.collect() after each row: without this it walks all of torch's objects each time
    try:
        launch("python", "02-data-dir-typo")  # needs no artifact
        make_artifacts(art, synthetic_dir)
        for mode in ("python", "torchrun"):
            for case in TABLE:
                if mode in case.modes:
                    prepare(case, ctx[mode])
        ready.touch()
        for launcher, row in REAL_RUNS:
            if (launcher, row) not in launches:
                launch(launcher, row)
        yield {"ctx": ctx, "launches": launches, "results": results, "in_process": {}}
    finally:
        gc.unfreeze()
        for started in launches.values():
            if started.proc.poll() is None:
                os.killpg(started.proc.pid, 9)
                started.proc.wait()


def test_every_numeric_flag_of_every_script_has_its_three_rows(matrix):
    """A maintainer added a numeric flag: it gets zero, negative and non-numeric rows without editing the table."""
    for script in [*LESSONS, "download", "08"]:
        flags = numeric_flags(lesson_parser(script))
        for flag, _ in flags:
            for kind in ("zero", "negative", "not-a-number"):
                assert f"{script}-{flag.lstrip('-')}-{kind}" in ROWS, (script, flag, kind)
        if script in LESSONS:
            assert len(flags) >= 20 and ZERO_ALLOWED <= {flag for flag, _ in flags}, flags
        if script == "05":
            assert {"--hsdp", "--init-from"} <= {s for a in lesson_parser("05")._actions for s in a.option_strings}


@pytest.mark.parametrize("lesson", LESSONS)
def test_the_lesson_parser_has_every_shared_flag_with_the_shared_checks(lesson):
    """base_parser's flags, each with the same type (range check), choices, default and arity in the lesson's own
    parser: a mistake the shared parser refuses is refused by every lesson, whichever launcher started it."""
    from common.cli import base_parser

    mine = {action.dest: action for action in lesson_parser(lesson)._actions}
    name = Path(mine["output_dir"].default).name  # runs/NAME: trainer-<parallel> (tp.py names it per --parallel)
    for shared in base_parser(name, "")._actions:
        assert shared.dest in mine, f"lesson {lesson} lacks {shared.option_strings}"
        for attr in ("option_strings", "type", "choices", "default", "nargs", "const", "required"):
            if attr == "default" and shared.dest in OWN_DEFAULTS.get(lesson, ()):
                continue
            assert getattr(mine[shared.dest], attr) == getattr(shared, attr), (lesson, shared.dest, attr)


@pytest.mark.parametrize("case", params("python"))
def test_bad_input_under_plain_python(case, matrix):
    """A learner typed the row's command with `python SCRIPT ...` (run here, in-process, as its __main__ does)."""
    ctx = matrix["ctx"]["python"]
    result = run_in_process(case, ctx)
    matrix["in_process"][case.id] = result
    found = problems(case, [result], ctx, "python")
    assert not found, "\n".join(found)


def read_results(folder: Path) -> dict:
    rows = {}
    for rank in (0, 1):
        path = folder / f"rank{rank}.jsonl"
        for line in (path.read_text().splitlines() if path.exists() else []):
            result = json.loads(line)
            rows.setdefault(result["id"], []).append(result)
    return rows


@pytest.fixture(scope="module")
def driver_results(matrix):
    launch = matrix["launches"]["driver"]
    code = launch.wait(DRIVER_DEADLINE_S)
    return {"code": code, "rows": read_results(matrix["results"]), "lines": launch.lines, "seconds": launch.seconds}


def test_the_torchrun_driver_ran_every_row_on_both_ranks(driver_results):
    """One torchrun launch with 2 ranks ran every torchrun row in each worker and exited cleanly."""
    expected = [case.id for case in TABLE if "torchrun" in case.modes]
    assert driver_results["code"] == 0, driver_results["lines"][-40:]
    assert sorted(driver_results["rows"]) == sorted(expected)
    assert all(len(results) == 2 for results in driver_results["rows"].values())
    assert not [line for line in driver_results["lines"] if "Traceback" in line], driver_results["lines"][-40:]


@pytest.mark.parametrize("case", params("torchrun"))
def test_bad_input_under_torchrun(case, matrix, driver_results):
    """A learner typed the row's command with `torchrun --standalone --nproc_per_node=2 SCRIPT ...`."""
    results = driver_results["rows"].get(case.id, [])
    found = problems(case, results, matrix["ctx"]["torchrun"], "torchrun")
    assert not found, "\n".join(found)


def normalised(line, ctx):
    return line.replace(ctx.root, "ROOT")


def error_lines(lines):
    return [i for i, line in enumerate(lines) if line.startswith("error:")]


@pytest.mark.parametrize("launcher,row", [r for r in REAL_RUNS if r[0] == "python"], ids=lambda x: x)
def test_a_real_plain_python_launch_matches_the_in_process_verdict(launcher, row, matrix):
    """The learner's mistake in a real `python SCRIPT ...`: exit 2, one `error:` line, no traceback, nothing left
    behind, and the very line the in-process row printed (paths aside)."""
    case, launch = ROWS[row], matrix["launches"][(launcher, row)]
    code, lines, ctx = launch.wait(REAL_DEADLINE_S), launch.lines, matrix["ctx"][f"real-{launcher}"]
    result = {"id": row, "rank": 0, "code": code, "seconds": 0.0, "lines": lines, "escaped": None,
              "left_group": False}
    found = problems(case, [result], ctx, "python")
    assert not found, "\n".join(found)
    python_ctx = matrix["ctx"]["python"]
    in_process = matrix["in_process"].get(row) or run_in_process(case, python_ctx)
    [mine] = [line for line in in_process["lines"] if line.startswith("error:")]
    [real] = [lines[i] for i in error_lines(lines)]
    assert normalised(real, ctx) == normalised(mine, python_ctx)
    if case.setup == "used-output-dir":  # refused before anything slow: the lesson's first line, then the error
        assert lines[-1] == real and all(line.startswith("lesson 0") for line in lines[:-1]), lines
        # No slower than an argparse error, launched at the same moment: both are mostly Python's and torch's
        # imports (seconds, more under load). The absolute bound (< 2 s, no import) is the in-process row's.
        argparse_error = matrix["launches"][("python", "04-epochs-zero")]
        argparse_error.wait(REAL_DEADLINE_S)
        assert launch.seconds < argparse_error.seconds + 5, (launch.seconds, argparse_error.seconds)


@pytest.mark.parametrize("launcher,row", [r for r in REAL_RUNS if r[0] == "torchrun"], ids=lambda x: x)
def test_a_real_torchrun_launch_prints_the_course_line_before_torchruns_report(launcher, row, matrix):
    """A checkpoint-level mistake found AFTER init_process_group, on rank 0 only, in a real torchrun launch:
    the course's one `error:` line, then torchrun's own ChildFailedError report (its only traceback)."""
    case, launch = ROWS[row], matrix["launches"][(launcher, row)]
    code, lines, ctx = launch.wait(REAL_DEADLINE_S), launch.lines, matrix["ctx"][f"real-{launcher}"]
    assert code == 1, lines[-30:]
    [error] = error_lines(lines)
    assert all(n in lines[error] for n in ctx.resolve(case, case.needles)), lines[error]
    report = next(i for i, line in enumerate(lines) if "] failed (exitcode: " in line or line.startswith("Traceback"))
    child_failed = next(i for i, line in enumerate(lines)
                        if line.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError"))
    assert error < report < child_failed, lines
    found = torchrun_report_problems(lines, "torch.distributed.elastic.multiprocessing.errors.ChildFailedError")
    assert not found, "\n".join(found + lines[-40:])
    course = lines[:report]  # the workers' own lines: no traceback, no second error line
    others = [line for line in course if line.startswith("rank 1: stopping, a collective failed")]
    assert len(others) <= 1 and not [line for line in course if "Traceback" in line], course
    text = "\n".join(lines)
    exits = {int(r): int(c) for r, c in re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", text)}
    root = text.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s*\n\s*exitcode\s*:\s*2 ", root), root
    assert exits.get(0) == 2 and exits.get(1, 2) in (2, 1, -15), exits  # -15: torchrun's SIGTERM
    assert not leftovers(case, ctx)
