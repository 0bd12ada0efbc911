"""Every collective the trainer runs through `common` is visible at its call site (--parallel ddp, fsdp2, pp: today's
lessons 04, 05 and 07, whose production features, the stop votes and mid-epoch positions, it keeps). The call sites
lie in the strategy's module or in the shared ones (trainer/loop.py, state.py, data.py, warmup.py): every file of
trainer/ that calls into common is checked, each call site on its own.

A collective hangs unless every rank calls it, so a reader of these files must see each one: by the
call's own name (`meter.all_reduce()`, `barrier=dist.barrier`) or by a comment on the call or directly above it
("a collective"). One real 2-rank run of each strategy records, with tests/record_collectives/sitecustomize.py, every
torch.distributed collective whose stack passes through common/ and the trainer's line that called into common.
"""
import json
import tokenize
from collections import Counter
from io import StringIO
from pathlib import Path

from lessons import PARALLEL, ROOT, SCRIPTS, assert_clean, run_script, run_trainer

TINY = ("--data", "synthetic", "--train-samples", 256, "--test-samples", 64, "--epochs", 1, "--num-workers", 0)
# (collective, the common function the lesson called): how often each rank runs it in one epoch of TINY.
EVERY_LESSON = {("barrier", "data.load_mnist"): 1,  # rank 0 prepares the files, the others wait
                ("all_reduce", "signals.StopSignals.agreed"): 2,  # the vote at step 0, and at the epoch's end
                ("all_reduce", "metrics.EpochMeter.all_reduce"): 4,  # train and test: the slowest time, the sums
                ("all_gather_object", "position.Position.state_dict"): 1}  # the epoch's checkpoint
# Lessons 05 and 07 gather model_full.pt after the loop: one more vote first, so that every rank gathers or none.
GATHERING = Counter(EVERY_LESSON) + Counter({("all_reduce", "signals.StopSignals.agreed"): 1})
SHARED = ("loop", "state", "data", "process", "warmup")  # trainer/'s modules that every strategy runs
# Lesson 05: FSDP's all-gathers and reduce-scatters, inside Net.forward's units (from trainer/loop.py and warmup.py).
# How many depends on torch's prefetching, so only where they come from is checked.
FSDP = {"model.Net.forward"}


def record(lesson: str, tmp_path: Path, data_dir: str, lesson_script: bool = False) -> list[list[dict]]:
    """Each rank's recorded calls of a 2-rank torchrun of the trainer's strategy of that lesson (or the lesson's own
    teaching script)."""
    folder = tmp_path / "recorded"
    env = {"PYTHONPATH": str(ROOT / "tests" / "record_collectives"), "RECORD_COLLECTIVES": str(folder)}
    flags = (*TINY, "--data-dir", data_dir, "--output-dir", tmp_path / "run")
    proc = run_script(lesson, *flags, nproc=2, env=env) if lesson_script else \
        run_trainer(PARALLEL[lesson], *flags, nproc=2, env=env)
    assert_clean(proc)
    return [json.loads((folder / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


def site(call: dict) -> str:
    return f"line {call['first_line']}: {call['collective']} (through {call['through']})"


def unmarked(text: str, calls: list[dict]) -> list[str]:
    """The call sites whose lines, and the comment lines directly above them, name neither the collective nor
    "a collective"."""
    lines = text.splitlines()
    missing = set()
    for call in calls:
        first, last = call["first_line"], call["last_line"]
        seen = lines[first - 1:last]
        above = first - 2
        while above >= 0 and lines[above].lstrip().startswith("#"):
            seen.append(lines[above])
            above -= 1
        if not any(call["collective"] in line or "a collective" in line for line in seen):
            missing.add(site(call))
    return sorted(missing)


def without_comments(text: str, call: dict) -> str:
    """The script with the comments of one call site removed: on its lines, and the comment lines above it
    (emptied, so that no line moves)."""
    lines = text.splitlines(keepends=True)
    first, last = call["first_line"], call["last_line"]
    above = first - 1
    while above > 0 and lines[above - 1].lstrip().startswith("#"):
        above -= 1
    for token in tokenize.generate_tokens(StringIO(text).readline):
        row, col = token.start
        if token.type == tokenize.COMMENT and above <= row <= last:
            lines[row - 1] = lines[row - 1][:col].rstrip() + "\n"
    return "".join(lines)


def check_lesson(lesson: str, recorded: list[list[dict]]) -> list[dict]:
    """The checks common to the trainer's strategies; returns rank 0's calls."""
    assert recorded[0], "nothing recorded: is tests/record_collectives on PYTHONPATH?"
    sites = [[(c["collective"], c["through"], c["file"], c["first_line"]) for c in calls] for calls in recorded]
    assert sites[0] == sites[1]  # every rank calls the same collectives at the same lines, in the same order
    files = {Path(c["file"]) for c in recorded[0]}
    assert files <= {ROOT / "trainer" / f"{name}.py" for name in (PARALLEL[lesson], *SHARED)}, files
    commented = []
    for script in files:  # each file's call sites: marked, and the comment-only markers really are the marks
        calls, text = [c for c in recorded[0] if Path(c["file"]) == script], script.read_text()
        assert unmarked(text, calls) == [], script
        mine = [c for c in calls if not unmarked(text, [c]) and unmarked(without_comments(text, c), [c])]
        for call in {c["first_line"]: c for c in mine}.values():  # each site's marker removed: the check says so
            assert unmarked(without_comments(text, call), calls) == \
                sorted({site(c) for c in calls if c["first_line"] == call["first_line"]})
        commented += mine
    assert {c["through"] for c in commented} >= {"signals.StopSignals.agreed", "position.Position.state_dict"}
    return recorded[0]


def test_lesson_04_marks_every_collective_it_runs_through_common(tmp_path, synthetic_dir):
    """The teaching script calls its collectives itself, but for one: load_mnist's barrier, named at the call."""
    recorded = record("04", tmp_path, synthetic_dir, lesson_script=True)
    sites = [[(c["collective"], c["through"], Path(c["file"])) for c in calls] for calls in recorded]
    assert sites[0] == sites[1] == [("barrier", "data.load_mnist", SCRIPTS["04"])]
    assert unmarked(SCRIPTS["04"].read_text(), recorded[0]) == []


def test_the_trainers_ddp_marks_every_collective_it_runs_through_common(tmp_path, synthetic_dir):
    calls = check_lesson("04", record("04", tmp_path, synthetic_dir))
    assert Counter((c["collective"], c["through"]) for c in calls) == EVERY_LESSON


def test_the_trainers_fsdp2_marks_every_collective_it_runs_through_common(tmp_path, synthetic_dir):
    calls = check_lesson("05", record("05", tmp_path, synthetic_dir))
    counts = Counter((c["collective"], c["through"]) for c in calls if c["through"] not in FSDP)
    assert counts == GATHERING
    assert {c["through"] for c in calls if c["through"] in FSDP} == FSDP


def test_lesson_05_marks_every_collective_it_runs_through_common(tmp_path, synthetic_dir):
    """The teaching script: the data barrier, and FSDP's all-gathers inside Net.forward's units (how many depends on
    torch's prefetching, so only where they come from is checked). No stop votes or meters: those are the trainer's."""
    recorded = record("05", tmp_path, synthetic_dir, lesson_script=True)
    calls, text = recorded[0], SCRIPTS["05"].read_text()
    assert calls and [[(c["collective"], c["through"], c["first_line"]) for c in r] for r in recorded[1:]] == \
        [[(c["collective"], c["through"], c["first_line"]) for c in calls]]  # every rank, the same calls
    assert {Path(c["file"]) for c in calls} == {SCRIPTS["05"]} and unmarked(text, calls) == []
    assert Counter((c["collective"], c["through"]) for c in calls if c["through"] not in FSDP) == \
        {("barrier", "data.load_mnist"): 1}
    assert {c["through"] for c in calls if c["through"] in FSDP} == {"model.Net.forward"}
    forwards = {c["first_line"]: c for c in calls if c["through"] == "model.Net.forward"}
    for call in forwards.values():  # marked by its comment ("a collective"): without it, the check names the line
        assert unmarked(without_comments(text, call), calls) == sorted({site(c) for c in calls
                                                                        if c["first_line"] == call["first_line"]})


def test_the_trainers_pp_marks_every_collective_it_runs_through_common(tmp_path, synthetic_dir):
    """2 ranks: one pipeline of 2 stages (dp 1, no FSDP). The stages' sends and receives are torch's own
    (PipelineStage), not common's: the recording holds what every lesson has, each rank as often."""
    calls = check_lesson("07", record("07", tmp_path, synthetic_dir))
    assert Counter((c["collective"], c["through"]) for c in calls) == GATHERING
