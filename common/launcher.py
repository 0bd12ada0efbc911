"""Start N CPU/gloo worker processes from a notebook (or any Python code) and collect their results.

Why not torch.multiprocessing.spawn with a function typed into the notebook? The spawn start
method pickles a function by reference, and a child cannot import a notebook's __main__. So the
worker must live in a .py file (e.g. a lesson script's ``main``) and we pass it by reference.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback

from common.distributed import free_port


class WorkerError(RuntimeError):
    """A worker raised; ``rank`` says which and ``worker_traceback`` holds its traceback text."""

    def __init__(self, rank: int, message: str, worker_traceback: str = ""):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.worker_traceback = worker_traceback


def _worker(rank: int, world_size: int, port: int, threads: int, fn, args, results) -> None:
    # The same variables torchrun would set, so the worker's setup() finds a 2-rank gloo job.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    from common.distributed import cleanup
    torch.set_num_threads(threads)  # N workers share the cores instead of each taking all of them
    try:
        # Plain pickle copies tensors by value; torch's queue would share them through file
        # descriptors that vanish when this process exits.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException as exc:
        results.put((rank, False, (f"{type(exc).__name__}: {exc}", traceback.format_exc())))
        raise SystemExit(1)
    finally:
        cleanup()


def launch(fn, nprocs: int = 2, args: tuple = (), timeout_s: float = 300.0) -> list:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes as ranks 0..nprocs-1; return their results by rank.

    ``fn`` must be importable (defined in a .py file). A worker's exception is re-raised here
    as WorkerError naming its rank; the other workers are stopped; nothing waits forever.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // nprocs)
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, nprocs, port, threads, fn, args, results), daemon=True)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    done: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < nprocs:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
                if dead:  # killed by a signal, or died before it could report
                    raise WorkerError(dead[0], f"exited with code {procs[dead[0]].exitcode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers did not finish within {timeout_s:.0f} s")
                continue
            if not ok:
                raise WorkerError(rank, *value)
            done[rank] = pickle.loads(value)
        return [done[r] for r in range(nprocs)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join()
