"""Walk a page of the course as a learner does, and check that it shows what its commands print.

    .venv/bin/python tests/walk.py 04_ddp_training/README.md --print   # each block's real output, to paste
    .venv/bin/python tests/walk.py                                    # every page (tests/test_readme_walk.py)

The pages: README.md, then each lesson's README.md and reference.md. Each page is walked on its own, in a
fresh copy of the course (tests/course_copy.py: the files git tracks or would track, no runs/, no data/),
from the course folder, with the learner's environment (the venv first on PATH, OMP_NUM_THREADS unset,
PYTHONUNBUFFERED=1; and OMP_WAIT_POLICY=PASSIVE, so that torch's idle threads sleep instead of spinning on cores
the tests share: the same numbers, printed sooner). Real MNIST goes to data/MNIST/raw when it can be found
($MNIST_DIR, else ../shared/data/mnist next to the course: a folder holding MNIST/raw); without it, the blocks
that train on it are skipped, and say so.

Every ```bash block runs exactly as written (bash -euo pipefail), one after the other, except: a block whose
first line is a comment naming GPUs, Slurm, a cluster or the internet (left to their own tests), `make test`
lines (this walk is part of it), and `diff` lines, which get `|| true` (differing is their point). The ```text
(or bare ```) block right after it is what it shows. The block must exit 0, or fail when it shows `error:`
(or print that error and handle it itself: `cmd || echo "exit code $?"`).
Every shown line that starts with a word the scripts print (CHECKED) must equal a printed line, once times,
rates, hosts, ports, pids and temporary paths are masked (MASKS); `...` inside a line stands for elided text.
Numbers that depend on the order of floating-point sums (losses, accuracies and their correct counts) need only
be within TOLERANCE of the shown ones: the course's convention, stated once in README.md ("Your digits"), where
the headroom rule is stated too (HEADROOM: half of it under other CPU kernels, tests/test_readme_walk.py).
A block that prints more such lines than it shows must show a `...` line.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from course_copy import find_mnist, prepare, run_block

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TIMEOUT_S = 300  # a block should take ~15 s on a 2-core laptop; this only stops a hang

LEFT_OUT = re.compile(r"^#.*\b(GPUs?|Slurm|cluster|internet)\b", re.IGNORECASE)
# Commands that read real MNIST: a lesson's training script, predict.py, the download, `make demo`, lesson 08's port.
READS_MNIST = re.compile(r"(\bmnist_\w+\.py|\bpredict\.py|\bdownload_mnist\.py|\bmake\s+demo|\bport/train\w*\.py)\b")
SYNTHETIC = re.compile(r"--data[ =]synthetic\b|--synthetic\b")
CHECKED = ("epoch ", "resume:", "lesson 0", "error:", "OK:", "preempted:", "target accuracy", "nothing to train",
           "[rank ", "rank ", "verdict", "interrupted", "early stopping", "best epoch", "stopped by", "profile:",
           "wrote ", "accuracy ", "mnist ready", "synthetic ready", "train with:", "NOTICE:", "metrics:", "warning:")
PROGRESS = re.compile(r"^epoch \d+: step \d+/\d+$")  # printed every 30 s of an epoch: how many depends on the machine
MASKS = [  # what differs between two runs of the same command; order matters (rates before times)
    (re.compile(r"/tmp/\S+"), "<tmp>"),
    (re.compile(r"\d[\d,]*(\.\d+)? ?(img|images|samples|steps|it|tokens|[KMGT]i?B)/s\b"), "<rate>"),
    (re.compile(r"\b\d+:\d\d(:\d\d)?(\.\d+)?\b"), "<clock>"),
    (re.compile(r"\b\d+(\.\d+)? ?(ms|us|µs|s|sec|seconds|min)\b"), "<time>"),
    (re.compile(r"\b\d{8}-\d{6}\b"), "<date>"),
    (re.compile(r"\bhost \S+"), "host <host>"),
    (re.compile(r"(?i)(?<![a-z])(master_port|port|pid)([ =:]+)\d+"), r"\1\2<n>"),
    (re.compile(r"(?<=:)\d{4,5}\b"), "<port>"),
]


# How far a learner's number may be from the page's: the CPU's instruction set (AVX2, AVX-512, ARM), the thread
# count and cuDNN change the order of floating-point sums, and training amplifies the last digits. Everything else
# (counts of images, steps and test images, sizes, names) must be exact.
TOLERANCE = {"accuracy": 0.02,  # absolute: 2 points of accuracy; the correct count within 2% of the test images
             "loss": 0.10,      # relative: 10% of the page's loss,
             "loss_abs": 0.02}  # or 0.02 where that is more (a small loss moves by more than 10% of itself)
# The headroom rule: under other kernels on the developers' host (AVX2, no vector kernels), a page's number holds
# within half the tolerance, because another host moves further than a forced kernel setting does (docs/tests.md,
# "Digits across CPUs": an AMD EPYC AVX2 host put four blocks outside the tolerance that forced kernels had kept in).
HEADROOM = {kind: limit / 2 for kind, limit in TOLERANCE.items()}
# accuracy 0.9880 (988/1000), or the teaching scripts' accuracy 988/1000: a correct count of N test images
VARIES = re.compile(r"(?<=accuracy )\d+\.\d+|(?<=loss )\d+\.\d+|(?<=\()\d+(?=/\d+\))|(?<=accuracy )\d+(?=/\d+)")


@dataclass
class Block:
    line: int  # of the ```bash fence in the page
    commands: str
    shown: str | None  # the output block right after it, if any


@dataclass
class Outcome:
    block: Block
    status: str  # ok | failed | skipped | left out
    seconds: float = 0.0
    output: str = ""
    problems: list[str] = field(default_factory=list)


def pages(course: Path = ROOT) -> list[str]:
    """README.md, then each lesson folder's README.md and reference.md, in course order."""
    found = ["README.md"] if (course / "README.md").is_file() else []
    for lesson in sorted(p for p in course.glob("0*") if p.is_dir()):
        found += [f"{lesson.name}/{name}" for name in ("README.md", "reference.md") if (lesson / name).is_file()]
    return found


def blocks(text: str) -> list[Block]:
    fences = list(re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S))
    found = []
    for i, fence in enumerate(fences):
        if fence.group(1) != "bash":
            continue
        nxt = fences[i + 1] if i + 1 < len(fences) else None
        shown = nxt.group(2) if nxt and nxt.group(1) in ("", "text") and not text[fence.end():nxt.start()].strip() \
            else None
        found.append(Block(text.count("\n", 0, fence.start()) + 1, fence.group(2), shown))
    return found


def as_run(commands: str) -> str:
    """The block as the walk runs it: without `make test`, with `diff` allowed to differ."""
    commands = re.sub(r"^make test\b.*$", "", commands, flags=re.M)
    return re.sub(r"^(diff [^\n]*?[^\\\n])(\s+#[^\n]*)?$", r"\1 || true\2", commands, flags=re.M)


def reads_real_mnist(commands: str) -> bool:
    """Whether a command of the block trains on (or downloads) real MNIST: no --data synthetic on its line."""
    joined = re.sub(r"\\\n", " ", commands)
    return any(READS_MNIST.search(line) and not SYNTHETIC.search(line)
               for line in joined.splitlines() if not line.lstrip().startswith("#"))


def mask(line: str) -> str:
    line = line.rstrip()
    for pattern, replacement in MASKS:
        line = pattern.sub(replacement, line)
    return line


def compare(shown: str, printed: str, tolerance: dict = TOLERANCE) -> list[str]:
    """What is wrong with a shown output block, given what its commands printed ([]: nothing)."""
    out = [mask(line) for line in printed.splitlines()]
    available = [line for line in out if line.startswith(CHECKED) and not PROGRESS.match(line)]
    printed_checked = len(available)
    problems, shown_checked = [], 0
    for line in shown.splitlines():
        if not line.startswith(CHECKED):
            continue
        shown_checked += 1
        want = mask(line)
        pattern, kinds = _pattern(want, tolerant=True)
        match = next((i for i, real in enumerate(available) if _within(pattern.fullmatch(real), want, kinds, tolerance)),
                     None)
        if match is None:
            close = difflib.get_close_matches(want, available, n=1, cutoff=0)
            problems.append(f"shows      {line.rstrip()}\n  printed no such line (within {_name(tolerance)})" +
                            (f"; the closest (masked) is\n             {close[0]}" if close else ""))
        else:
            available.pop(match)
    if printed_checked > shown_checked and not any(line.strip() == "..." for line in shown.splitlines()):
        problems.append(f"a block that shows fewer lines than are printed says so: it shows {shown_checked} of the "
                        f"{printed_checked} checked lines printed and has no `...` line")
    return problems


def _pattern(masked: str, tolerant: bool = False):
    """A masked shown line as a pattern: literal, but `...` stands for any text. tolerant: each number that VARIES
    is a group, and the pattern comes with those numbers' kinds (accuracy, loss, or the test set's size of a count)."""
    if not tolerant:
        return re.compile(".*".join(map(re.escape, masked.split("..."))))
    parts, kinds, at = [], [], 0
    for number in VARIES.finditer(masked):
        parts.append(".*".join(map(re.escape, masked[at:number.start()].split("..."))))
        parts.append(r"(\d+(?:\.\d+)?)")
        before = masked[:number.start()]
        count = re.match(r"/(\d+)", masked[number.end():])  # `(988/1000)` or `accuracy 988/1000`: a count
        kinds.append(int(count.group(1)) if count else "loss" if before.endswith("loss ") else "accuracy")
        at = number.end()
    parts.append(".*".join(map(re.escape, masked[at:].split("..."))))
    return re.compile("".join(parts)), kinds


def _within(match: re.Match | None, want: str, kinds: list, tolerance: dict) -> bool:
    """Whether each varying number of a printed line is within `tolerance` of the shown one."""
    if match is None:
        return False
    shown = [float(m.group()) for m in VARIES.finditer(want)]
    for kind, page, printed in zip(kinds, shown, map(float, match.groups())):
        limit = (max(tolerance["loss"] * page, tolerance["loss_abs"]) if kind == "loss" else
                 tolerance["accuracy"] if kind == "accuracy" else
                 tolerance["accuracy"] * kind)  # a correct count out of `kind` test images
        if abs(printed - page) > limit + 1e-9:
            return False
    return True


def _name(tolerance: dict) -> str:
    return "HEADROOM, half the TOLERANCE" if tolerance == HEADROOM else "TOLERANCE"


def check(block: Block, code: int, out: str, tolerance: dict = TOLERANCE) -> list[str]:
    shown = block.shown or ""
    problems = []
    expect_error = any(line.startswith("error:") for line in shown.splitlines())
    handled = "||" in block.commands  # `cmd || echo "exit code $?"`: the block itself shows the failure
    if (code != 0 and not expect_error) or (code == 0 and expect_error and not handled):
        problems.append(f"exit {code}, but the page shows {'an error' if expect_error else 'no error'}")
    # torchrun reports a failed worker with a traceback of its own (ChildFailedError); any other is a crash
    tracebacks = out.count("Traceback (most recent call last)") - len(re.findall(r"^\S*ChildFailedError:", out, re.M))
    printed = [mask(line) for line in out.splitlines()]
    shows_crash = "Traceback" in shown or any(  # or the exception line that ends it, e.g. `[rank0]: RuntimeError: ...`
        "Error" in line and not line.startswith("error:") and any(_pattern(mask(line)).fullmatch(real) for real in printed)
        for line in shown.splitlines())
    if tracebacks > 0 and not shows_crash:
        problems.append("a traceback the page does not show")
    warning = re.search(r"^.*\b\w*Warning: .*$", out, re.M)
    if warning and warning.group(0).strip() not in shown:
        problems.append(f"a Python warning the page does not show: {warning.group(0).strip()}")
    return problems + (compare(shown, out, tolerance) if block.shown is not None else [])


def walk_page(page: Path, course: Path = ROOT, workdir: Path | None = None, mnist: Path | None = None,
              timeout: float = BLOCK_TIMEOUT_S, report=None, extra_env: dict | None = None) -> list[Outcome]:
    """Run every block of `page` (a path inside `course`) in a fresh copy of the course under `workdir`."""
    with tempfile.TemporaryDirectory(prefix="walk-", dir=workdir) as tmp:
        copy = Path(tmp) / "course"
        env = prepare(course, copy, mnist, extra_env)
        outcomes, skipped_at = [], None
        for block in blocks((copy / page.relative_to(course)).read_text()):
            commands = as_run(block.commands)
            if not commands.strip() or LEFT_OUT.match(block.commands.strip()):
                outcome = Outcome(block, "left out")
            elif mnist is None and reads_real_mnist(commands):
                outcome = Outcome(block, "skipped", problems=["trains on real MNIST, which is not here "
                                                              "(set MNIST_DIR to a folder holding MNIST/raw)"])
                skipped_at = skipped_at or block.line
            else:
                start = time.monotonic()
                code, out = run_block(commands, copy, env, timeout)
                outcome = Outcome(block, "ok", time.monotonic() - start, out, check(block, code, out))
                if outcome.problems:
                    outcome.status = "failed"
                    if skipped_at:  # it may need what the skipped block would have written
                        outcome.status = "skipped"
                        outcome.problems.append(f"an earlier block (line {skipped_at}) was skipped: no real MNIST")
            outcomes.append(outcome)
            if report:
                report(outcome)
    return outcomes


def describe(page: str, outcome: Outcome) -> str:
    head = f"{page}:{outcome.block.line}: {outcome.status}" + (f" ({outcome.seconds:.1f} s)" if outcome.seconds else "")
    if outcome.status == "ok":
        return head
    detail = "\n".join(f"  {p}" for p in outcome.problems)
    if outcome.status == "failed":
        detail += f"\n  the block:\n{_indent(outcome.block.commands)}  printed:\n{_indent(outcome.output[-3000:])}"
    return f"{head}\n{detail}" if detail.strip() else head


def _indent(text: str) -> str:
    return "".join(f"    {line}\n" for line in text.rstrip().splitlines())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Walk pages of the course: run their blocks, compare outputs.")
    parser.add_argument("pages", nargs="*", help="pages, relative to the course folder (default: every page)")
    parser.add_argument("--print", action="store_true", help="print each block and its real output, to paste")
    parser.add_argument("--timeout", type=float, default=BLOCK_TIMEOUT_S, help="seconds a block may take")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set in every block's environment, e.g. OMP_NUM_THREADS=1 (repeatable)")
    args = parser.parse_args(argv)
    mnist = find_mnist()
    print(f"real MNIST: {mnist or 'not found (set MNIST_DIR): its blocks are skipped'}")
    failed = 0
    for page in args.pages or pages():
        start = time.monotonic()

        def report(outcome, page=page):
            if args.print and outcome.status != "left out":
                print(f"--- {page}:{outcome.block.line}\n$ {outcome.block.commands.rstrip()}\n{outcome.output.rstrip()}")
            print(describe(page, outcome), flush=True)

        outcomes = walk_page((ROOT / page).resolve(), ROOT, mnist=mnist, timeout=args.timeout, report=report,
                             extra_env=dict(item.split("=", 1) for item in args.env))
        counts = {s: sum(o.status == s for o in outcomes) for s in ("ok", "failed", "skipped", "left out")}
        failed += counts["failed"]
        print(f"== {page}: " + ", ".join(f"{n} {s}" for s, n in counts.items()) +
              f" in {time.monotonic() - start:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
