"""Lesson 02, exercises 2 and 3: does a stopped and resumed run print the numbers of a run never stopped?

    python 02_singlegpu_training/solutions/resume_check.py /tmp/ex02-2
    python 02_singlegpu_training/solutions/resume_check.py /tmp/ex02-3 --script COPY.py --stop-between-epochs

Runs the lesson on a small synthetic set, under OUT (the runs, and the data unless --data-dir): 2 epochs
straight through, and the same 2 epochs with a stop in between, continued with `--resume auto`. The stop is
a Ctrl-C at step 3 of epoch 1 (the course's fault injection sends the SIGINT: PYTHONPATH=tests/inject
FAIL_AT_STEP=0:3:INT), or with --stop-between-epochs the end of epoch 1 (--epochs 1, then --epochs 2).
--script runs another copy of the lesson script (exercise 3: a copy with a patch applied). Prints both runs'
epoch lines without their seconds and img/s, and `same` or `DIFFERENT` for each epoch; exit code 0.
"""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

COURSE = Path(__file__).resolve().parents[2]  # the course this solution belongs to
SMALL = ["--data", "synthetic", "--train-samples", "320", "--test-samples", "200", "--num-workers", "0"]


def lesson(script: Path, data: Path, *flags, inject: str | None = None) -> str:
    """One run of the lesson script on the synthetic set in `data`; its output."""
    path = [str(COURSE)]  # `common`, also for a copy of the script outside the course
    if inject:  # tests/inject/sitecustomize.py: the process sends itself the signal at that step
        path.insert(0, str(COURSE / "tests" / "inject"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **({"FAIL_AT_STEP": inject} if inject else {})}
    command = [sys.executable, str(script), *SMALL, "--data-dir", str(data), *map(str, flags)]
    proc = subprocess.run(command, cwd=COURSE, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        sys.exit(f"error: this run failed (exit {proc.returncode}): {' '.join(command)}\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def epoch_lines(output: str) -> dict[int, str]:
    """epoch -> its line without the two fields that vary from run to run (seconds, images per second)."""
    lines = {}
    for line in output.splitlines():
        found = re.match(r"epoch (\d+) \| (.*) \| [\d.]+ s \| [\d,]+ img/s$", line)
        if found:
            lines[int(found.group(1))] = found.group(2)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a new folder for the data and the runs")
    parser.add_argument("--script", type=Path, default=COURSE / "02_singlegpu_training" / "mnist_singlegpu.py",
                        help="the lesson script to run (default: this course's)")
    parser.add_argument("--data-dir", type=Path, help="where the synthetic set is or goes (default: OUT/data)")
    parser.add_argument("--stop-between-epochs", action="store_true", help="stop after epoch 1, not at its step 3")
    args = parser.parse_args()
    script, out = args.script.resolve(), args.out.resolve()
    data = (args.data_dir or out / "data").resolve()

    whole = epoch_lines(lesson(script, data, "--epochs", 2, "--output-dir", out / "whole"))
    stopped_dir = out / "stopped"
    if args.stop_between_epochs:
        first = lesson(script, data, "--epochs", 1, "--output-dir", stopped_dir)
    else:
        first = lesson(script, data, "--epochs", 2, "--output-dir", stopped_dir, inject="0:3:INT")
    said = [line for line in first.splitlines() if line.startswith("stopped by")]
    print(said[0] if said else "stopped after epoch 1")
    resumed = lesson(script, data, "--epochs", 2, "--output-dir", stopped_dir, "--resume", "auto")
    print(next(line for line in resumed.splitlines() if line.startswith("resume:")))
    stopped = {**epoch_lines(first), **epoch_lines(resumed)}  # a Ctrl-C in epoch 1 prints no line for it
    for epoch in sorted(whole):
        verdict = "same" if stopped.get(epoch) == whole[epoch] else "DIFFERENT"
        print(f"epoch {epoch}: {verdict}\n  never stopped: {whole[epoch]}\n  stopped:       {stopped.get(epoch)}")


if __name__ == "__main__":
    main()
