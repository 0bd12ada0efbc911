"""THE table of learner mistakes, and how one row runs in-process and is judged. One place: a new flag gets rows.

Every strategy of the production trainer (the rows named by the lesson it comes from, 02-07: trainer/single.py
... trainer/pp.py, whose flags are today's lesson scripts'), and 01's download_mnist.py (hello_distributed.py and
check_env.py: their one flag, --device) gets the same mistakes, each run once in-process as `python SCRIPT ...`
(for the trainer: `python trainer/train.py --parallel P ...`) would run it:

  values         zero, a negative and a non-number for EVERY numeric flag of the script's own parser, a
                 typo'd flag, a choice out of range, a typo'd --compile backend, --patience without
                 --val-samples, --val-samples that leaves no training images, bad --config files; lesson
                 06's --tp that cuts no block evenly, or (plain python: its default --tp 2) no process count;
                 lesson 07's --microbatches that do not divide the batch, a typo'd --pp-schedule, --grad-accum
  paths          a typo'd --data-dir, an --output-dir or --data-dir under a regular file (unwritable even as
                 root), --resume with a checkpoint of another lesson, of another --width, a truncated one, a
                 missing one, a broken sharded one (05, 06); lesson 05's --init-from with a truncated or
                 mismatched file
  launches       lessons 04-06 under plain python (one process, exit 0: not a mistake), more ranks than the
                 data has batches (exit 0, test_samples exactly 1)
  interruptions  a second run into a used --output-dir (refused at once, before data is loaded), Ctrl-C
                 while the data loads (outside a checkpointing stop: exit 130, one line)

Lesson 08's digits_lm.py has a parser of its own (no base_parser): its rows (_digits_rows) cover every flag, numbers
as above, choices, switches given a value, --model-config and --pretrained files and folders (missing, not a
decoder, multimodal, no weights, weights that do not match config.json: the last also under torchrun), --export,
--resume.

Under torchrun with 2 ranks as well (TORCHRUN_ROWS, lessons 04-07 only: 02 and 03 make no process group)
run only the mistakes where the ranks must agree: a failing rank (rank 0 cannot find the data while rank 1
waits in a barrier), more ranks than batches, a checkpoint of another lesson, a corrupt checkpoint, Ctrl-C,
a used folder. A value or parser mistake meets the same parser before init_process_group on every rank
(rank 1 quiet, by RANK), so a second launcher would repeat the python row. Lesson 06's rows carry --tp 1 (one
process has no other mesh); its torchrun rows are twins, ID-tp2, on the README's 2-rank mesh (--tp 2: dp 1 x
tp 2), but more ranks than batches keeps --tp 1 (2 data-parallel ranks: with dp 1 there is one batch stream).
Lesson 07 needs 2 processes or more (TWO_RANKS: a pipeline of one stage is refused, plain python included), so
its rows that get past that check run under torchrun only (the data rows, Ctrl-C while loading, and its own: a
--dp that leaves no pipeline of 2 stages, more stages than layers, fewer training images than a batch, a resume
with another --pp-schedule: exit 0), and its checkpoint artifact is made by a real 2-rank torchrun.

How the numeric flags are found: `lesson_parser(script)` runs the script's own main() until its FIRST call
of `Parser.parse_known_args` (lessons 02-06 reach it through common.cli.parse, download_mnist.py through
parse_args) and keeps the parser there, unparsed. That is exactly the parser a learner's command meets,
base_parser plus the lesson's own flags, built by the lesson's own code, with no side effect: the lessons
build their parser first, before anything else. A flag is numeric when its argparse `type` turns "1" into an
int or a float (common.cli's range-checked types and plain int/float alike). Which numeric flags may be ZERO
is a decision, so it is written down here (ZERO_ALLOWED), not read back from the code under test.

How a row runs (in this process, or in the torchrun driver's workers) and how it is judged:
tests/bad_input_runs.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass, replace

from lessons import PARALLEL, ROOT, TRAINER
from lessons import SCRIPTS as LESSON_SCRIPTS

# The rows of 02-07 run the trainer's module of that lesson's strategy (--parallel PARALLEL[lesson]).
MODULES = {"02": "single", "03": "dp", "04": "ddp", "05": "fsdp2", "06": "tp", "07": "pp"}
SCRIPTS = {**{k: ROOT / "trainer" / f"{v}.py" for k, v in MODULES.items()},
           "download": ROOT / "01_setup" / "download_mnist.py",
           "check_env": ROOT / "01_setup" / "check_env.py", "hello": ROOT / "01_setup" / "hello_distributed.py",
           "08": ROOT / "08_your_model" / "digits_lm.py",
           **{f"teach{k}": path for k, path in LESSON_SCRIPTS.items() if k != "01"}}  # tests/test_lesson_inputs.py
LESSONS = ("02", "03", "04", "05", "06", "07")
TWO_RANKS = ("07",)  # a pipeline needs 2 processes: rows past the launch check, and the artifact, under torchrun
MODES = ("python", "torchrun")
# The rows (by name, after the lesson number) that also run under torchrun in lessons 04-06 (see above).
TORCHRUN_ROWS = ("data-dir-typo", "resume-other-lesson", "resume-truncated", "resume-broken-sharded",
                 "used-output-dir", "ctrl-c-while-loading")

# Counts: zero is a sensible value (no validation, no warm-up, seed 0, no DataLoader workers, no extra blocks).
ZERO_ALLOWED = frozenset({"--val-samples", "--warmup-steps", "--seed", "--num-workers", "--blocks"})
# A tiny run on the session's synthetic data: every lesson row starts from it and the lesson's LESSON_FLAGS
# (small()), the row's flags come after them (argparse: the last value wins). The artifacts (checkpoints) are
# written with exactly these flags.
SMALL = ("--data", "synthetic", "--data-dir", "{data}", "--num-workers", "0", "--train-samples", "64",
         "--test-samples", "16", "--batch-size", "32", "--epochs", "1", "--max-steps", "1")
LESSON_FLAGS = {"06": ("--blocks", "2", "--tp", "1")}  # after SMALL: the README's blocks, the one-process mesh
NO_NETWORK = (("MNIST_MIRROR", "http://127.0.0.1:9/"),)  # a refused connection: a download fails at once
SHARDED = ("05", "06", "07")  # the lessons that write DCP folders, not .pt files
# Whose checkpoint a row hands to --resume.
OTHER_LESSON = {"02": "04", "03": "02", "04": "02", "05": "04", "06": "04", "07": "06"}

@dataclass(frozen=True)
class Case:
    """One mistake of one script. argv/absent may hold {data}, {art}, {case} and {out} (see Context.paths)."""
    id: str
    script: str
    what: str  # what the learner did, in words
    argv: tuple[str, ...]
    expect: str = "error"  # error (exit 2) | interrupted (exit 130) | ok (exit 0) | accepted (the parser takes it)
    needles: tuple[str, ...] = ()  # must all be in the one `error:` line
    modes: tuple[str, ...] = ("python",)
    env: tuple[tuple[str, str], ...] = ()
    setup: str | None = None  # "used-output-dir" | "file-in-the-way"
    inject: str | None = None  # "ctrl-c-while-loading"
    absent: tuple[str, ...] = ()  # paths that must not exist afterwards
    max_seconds: float | None = None  # in-process wall time
    forbid: tuple[str, ...] = ()  # line prefixes that must not appear (e.g. nothing slow started)
    test_samples: int | None = None  # expect == "ok": metrics.json's every epoch
    world_size: int | None = None  # expect == "ok": metrics.json's world_size


# ---- the scripts and their parsers ----------------------------------------------------------------------

_modules: dict = {}


def load_script(script: str):
    """The script as a module (importlib from its file; its `if __name__ == "__main__"` does not run)."""
    if script not in _modules:
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        spec = importlib.util.spec_from_file_location(f"bad_inputs_{script}", SCRIPTS[script])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _modules[script] = module
    return _modules[script]


def command_line(script: str) -> list[str]:
    """The script and its first flags as a learner types them: trainer/train.py --parallel P for a lesson's row."""
    return [str(TRAINER), "--parallel", PARALLEL[script]] if script in MODULES else [str(SCRIPTS[script])]


class _ParserBuilt(Exception):
    pass


def lesson_parser(script: str) -> argparse.ArgumentParser:
    """The parser the script's main() builds, taken at its first parse call (see the module docstring)."""
    from common.cli import Parser
    module = load_script(script)
    captured = []

    def capture(self, *args, **kwargs):
        captured.append(self)
        raise _ParserBuilt

    original = Parser.parse_known_args
    Parser.parse_known_args = capture
    try:
        module.main([])
    except _ParserBuilt:
        pass
    finally:
        Parser.parse_known_args = original
    if not captured:
        raise AssertionError(f"{SCRIPTS[script]}: main() did not parse its command line with common.cli.Parser")
    return captured[0]


def numeric_flags(parser) -> list[tuple[str, str]]:
    """(flag, "int" or "float") for every option whose type turns "1" into a number."""
    found = []
    for action in parser._actions:
        if not action.option_strings or action.type is None:
            continue
        try:
            value = action.type("1")
        except (argparse.ArgumentTypeError, ValueError, TypeError):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            long = max(action.option_strings, key=len)
            found.append((long, "int" if isinstance(value, int) else "float"))
    return found


# ---- the table ------------------------------------------------------------------------------------------

def small(lesson: str) -> tuple[str, ...]:
    """SMALL and the lesson's own flags: the rows' start, and the artifacts' whole command (with --output-dir)."""
    return (*SMALL, *LESSON_FLAGS.get(lesson, ()))


def _slug(flag: str) -> str:
    return flag.lstrip("-")


def _value_rows(script: str) -> list[Case]:
    rows = []
    for flag, kind in numeric_flags(lesson_parser(script)):
        base = (*small(script), "--output-dir", "{out}") if script in LESSONS else ()
        if flag in ZERO_ALLOWED:
            rows.append(Case(f"{script}-{_slug(flag)}-zero", script, f"{flag} 0 (a count: allowed)",
                             (*base, flag, "0"), expect="accepted"))
        else:
            rows.append(Case(f"{script}-{_slug(flag)}-zero", script, f"{flag} 0", (*base, flag, "0"),
                             needles=(f"argument {flag}: must be ", "got 0")))
        rows.append(Case(f"{script}-{_slug(flag)}-negative", script, f"{flag} -1", (*base, flag, "-1"),
                         needles=(f"argument {flag}: must be ", "got -1")))
        noun = "an integer" if kind == "int" else "a number"
        rows.append(Case(f"{script}-{_slug(flag)}-not-a-number", script, f"{flag} ten", (*base, flag, "ten"),
                         needles=(f"argument {flag}: 'ten' is not {noun}",)))
    return rows


def _lesson_rows(lesson: str) -> list[Case]:
    base = (*small(lesson), "--output-dir", "{out}")
    other = OTHER_LESSON[lesson]
    rows = _value_rows(lesson) + [
        Case(f"{lesson}-typo-flag", lesson, "--epoch 1 (for --epochs)", (*base, "--epoch", "1"),
             needles=("unrecognized arguments: --epoch 1",)),
        Case(f"{lesson}-choice-out-of-range", lesson, "--optimizer adam", (*base, "--optimizer", "adam"),
             needles=("argument --optimizer: invalid choice: 'adam'",)),
        Case(f"{lesson}-amp-fp8", lesson, "--amp fp8 (autocast offers bf16 and fp16)", (*base, "--amp", "fp8"),
             needles=("argument --amp: invalid choice: 'fp8'",)),
        Case(f"{lesson}-compile-backend-typo", lesson, "--compile inductr (for inductor)",
             (*base, "--compile", "inductr"), needles=("--compile", "inductr", "inductor")),
        Case(f"{lesson}-patience-without-validation", lesson, "--patience 2 without --val-samples",
             (*base, "--patience", "2"), needles=("--patience needs a validation set", "--val-samples")),
        Case(f"{lesson}-val-samples-eat-all-training", lesson, "--val-samples 64 with --train-samples 64",
             (*base, "--val-samples", "64"), needles=("--val-samples 64 leaves no training images out of 64",)),
        Case(f"{lesson}-config-missing", lesson, "--config of a file that is not there",
             (*base, "--config", "{case}/run.yaml"), needles=("--config {case}/run.yaml", "check the path")),
        Case(f"{lesson}-config-bad-value", lesson, "--config with `epochs: 0`",
             (*base, "--config", "{art}/epochs-zero.yaml"), needles=("epochs: must be >= 1, got 0",)),
        Case(f"{lesson}-config-typo-key", lesson, "--config with `epoch: 2`",
             (*base, "--config", "{art}/typo-key.yaml"), needles=("unknown key 'epoch'", "did you mean epochs?")),
        Case(f"{lesson}-data-dir-typo", lesson, "--data mnist --data-dir dta (for data), offline",
             (*base, "--data", "mnist", "--data-dir", "{case}/dta"), env=NO_NETWORK, absent=("{case}/dta",),
             needles=("MNIST not found in {case}/dta/MNIST/raw", "check --data-dir")),
        Case(f"{lesson}-data-dir-under-a-file", lesson, "--data synthetic --data-dir FILE/data",
             (*base, "--data-dir", "{case}/afile/data"), setup="file-in-the-way",
             needles=("{case}/afile/data",)),
        Case(f"{lesson}-output-dir-under-a-file", lesson, "--output-dir FILE/out (cannot be created)",
             (*small(lesson), "--output-dir", "{case}/afile/out"), setup="file-in-the-way",
             needles=("{case}/afile/out",)),
        Case(f"{lesson}-resume-other-lesson", lesson, f"--resume a lesson {other} checkpoint",
             (*base, "--resume", f"{{art}}/ckpt-{other}"),
             needles=("is from another kind of run", f"lesson 'trainer-{PARALLEL[other]}' there")),
        Case(f"{lesson}-resume-other-width", lesson, "--resume a --width 1 checkpoint with --width 2",
             (*base, "--resume", f"{{art}}/ckpt-{lesson}", "--width", "2"),
             needles=("is from another kind of run (width 1 there, 2 here)",)),
        Case(f"{lesson}-resume-truncated", lesson, "--resume a truncated .pt",
             (*base, "--resume", "{art}/truncated.pt"),
             needles=("{art}/truncated.pt is not a readable checkpoint",)),
        Case(f"{lesson}-resume-missing", lesson, "--resume a path that is not there",
             (*base, "--resume", "{case}/ckpt.pt"), needles=("checkpoint {case}/ckpt.pt does not exist",)),
        Case(f"{lesson}-used-output-dir", lesson, "the same command again, into the used --output-dir",
             base, setup="used-output-dir", max_seconds=2.0, forbid=("[rank ", "epoch "),
             needles=("{out}/checkpoints holds checkpoints of an earlier run", "--resume auto")),
        Case(f"{lesson}-ctrl-c-while-loading", lesson, "Ctrl-C while the data loads (before training)",
             base, expect="interrupted", inject="ctrl-c-while-loading"),
    ]
    if lesson != "05":
        rows.append(Case(f"{lesson}-resume-sharded-checkpoint", lesson, "--resume lesson 05's DCP folder",
                         (*base, "--resume", "{art}/ckpt-05"),
                         needles=("lesson 'trainer-fsdp2' there",)))
    if lesson in SHARDED:
        rows.append(Case(f"{lesson}-resume-broken-sharded", lesson, "--resume a DCP folder, its .metadata cut",
                         (*base, "--resume", f"{{art}}/broken-dcp-{lesson}"),
                         needles=(f"{{art}}/broken-dcp-{lesson} is not a readable checkpoint",)))
    if lesson == "05":
        rows += [
            # The --init-from rows are not in the torchrun driver: rank 0 fails after init while rank 1 waits in
            # a broadcast. In a real launch rank 0 EXITS, which closes its sockets (rank 1 hears "Connection
            # closed by peer") and torchrun stops rank 1; in-process, rank 0 lives on and its FSDP state
            # (state_dict() was called) keeps the dead group's sockets open, so rank 1 waits for
            # DIST_TIMEOUT_SECONDS. test_bad_inputs launches 05-init-from-other-width for real under torchrun.
            Case("05-init-from-truncated", "05", "--init-from a truncated .pt (read after init_process_group)",
                 (*base, "--init-from", "{art}/truncated.pt"),
                 needles=("--init-from {art}/truncated.pt: not a readable weights file",)),
            Case("05-init-from-other-width", "05", "--init-from a --width 1 checkpoint with --width 2",
                 (*base, "--init-from", "{art}/ckpt-04", "--width", "2"),
                 needles=("--init-from {art}/ckpt-04: not the weights of this Net", "same --width")),
        ]
    if lesson == "06":
        rows += [
            Case("06-tp-not-an-integer", "06", "--tp 1.5", (*base, "--tp", "1.5"),
                 needles=("argument --tp: '1.5' is not an integer",)),
            Case("06-tp-not-a-divisor", "06", "--tp 3 (the 4 x 128 features of a block split in 3?)",
                 (*base, "--tp", "3"), needles=("argument --tp: must divide the 4 x 128 features of a block, got 3",)),
            Case("06-default-tp-under-plain-python", "06", "python without --tp 1: the default --tp 2 on ONE process",
                 (*base, "--tp", "2"), needles=("--tp 2 does not divide the 1 process", "--tp 1", "torchrun")),
            Case("06-tp-more-than-ranks", "06", "--tp 4 on 2 ranks", (*base, "--tp", "4"), modes=("torchrun",),
                 needles=("--tp 4 does not divide the 2 processes", "--tp 2")),
        ]
    if lesson == "07":
        rows += [
            Case("07-microbatches-not-a-divisor", "07", "--microbatches 3 with --batch-size 32",
                 (*base, "--microbatches", "3"),
                 needles=("argument --microbatches: 3 does not divide --batch-size 32", "pick a divisor")),
            Case("07-pp-schedule-typo", "07", "--pp-schedule 1fb1 (for 1f1b)", (*base, "--pp-schedule", "1fb1"),
                 needles=("argument --pp-schedule: invalid choice: '1fb1'",)),
            Case("07-grad-accum", "07", "--grad-accum 2 (a pipeline accumulates its micro-batches)",
                 (*base, "--grad-accum", "2"), needles=("argument --grad-accum:", "use --microbatches")),
            Case("07-dp-not-a-divisor", "07", "--dp 3 on 2 ranks", (*base, "--dp", "3"), modes=("torchrun",),
                 needles=("--dp 3 on 2 processes leaves no pipeline of 2 stages", "--nproc_per_node=6")),
            Case("07-dp-leaves-one-stage", "07", "--dp 2 on 2 ranks: pipelines of ONE stage", (*base, "--dp", "2"),
                 modes=("torchrun",), needles=("--dp 2 on 2 processes leaves no pipeline of 2 stages",)),
            Case("07-more-stages-than-blocks", "07", "--pp-schedule interleaved --blocks 1 on 2 ranks: 4 stages",
                 (*base, "--pp-schedule", "interleaved", "--blocks", "1"), modes=("torchrun",),
                 needles=("--blocks 1 leaves a middle stage of 4 empty", "use --blocks 3")),
            Case("07-fewer-images-than-a-batch", "07", "--train-samples 16 with --batch-size 32",
                 (*base, "--train-samples", "16"), modes=("torchrun",),
                 needles=("--batch-size 32 on 1 pipeline needs 32 training images, there are 16",)),
            Case("07-resume-other-schedule", "07", "--resume a 1f1b checkpoint (2 stages) with --pp-schedule "
                 "interleaved (4 stages) and one more epoch: not a mistake, DCP reads each layer by name",
                 (*base, "--resume", "{art}/ckpt-07", "--pp-schedule", "interleaved", "--epochs", "2"),
                 expect="ok", modes=("torchrun",), world_size=2),
        ]
    if lesson in TWO_RANKS:  # past the launch check only under torchrun; ONE process is the mistake (see above)
        late = ("data-dir-typo", "data-dir-under-a-file", "val-samples-eat-all-training", "ctrl-c-while-loading")
        rows = [replace(row, modes=("torchrun",)) if row.id.split("-", 1)[1] in late else row for row in rows]
    if lesson in ("04", "05", "06", "07"):
        torchrun = [row for row in rows if row.id.split("-", 1)[1] in TORCHRUN_ROWS]
        if lesson == "06":  # twins on the README's 2-rank mesh (see above); the last --tp wins
            rows += [replace(row, id=f"{row.id}-tp2", what=f"{row.what}, --tp 2", argv=(*row.argv, "--tp", "2"),
                             modes=("torchrun",)) for row in torchrun]
        else:
            rows = [replace(row, modes=tuple(m for m in MODES if m in row.modes or m == "torchrun"))
                    if row in torchrun else row for row in rows]
        if lesson in TWO_RANKS:
            rows += [
                Case(f"{lesson}-under-plain-python", lesson, "python on a pipeline lesson: ONE process, no pipeline",
                     base, needles=("--dp 1 on 1 process leaves no pipeline of 2 stages", "--nproc_per_node=2")),
                Case(f"{lesson}-more-ranks-than-batches", lesson, "--test-samples 1 on 2 ranks (one pipeline)",
                     (*base, "--test-samples", "1"), expect="ok", test_samples=1, modes=("torchrun",), world_size=2),
            ]
        else:
            rows += [
                Case(f"{lesson}-under-plain-python", lesson, "python on a torchrun lesson: ONE process, not a mistake",
                     base, expect="ok", test_samples=16, world_size=1),
                Case(f"{lesson}-more-ranks-than-batches", lesson, "--train-samples 1 --test-samples 1 on 2 ranks",
                     (*base, "--train-samples", "1", "--test-samples", "1"), expect="ok", test_samples=1,
                     modes=("torchrun",), world_size=2),
            ]
    return rows


def _download_rows() -> list[Case]:
    # Not under torchrun: it is a one-process tool (two ranks would race to create and remove the same folder).
    return _value_rows("download") + [
        Case("download-typo-flag", "download", "--synthtic", ("--data-dir", "{case}/data", "--synthtic"),
             needles=("unrecognized arguments: --synthtic",), absent=("{case}/data",)),
        Case("download-data-dir-offline", "download", "download into a typo'd folder, offline",
             ("--data-dir", "{case}/dta",), env=NO_NETWORK, absent=("{case}/dta",),
             needles=("MNIST not found in {case}/dta/MNIST/raw",)),
        Case("download-data-dir-under-a-file", "download", "download into FILE/data, offline",
             ("--data-dir", "{case}/afile/data"), env=NO_NETWORK, setup="file-in-the-way",
             needles=("{case}/afile/data",)),
        Case("download-synthetic-under-a-file", "download", "--synthetic --data-dir FILE/data",
             ("--synthetic", "--data-dir", "{case}/afile/data"), setup="file-in-the-way",
             needles=("{case}/afile/data",)),
    ]


def _device_flag_rows() -> list[Case]:
    """check_env.py and hello_distributed.py take one flag, --device: a choice out of range and a typo."""
    return [row for script in ("check_env", "hello") for row in (
        Case(f"{script}-device-gpu", script, "--device gpu", ("--device", "gpu"), needles=("invalid choice: 'gpu'",)),
        Case(f"{script}-typo-flag", script, "--devise cpu", ("--devise", "cpu"),
             needles=("unrecognized arguments: --devise",)))]


# Lesson 08's digits_lm.py has its own parser (no base_parser): its small run, and its --pretrained folders
# (bad_input_artifacts.make_pretrained_folders: a tiny Llama written by save_pretrained, then its config.json edited).
DIGITS_SMALL = ("--data", "synthetic", "--data-dir", "{data}", "--train-samples", "64", "--test-samples", "16",
                "--batch-size", "32", "--epochs", "1", "--max-steps", "1", "--dtype", "float32",
                "--output-dir", "{out}")


def _digits_rows() -> list[Case]:
    """Every flag of digits_lm.py: numbers (_value_rows), choices, files, folders and the switches."""
    base, mismatch = DIGITS_SMALL, "its weights do not match its config.json"
    choices = [("dtype", "float16"), ("data", "imagenet"), ("device", "gpu"), ("export-dtype", "float16")]
    switches = ["--ac", "--async-checkpoint", "--draw", "--dry-run"]
    return _value_rows("08") + [
        Case("08-typo-flag", "08", "--epoch 1 (for --epochs)", (*base, "--epoch", "1"),
             needles=("unrecognized arguments: --epoch 1",)),
        *[Case(f"08-{flag}-{value}", "08", f"--{flag} {value}", (*base, f"--{flag}", value),
               needles=(f"argument --{flag}: invalid choice: '{value}'",)) for flag, value in choices],
        *[Case(f"08-{flag[2:]}-with-a-value", "08", f"{flag} yes (a switch takes no value)", (*base, flag, "yes"),
               needles=("unrecognized arguments: yes",)) for flag in switches],
        Case("08-compile-backend-typo", "08", "--compile inductr (for inductor)", (*base, "--compile", "inductr"),
             needles=("--compile inductr: not a torch.compile backend", "inductor")),
        Case("08-model-config-missing", "08", "--model-config of a file that is not there",
             (*base, "--model-config", "{case}/config.json"), needles=("--model-config {case}/config.json",
                                                                      "No such file or directory")),
        Case("08-model-config-not-json", "08", "--model-config of a checkpoint file, not JSON",
             (*base, "--model-config", "{art}/truncated.pt"), needles=("--model-config {art}/truncated.pt is not JSON",
                                                                      "config.json")),
        Case("08-model-config-not-a-decoder", "08", "--model-config of a vision transformer's config.json",
             (*base, "--model-config", "{art}/hf-vit"), needles=('"model_type" \'vit\'', '"llama"')),
        Case("08-pretrained-missing", "08", "--pretrained a folder that is not there",
             (*base, "--pretrained", "{case}/hf"), needles=("--pretrained {case}/hf", "No such file or directory")),
        Case("08-pretrained-not-a-decoder", "08", "--pretrained a folder holding a vision transformer's config.json",
             (*base, "--pretrained", "{art}/hf-vit"), needles=("--pretrained {art}/hf-vit", '\'vit\'', '"llama"')),
        Case("08-pretrained-encoder", "08", "--pretrained a folder holding BERT's config.json (an encoder)",
             (*base, "--pretrained", "{art}/hf-bert"), needles=("--pretrained {art}/hf-bert", "'bert'", "decoder")),
        Case("08-pretrained-multimodal", "08", "--pretrained a folder holding Gemma 3's config.json (multimodal)",
             (*base, "--pretrained", "{art}/hf-gemma3"), needles=("--pretrained {art}/hf-gemma3",
                                                                  "'gemma3' is a multimodal model", "'gemma3_text'")),
        Case("08-pretrained-no-weights", "08", "--pretrained a folder with config.json and no safetensors",
             (*base, "--pretrained", "{art}/hf-no-weights"), needles=("no model.safetensors", "save_pretrained")),
        Case("08-pretrained-fewer-layers", "08", "--pretrained: config.json says 2 layers, the weights hold 1",
             (*base, "--pretrained", "{art}/hf-more-layers"), modes=MODES, needles=(mismatch, "9 missing")),
        Case("08-pretrained-other-shape", "08", "--pretrained: config.json's intermediate_size is not the weights'",
             (*base, "--pretrained", "{art}/hf-other-shape"), needles=(mismatch, "model.layers.0.mlp")),
        Case("08-pretrained-and-model-config", "08", "--pretrained and --model-config together",
             (*base, "--pretrained", "{art}/hf-more-layers", "--model-config", "{art}/hf-vit"),
             needles=("--pretrained and --model-config: pass one",)),
        Case("08-export-under-a-file", "08", "--export FILE/hf (cannot be created)",
             (*base, "--export", "{case}/afile/hf"), setup="file-in-the-way", needles=("--export {case}/afile/hf",)),
        Case("08-data-dir-typo", "08", "--data mnist --data-dir dta (for data), offline",
             (*base, "--data", "mnist", "--data-dir", "{case}/dta"), env=NO_NETWORK, absent=("{case}/dta",),
             needles=("MNIST not found in {case}/dta/MNIST/raw", "check --data-dir")),
        Case("08-output-dir-under-a-file", "08", "--output-dir FILE/out (cannot be created)",
             (*base, "--output-dir", "{case}/afile/out"), setup="file-in-the-way", needles=("{case}/afile/out",)),
        Case("08-resume-missing", "08", "--resume a path that is not there",
             (*base, "--resume", "{case}/ckpt"), needles=("checkpoint {case}/ckpt does not exist",)),
        Case("08-resume-other-lesson", "08", "--resume lesson 05's DCP folder",
             (*base, "--resume", "{art}/ckpt-05"), needles=("lesson 'trainer-fsdp2' there",)),
        Case("08-resume-broken-sharded", "08", "--resume a DCP folder, its .metadata cut",
             (*base, "--resume", "{art}/broken-dcp-05"),
             needles=("{art}/broken-dcp-05 is not a readable checkpoint",)),
    ]


def build_table() -> list[Case]:
    rows = [row for lesson in LESSONS for row in _lesson_rows(lesson)] + _download_rows() + _device_flag_rows() + \
        _digits_rows()
    ids = [row.id for row in rows]
    assert len(ids) == len(set(ids)), "duplicate row ids"
    return rows
