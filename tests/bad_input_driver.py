"""Run every torchrun row of tests/bad_inputs.py in THIS worker, in-process, one after the other.

    torchrun --standalone --nproc_per_node=2 tests/bad_input_driver.py CONTEXT_JSON RESULTS_DIR [READY_FILE]

One torchrun launch for the whole table: a launch costs ~10 s, a row in-process milliseconds. Every rank runs
the same rows in the same order and appends each row's result (exit code, captured lines, ...) to
RESULTS_DIR/rank{R}.jsonl as soon as it is known, so a hang still leaves the rows before it. With READY_FILE
the workers start (import torch and the lessons) at once and begin the rows when that file exists: the test
writes it once the artifacts (checkpoints to resume from) and the rows' folders are in place.

Rows that call init_process_group make a new default group on torchrun's ONE store: each row gets its own
key space through TORCHELASTIC_RESTART_COUNT, which common.distributed.restart_safe_store turns into the
store prefix `attempt_<N>` (as for a real torchrun restart). run() destroys the group on exit 2 and 130, the
lesson's main() on success; run_in_process destroys any group still there (and reports it).
"""
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bad_inputs  # noqa: E402

READY_DEADLINE_S = 300


def main() -> None:
    ctx = bad_inputs.Context.from_json(sys.argv[1])
    results = Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    rows = [case for case in bad_inputs.build_table() if "torchrun" in case.modes]
    if os.environ.get("BAD_INPUT_ROWS"):  # a second launch for the rows whose group never formed (see the test)
        rows = [case for case in rows if case.id in os.environ["BAD_INPUT_ROWS"].split(",")]
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
    with open(results / f"rank{rank}.jsonl", "w") as out:
        for number, case in enumerate(rows):
            result = bad_inputs.run_in_process(case, ctx, env={"TORCHELASTIC_RESTART_COUNT": str(1000 + number)})
            out.write(json.dumps(result) + "\n")
            out.flush()
    print(f"driver rank {rank}: {len(rows)} rows done", flush=True)


if __name__ == "__main__":
    main()
