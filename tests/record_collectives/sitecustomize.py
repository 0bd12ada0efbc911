"""Records every torch.distributed collective that a lesson script runs through `common`, for
tests/test_collectives_visible.py. Installed from OUTSIDE the course's code, like tests/inject:

    PYTHONPATH=tests/record_collectives RECORD_COLLECTIVES=FOLDER torchrun ... trainer/train.py --parallel ddp ...

Each call of a wrapped collective walks the Python stack from the call outwards to the first frame of a lesson
script (a file in a folder NN_name of the course, or in trainer/). If a frame of common/ lies in between, the call
is recorded: the collective's name, the common function that ran it, and the lesson's call site (file, first and
last line of the call expression). Each rank writes FOLDER/rank-R.json at exit. A collective that another collective
runs (e.g. the all_gather inside all_gather_object) is not recorded twice.
"""
import os

_FOLDER = os.environ.get("RECORD_COLLECTIVES")

if _FOLDER:
    import atexit
    import functools
    import json
    import re
    import sys
    import threading
    from pathlib import Path

    import torch.distributed as dist

    _COURSE = Path(__file__).resolve().parents[2]
    _COMMON = _COURSE / "common"
    # Every collective function of torch.distributed, whatever this torch version adds (all_gather_single, ...).
    # Not isend and irecv: dist.P2POp takes them as values and checks which one it got (lesson 07's PipelineStage);
    # a pipeline's sends and receives still pass through batch_isend_irecv.
    _PATTERN = r"(all_|reduce|broadcast|gather|scatter|barrier|monitored_barrier|send|recv|batch_isend)"
    _NAMES = [name for name, value in vars(dist).items()
              if callable(value) and not isinstance(value, type) and re.match(_PATTERN, name)]
    _calls, _inside = [], threading.local()

    def _where(path: str):
        """'common', 'lesson' (a lesson's folder or trainer/) or None (torch, tests, the standard library)."""
        path = Path(path).resolve()
        if _COMMON in path.parents:
            return "common"
        parts = path.relative_to(_COURSE).parts if _COURSE in path.parents else ()
        lesson = parts and (parts[0] == "trainer" or parts[0][:2].isdigit() and parts[0][2:3] == "_")
        return "lesson" if lesson else None

    def _record(name: str) -> None:
        frame, through = sys._getframe(2), None  # the caller of the wrapper
        while frame is not None:
            kind = _where(frame.f_code.co_filename)
            if kind == "common":  # the last one before the lesson: the function the lesson called
                through = f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_qualname}"
            if kind == "lesson":
                if through:
                    # The call being made: its expression's first and last line (a call may span lines).
                    first, last = list(frame.f_code.co_positions())[frame.f_lasti // 2][:2]
                    _calls.append({"collective": name, "through": through, "file": frame.f_code.co_filename,
                                   "first_line": first, "last_line": last})
                return
            frame = frame.f_back

    def _wrap(name: str, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if getattr(_inside, "depth", 0) == 0:
                _record(name)
            _inside.depth = getattr(_inside, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                _inside.depth -= 1
        return wrapper

    for _name in _NAMES:
        setattr(dist, _name, _wrap(_name, getattr(dist, _name)))

    @atexit.register
    def _write() -> None:
        if "RANK" in os.environ:  # a worker, not torchrun's own process
            Path(_FOLDER).mkdir(parents=True, exist_ok=True)
            Path(_FOLDER, f"rank-{os.environ['RANK']}.json").write_text(json.dumps(_calls, indent=1))
