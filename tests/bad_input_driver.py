"""Run the torchrun rows of tests/bad_inputs.py in THIS worker, in-process, one after the other.

    torchrun --standalone --nproc_per_node=2 tests/bad_input_driver.py CONTEXT_JSON RESULTS_DIR [READY_FILE]

One torchrun launch for all of them: a launch costs ~10 s, a row in-process milliseconds. Every rank runs
the same rows in the same order and appends each row's result (exit code, captured lines, ...) to
RESULTS_DIR/rank{R}.jsonl as soon as it is known, so a hang still leaves the rows before it. With READY_FILE
the workers start (import torch and the lessons) at once and begin the rows when that file exists: the test
writes it once the artifacts (checkpoints to resume from) and the rows' folders are in place.

Rows that call init_process_group make a new default group on torchrun's ONE store: each row gets its own
key space through TORCHELASTIC_RESTART_COUNT, which common.distributed.restart_safe_store turns into the
store prefix `attempt_<N>` (as for a real torchrun restart). run() destroys the group on exit 2 and 130, the
lesson's main() on success; run_in_process destroys any group still there (and reports it).

The ranks begin each row together (a barrier on torchrun's store, outside the rows' own groups). Without it a
rank that left row N early (its error, quiet exit) could give up on row N+1's rendezvous after
DIST_TIMEOUT_SECONDS while its peer was still held in row N by the same timeout; the giving-up rank's address
stayed in the store, and the late peer's gloo connectFullMesh then connected to a listener that no longer
existed: "timed out connecting: SO_ERROR: Connection refused".
"""
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bad_input_runs  # noqa: E402
import bad_inputs  # noqa: E402

READY_DEADLINE_S = 300


def main() -> None:
    ctx = bad_input_runs.Context.from_json(sys.argv[1])
    results = Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    rows = [case for case in bad_inputs.build_table() if "torchrun" in case.modes]
    for script in {case.script for case in rows}:
        bad_inputs.load_script(script)  # the imports, while the test still makes the artifacts
    gc.collect()
    gc.freeze()  # run() calls gc.collect() after each row: without this it walks all of torch's objects each time
    if len(sys.argv) > 3:
        deadline = time.monotonic() + READY_DEADLINE_S
        while not Path(sys.argv[3]).exists():
            if time.monotonic() > deadline:
                sys.exit(f"driver rank {rank}: {sys.argv[3]} did not appear within {READY_DEADLINE_S} s")
            time.sleep(0.05)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=datetime.timedelta(seconds=READY_DEADLINE_S)))
    with open(results / f"rank{rank}.jsonl", "w") as out:
        for number, case in enumerate(rows):
            if store.add(f"driver/row{number}", 1) == world:  # every rank is here: the row may begin
                store.set(f"driver/row{number}/all", "1")
            store.wait([f"driver/row{number}/all"])
            result = bad_input_runs.run_in_process(case, ctx, env={"TORCHELASTIC_RESTART_COUNT": str(1000 + number)})
            out.write(json.dumps(result) + "\n")
            out.flush()
    print(f"driver rank {rank}: {len(rows)} rows done", flush=True)


if __name__ == "__main__":
    main()
