"""Printing from many processes: rank 0 speaks, the others stay quiet unless asked.

A tqdm bar is drawn on rank 0 only and only on a terminal: in a Slurm log file a bar turns into thousands of
carriage returns, so there a plain progress line is printed every 30 seconds instead.
"""
import sys
import time
from typing import Iterable

from tqdm import tqdm

from common.distributed import get_rank, is_main_process


def plural(n: int, word: str) -> str:
    """'1 epoch', '2 epochs'."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def log0(*args, sep=" ", end="\n", **kwargs) -> None:
    """print() on the main process only, flushed so it shows up in Slurm logs right away; text and end in ONE
    write, as write_line() does, so another rank's line cannot land between them."""
    if is_main_process():
        print(sep.join(map(str, args)) + end, end="", flush=True, **kwargs)


def write_line(line: str) -> None:
    """One line in ONE write. print() writes the text and the newline separately, and the lines of ranks
    sharing a terminal or log file would interleave: "[rank 1] pid 17465[rank 0] pid 17464"."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def log_all(*args) -> None:
    """print() on every rank, prefixed with the rank, for the few lines each rank must say."""
    write_line(" ".join([f"[rank {get_rank()}]", *map(str, args)]))


def _periodic(iterable: Iterable, desc: str, total: int, every_s: float = 30.0):
    last = time.monotonic()
    for i, item in enumerate(iterable, 1):
        yield item
        if time.monotonic() - last >= every_s:
            print(f"{desc}: step {i}/{total}", flush=True)
            last = time.monotonic()


def progress_bar(iterable: Iterable, desc: str = "", total: int | None = None) -> Iterable:
    """A progress bar (terminal) or periodic lines (log file) on rank 0; the bare iterable elsewhere."""
    if not is_main_process():
        return iterable
    total = len(iterable) if total is None else total
    if sys.stderr.isatty():
        return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)
    return _periodic(iterable, desc, total)
