"""Lesson 02, exercises 2 and 3: does a run stopped after epoch 1 and resumed print the numbers of a run never stopped?

    python 02_singlegpu_training/solutions/resume_check.py /tmp/ex02-2
    python 02_singlegpu_training/solutions/resume_check.py /tmp/ex02-3 --script /tmp/keep_rng.py

Runs the lesson on a small synthetic set, under OUT (the runs, and the data unless --data-dir): 2 epochs
straight through; then 1 epoch into another folder, continued there with `--epochs 2 --resume auto`. --script
runs another copy of the lesson script (exercise 3: a copy with a patch applied). Prints both runs' epoch lines
without their seconds, and `same` or `DIFFERENT` for each epoch; exit code 0.

The answer to exercise 2: the checkpoint holds the weights, the optimizer and the schedule, not torch's random
generator. A resumed process seeds it with --seed again, so its epoch 2 draws epoch 1's data order and dropout
masks, not the ones the uninterrupted run drew for epoch 2. Exercise 3 saves the generator's state with the
epoch (torch.get_rng_state) and restores it on resume. On a GPU, dropout draws from the CUDA generator too
(torch.cuda.get_rng_state), and workers seed from the global one; a stop in the middle of an epoch still loses
that epoch's steps. The trainer resumes mid-epoch exactly (trainer/README.md).
"""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

COURSE = Path(__file__).resolve().parents[2]  # the course this solution belongs to
SMALL = ["--data", "synthetic", "--train-samples", "320", "--test-samples", "200", "--num-workers", "0"]


def lesson(script: Path, data: Path, *flags) -> str:
    """One run of the lesson script on the synthetic set in `data`; its output."""
    env = {**os.environ, "PYTHONPATH": str(COURSE)}  # `common`, also for a copy of the script outside the course
    command = [sys.executable, str(script), *SMALL, "--data-dir", str(data), *map(str, flags)]
    proc = subprocess.run(command, cwd=COURSE, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        sys.exit(f"error: this run failed (exit {proc.returncode}): {' '.join(command)}\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def epoch_lines(output: str) -> dict[int, str]:
    """epoch -> its line without the field that varies from run to run (the seconds)."""
    found = re.findall(r"^epoch (\d+): (.*), train [\d.]+ s$", output, re.M)
    return {int(epoch): line for epoch, line in found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a new folder for the data and the runs")
    parser.add_argument("--script", type=Path, default=COURSE / "02_singlegpu_training" / "mnist_singlegpu.py",
                        help="the lesson script to run (default: this course's)")
    parser.add_argument("--data-dir", type=Path, help="where the synthetic set is or goes (default: OUT/data)")
    args = parser.parse_args()
    script, out = args.script.resolve(), args.out.resolve()
    data = (args.data_dir or out / "data").resolve()

    whole = epoch_lines(lesson(script, data, "--epochs", 2, "--output-dir", out / "whole"))
    first = lesson(script, data, "--epochs", 1, "--output-dir", out / "stopped")
    resumed = lesson(script, data, "--epochs", 2, "--output-dir", out / "stopped", "--resume", "auto")
    print(next(line for line in resumed.splitlines() if line.startswith("resumed from")))
    stopped = {**epoch_lines(first), **epoch_lines(resumed)}
    for epoch in sorted(whole):
        verdict = "same" if stopped.get(epoch) == whole[epoch] else "DIFFERENT"
        print(f"epoch {epoch}: {verdict}\n  never stopped: {whole[epoch]}\n  stopped:       {stopped.get(epoch)}")


if __name__ == "__main__":
    main()
