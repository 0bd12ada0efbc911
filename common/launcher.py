"""Start N CPU/gloo worker processes from a notebook and collect their results: launch(collective_workers.all_reduce).

A new process gets the function by reference (pickled by name) and cannot import a notebook's __main__: the worker
must live in a .py file. Each worker gets torchrun's variables (so a plain init_process_group("gloo") works), no GPU
(two processes cannot each have a GPU of their own on a one-GPU workstation) and its share of the CPU cores. What
the workers print is shown after they finish, rank 0's lines first (a notebook does not reliably show what child
processes print, and ranks printing at once would interleave). A worker's exception becomes WorkerError naming the
rank, a hang TimeoutError; the other workers are stopped.
"""
import io
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback


class WorkerError(RuntimeError):
    """A worker raised; ``rank`` says which and ``worker_traceback`` holds its traceback text."""

    def __init__(self, rank: int, message: str, worker_traceback: str = ""):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.worker_traceback = worker_traceback


def worker_environment(rank: int, world_size: int, port: int, threads: int) -> dict[str, str]:
    """The environment variables a worker runs with: torchrun's, no GPU, a share of the cores."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # rank 0 connects to the launcher's store instead of binding
            "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(threads)}


class _LineSender(io.TextIOBase):
    """A text stream that sends each complete line to the parent: (rank, "line", (stream, text))."""

    encoding = "utf-8"

    def __init__(self, rank: int, stream: str, results):
        self.rank, self.stream, self.results, self.pending = rank, stream, results, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        for line in lines:
            self.results.put((self.rank, "line", (self.stream, line)))
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.results.put((self.rank, "line", (self.stream, self.pending)))
            self.pending = ""


def _worker(rank: int, world_size: int, port: int, threads: int, payload: bytes, results) -> None:
    # Before fn's module is unpickled below: torchrun's variables, no GPU. torch, imported by the forkserver,
    # has not touched CUDA: it reads CUDA_VISIBLE_DEVICES at its first CUDA call, here in the worker.
    os.environ.update(worker_environment(rank, world_size, port, threads))
    sys.stdout = _LineSender(rank, "stdout", results)
    sys.stderr = _LineSender(rank, "stderr", results)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)  # N workers share the cores instead of each taking all of them
        fn, args = pickle.loads(payload)
        value = fn(*args)
        if dist.is_initialized():  # a worker that forgot to clean up must not block the others' exit
            # init_process_group returns once THIS rank's connections are made (no barrier after it unless
            # TORCH_DIST_INIT_BARRIER=1): leaving at once could close a socket that a slower rank is still
            # connecting to ("Gloo connectFullMesh failed ... Connection closed by peer").
            dist.barrier()
            dist.destroy_process_group()
        # Plain pickle copies tensors by value; torch's queue would share them through file
        # descriptors that vanish when this process exits.
        report, exit_code = (rank, "done", pickle.dumps(value)), 0
    except BaseException as exc:
        report, exit_code = (rank, "error", (f"{type(exc).__name__}: {exc}", traceback.format_exc())), 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Make sure our report is in the pipe (before the other ranks notice we are gone and report
    # errors of their own), then leave at once: no waiting for a collective after a failure, and
    # no slow interpreter shutdown (unloading torch can take seconds on a busy machine).
    results.put(report)
    results.close()
    results.join_thread()
    os._exit(exit_code)


def _context():
    """Fresh processes that start fast: forked from a server process that has imported torch once (it never
    touches a GPU, so each child still decides for itself what it sees). Where there is no forkserver, spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def launch(fn, nprocs: int = 2, args: tuple = (), timeout_s: float = 300.0) -> list:
    """Run ``fn(*args)`` in ``nprocs`` fresh CPU processes as ranks 0..nprocs-1; return their results by rank."""
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(f"{getattr(fn, '__name__', fn)} is defined in this notebook: the worker processes "
                        "cannot import it. Put it in a .py file next to the notebook and import it from there")
    payload = pickle.dumps((fn, tuple(args)))  # unpickled in the child only after its environment is set
    ctx = _context()
    results = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // nprocs)
    # The store the ranks meet at, bound here on a port the OS picks: choosing a free port and letting rank 0
    # bind it seconds later (after it has imported torch) loses the port now and then to another program.
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_worker, args=(r, nprocs, port, threads, payload, results), daemon=True)
             for r in range(nprocs)]
    lines: dict[int, list] = {r: [] for r in range(nprocs)}
    done: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    ok = False
    try:
        for p in procs:
            p.start()
        while len(done) < nprocs:
            try:
                rank, kind, value = results.get(timeout=0.2)
            except queue.Empty:
                # Nothing in the pipe: a process that has exited without reporting is dead.
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in done]
                if dead:
                    raise WorkerError(dead[0], f"exited with code {procs[dead[0]].exitcode} without reporting")
                if time.monotonic() > deadline:
                    missing = [r for r in range(nprocs) if r not in done]
                    raise TimeoutError(f"rank(s) {missing} did not finish within {timeout_s:.0f} s")
                continue
            if kind == "line":
                lines[rank].append(value)
            elif kind == "error":
                raise WorkerError(rank, *value)
            else:
                done[rank] = pickle.loads(value)
        ok = True
        return [done[r] for r in range(nprocs)]
    finally:
        for p in procs:
            if ok:
                p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join()
        for rank in range(nprocs):  # what the workers printed: rank 0's lines first, then rank 1's, ...
            for stream, text in lines[rank]:
                print(text, file=sys.stderr if stream == "stderr" else sys.stdout)
        sys.stdout.flush()
