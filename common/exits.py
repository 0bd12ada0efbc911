"""The exit policy of every course script, `run(main)`: a failure a user can fix becomes ONE line and an exit code."""
import functools
import gc
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from common.distributed import get_rank
from common.errors import CourseError, one_line

OOM_ADVICE = "lower --batch-size, or shard the model with FSDP2 (lesson 05)"
INTERRUPTED = ("interrupted (Ctrl-C): the epoch in progress is lost; continue from the last checkpoint with the same "
               "command and --resume auto")


def out_of_memory_advice(advice: str):
    """`@out_of_memory_advice("...")` on a lesson's main: a CUDA out-of-memory error leaving it carries `advice` (the
    way out, for this lesson) to the one line run() prints, however main is called."""
    def decorate(main):
        @functools.wraps(main)
        def with_advice(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except torch.OutOfMemoryError as exc:
                exc.advice = advice
                raise
        return with_advice
    return decorate


def out_of_memory_line(exc: BaseException, advice: str) -> str:
    """`CUDA out of memory` as one line: which GPU, how full it was, and the way out (`advice`)."""
    where = ""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        where = f" on cuda:{device} ({torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB were allocated)"
    tried = str(exc).split(". ")[1] if ". " in str(exc) else ""  # e.g. "Tried to allocate 64.00 MiB"
    return one_line(f"CUDA out of memory{where}{'; ' + tried if tried else ''}: {advice}", 400)


class NoteCtrlC:
    """`with NoteCtrlC() as ctrl_c:` SIGINT raises KeyboardInterrupt, as Python's default handler does, and sets
    `ctrl_c.seen`. DCP catches a rank's KeyboardInterrupt and then gathers every rank's result; when the other ranks
    have already stopped for the same Ctrl-C, that gather fails, and only the note says it was a Ctrl-C.
    Left alone outside the main thread, or where SIGINT already has another handler."""
    def __init__(self):
        self.seen = False
        self._saved = None

    def _handler(self, signum, frame):
        self.seen = True
        signal.default_int_handler(signum, frame)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._saved = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            signal.signal(signal.SIGINT, self._saved)


def run(main, argv=None) -> None:
    """Call main(). Rank 0 prints `error: ...` and exits 2 for bad input (the other ranks, which meet the same problem,
    leave quietly) and for CUDA out of memory (with main's out_of_memory_advice, else OOM_ADVICE); exit 1 with one
    line on a rank whose collective broke because another rank stopped first; exit 130 for Ctrl-C outside a
    checkpointing stop, also when the Ctrl-C broke a collective (NoteCtrlC). Python bugs keep their traceback."""
    quiet = get_rank() != 0
    code, line, broken = 0, None, False
    try:
        with NoteCtrlC() as ctrl_c:
            main(argv)
        # destroy_process_group() leaves gloo's last tensors to its worker threads; freeing them now, not
        # during interpreter shutdown, avoids a "terminate called without an active exception" at exit.
        gc.collect()
    except CourseError as exc:
        code, line = 2, f"error: {exc}"
    except torch.OutOfMemoryError as exc:
        code, line = 2, f"error: {out_of_memory_line(exc, getattr(exc, 'advice', OOM_ADVICE))}"
    except KeyboardInterrupt:
        code, line = 130, INTERRUPTED
    except Exception as exc:
        text = str(exc)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            port, addr = os.environ.get("MASTER_PORT"), os.environ.get("MASTER_ADDR")
            code, line = 2, (f"error: MASTER_PORT {port} is already in use on {addr}: pick another, e.g. "
                             f"MASTER_PORT={port and int(port) + 1} (torchrun: --master_port or --rdzv_endpoint)")
        elif isinstance(exc, (dist.DistError, ConnectionError)) or any(broken in text for broken in (
                "Timed out waiting", "Connection closed by peer", "Connection reset by peer")):
            # A collective or the store failed: usually another rank exited first, and its own error says why.
            broken = True
            code, line, quiet = 1, (f"rank {get_rank()}: stopping, a collective failed, most likely because another "
                                    f"rank stopped first (see its error) ({one_line(exc, 120)})"), False
        else:
            raise
        if ctrl_c.seen:  # this rank's Ctrl-C, which DCP turned into a gather with ranks already gone
            code, line, quiet = 130, INTERRUPTED, get_rank() != 0
    except BaseException as exc:  # DCP's CheckpointException (not an Exception) carries each rank's failure
        if not any(isinstance(failure, KeyboardInterrupt) for failure, _ in getattr(exc, "failures", {}).values()):
            raise
        code, line = 130, INTERRUPTED  # Ctrl-C while dcp.save or dcp.load ran
    # Leave no group behind: a notebook may call main() again. After a broken collective only a gloo group is
    # destroyed; an NCCL one may wait in its shutdown for a peer that is gone, and the process exits anyway.
    if dist.is_initialized() and code and (not broken or dist.get_backend() == "gloo"):
        dist.destroy_process_group()
        gc.collect()
    if line and not quiet:
        print(line, file=sys.stderr, flush=True)
    if code:
        sys.exit(code)
