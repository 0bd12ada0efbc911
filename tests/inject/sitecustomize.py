"""Fault injection for tests and exercises, installed from OUTSIDE the course's code.

Python imports `sitecustomize` at start-up from the first folder on sys.path that has one, so putting
this folder first on PYTHONPATH installs it in every Python process of a job (torchrun's workers, srun
tasks, the notebook launcher's workers) without a line in the lessons:

    PYTHONPATH=tests/inject FAIL_AT_STEP=1:12:USR1 torchrun --standalone --nproc_per_node=2 trainer/train.py ...

FAIL_AT_STEP=RANK:STEP[:ACTION], at that optimizer step of the first epoch the process trains:
    (no action)  that rank raises RuntimeError, like a crash
    USR1 / TERM / INT / KILL   it sends itself that signal, as Slurm, Ctrl-C or the OOM killer would
    WAIT         it prints `inject: rank R waits at epoch E step S` and waits (up to 120 s) for a signal, so a
                 test can send one at a point the job itself reported, not after a guessed sleep
SIGNAL_AT_EVAL=RANK:N[:SIGNAL], a signal after training, where no step hook reaches: rank RANK sends itself SIGNAL
(default USR1) when it starts its N-th pass over an evaluation set (common.samplers.EvalSampler iterated), e.g. the
test of the last epoch: after that epoch's last stop vote, before its checkpoint.
Not again after torchrun restarts the workers (TORCHELASTIC_RESTART_COUNT > 0).
"""
import os

_SPEC = os.environ.get("FAIL_AT_STEP")
_EVAL_SPEC = os.environ.get("SIGNAL_AT_EVAL")
_FIRST_START = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

if (_SPEC or _EVAL_SPEC) and _FIRST_START:
    import signal
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # THIS course's common, not an installed one
    from common.distributed import get_rank

if _EVAL_SPEC and _FIRST_START:
    import common.samplers

    _eval_rank, _eval_pass, _eval_signal = (_EVAL_SPEC.split(":") + ["USR1"])[:3]
    _original_iter, _passes = common.samplers.EvalSampler.__iter__, [0]

    def _eval_iter(self):
        if get_rank() == int(_eval_rank):
            _passes[0] += 1
            if _passes[0] == int(_eval_pass):
                print(f"inject: rank {get_rank()} sends itself SIG{_eval_signal} in evaluation pass {_passes[0]}",
                      flush=True)
                os.kill(os.getpid(), getattr(signal, "SIG" + _eval_signal))
        return _original_iter(self)

    common.samplers.EvalSampler.__iter__ = _eval_iter

if _SPEC and _FIRST_START:
    import common.position

    _rank, _step, _action = (_SPEC.split(":") + [""])[:3]
    _original = common.position.Position.remaining
    _fired, _first_epoch = False, None

    def _wait_for_a_signal(epoch: int, step: int) -> None:
        arrived = []
        chained = {}
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            def handler(signum, frame, previous=signal.getsignal(sig)):
                arrived.append(signum)
                if callable(previous):
                    previous(signum, frame)
            chained[sig] = signal.signal(sig, handler)
        sys.stdout.write(f"inject: rank {get_rank()} waits at epoch {epoch} step {step}\n")
        sys.stdout.flush()
        deadline = time.monotonic() + 120
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.05)
        for sig, previous in chained.items():
            signal.signal(sig, previous)

    def _fire(position) -> None:
        if not _action:
            raise RuntimeError(f"FAIL_AT_STEP: rank {get_rank()} fails at step {position.step} on purpose")
        if _action == "WAIT":
            _wait_for_a_signal(position.epoch, position.step)
        else:
            os.kill(os.getpid(), getattr(signal, "SIG" + _action))

    def _remaining(self, loader, args):
        global _fired, _first_epoch
        _first_epoch = _first_epoch or self.epoch  # a resumed job's first epoch may start past STEP: then never
        for batch in _original(self, loader, args):
            if not _fired and self.epoch == _first_epoch and get_rank() == int(_rank) and self.step == int(_step):
                _fired = True
                _fire(self)
            yield batch

    common.position.Position.remaining = _remaining
