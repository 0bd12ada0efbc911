"""A slow checkpoint writer for tests of lesson 08's --async-checkpoint, installed from OUTSIDE the course's code:

    PYTHONPATH=tests/slow_save SLOW_CHECKPOINT=delay:2 torchrun ... 08_your_model/digits_lm.py --async-checkpoint

SLOW_CHECKPOINT=delay:S   every DCP file write waits S seconds first: the next epoch trains while it is pending
SLOW_CHECKPOINT=hang:N    the N-th write of each process prints `inject: rank R write N pending` and waits (up to
                          120 s) to be killed: a crash while an async save is pending, at a point the job reported
"""
import os

_SPEC = os.environ.get("SLOW_CHECKPOINT")

if _SPEC:
    import time

    from torch.distributed.checkpoint import filesystem

    _mode, _value = _SPEC.split(":")
    _original, _writes = filesystem._FileSystemWriter.write_data, []

    def write_data(self, plan, planner):
        _writes.append(plan)
        if _mode == "delay":
            time.sleep(float(_value))
        elif len(_writes) == int(_value):
            print(f"inject: rank {os.environ.get('RANK', '0')} write {len(_writes)} pending", flush=True)
            time.sleep(120)
        return _original(self, plan, planner)

    filesystem._FileSystemWriter.write_data = write_data
