"""A run described by a file (--config, config.yaml), TensorBoard event files, and torch.compile under DDP/FSDP."""
import pytest

from common.cli import base_parser, parse
from bad_inputs import lesson_parser
from common.errors import CourseError
from lessons import PARALLEL, assert_clean, metrics, run_trainer


def parser():
    return base_parser("02_singlegpu_training", "test")


def test_config_sets_defaults_and_the_command_line_wins(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("epochs: 3\nlr: 1e-3\noptimizer: adamw\ndata-dir: /scratch/mnist\namp: true\n")
    args = parse(parser(), ["--config", config, "--epochs", "5"])
    assert (args.epochs, args.lr, args.optimizer, args.data_dir, args.amp) == (5, 1e-3, "adamw", "/scratch/mnist", "auto")
    toml = tmp_path / "run.toml"
    toml.write_text('epochs = 2\nschedule = "onecycle"\n')
    assert (parse(parser(), ["--config", toml]).epochs, parse(parser(), ["--config", toml]).schedule) == (2, "onecycle")


@pytest.mark.parametrize("text, message", [
    ("epochz: 3\n", "unknown key 'epochz': did you mean epochs?"),
    ("batch-size: 0\n", "batch-size: must be >= 1, got 0"),
    ("optimizer: adam\n", "optimizer: 'adam' is not one of adadelta, adamw, sgd"),
    ("- 3\n", "expected `flag: value` lines"),
    ("epochs: [\n", "is not valid YAML"),
])
def test_config_mistakes_are_one_line_errors(tmp_path, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(CourseError, match=message.replace("[", r"\[")) as info:
        parse(parser(), ["--config", config])
    assert "\n" not in str(info.value)


def test_config_yaml_replays_a_run_and_tensorboard_matches_metrics(synthetic_dir, tmp_path):
    """The replay's flags are the run's, every one (lesson 02's own parser reads its config.yaml). Training the
    replay is the README walk's lesson 02 `--config` block: launched there, once."""
    first = tmp_path / "first"
    flags = ["--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", 0, "--train-samples", 320,
             "--test-samples", 64, "--epochs", 2, "--batch-size", 32, "--optimizer", "adamw", "--lr", 2e-3,
             "--seed", 7, "--tensorboard"]
    assert_clean(run_trainer("single", *flags, "--output-dir", first))
    a = metrics(first)
    replay = vars(parse(lesson_parser("02"), ["--config", first / "config.yaml", "--output-dir", tmp_path / "replay"]))
    assert {k: v for k, v in a["args"].items() if k not in ("output_dir", "config")} == \
           {k: v for k, v in replay.items() if k not in ("output_dir", "config")}
    # TensorBoard: read the event file back, the scalars are metrics.json's
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(first / "tensorboard"))
    events.Reload()
    for tag, key in (("loss/train", "train_loss"), ("accuracy/test", "test_accuracy"), ("lr", "lr"),
                     ("images_per_second", "train_images_per_second")):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [1, 2]
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in a["epochs"]], rel=1e-6)


@pytest.mark.parametrize("lesson", ["04", "05"])
def test_compile_after_the_ddp_wrap_and_after_fully_shard(synthetic_dir, tmp_path, lesson):
    """--compile under DDP (Dynamo's DDPOptimizer splits the graph at the buckets) and under fully_shard, on CPU.

    aot_eager traces forward and backward as inductor does but skips code generation, so the test takes seconds."""
    proc = run_trainer(PARALLEL[lesson], "--data", "synthetic", "--data-dir", synthetic_dir, "--num-workers", 0,
                      "--train-samples", 256, "--test-samples", 64, "--epochs", 1, "--batch-size", 32,
                      "--compile", "aot_eager", "--output-dir", tmp_path, nproc=2, timeout=300)
    assert_clean(proc)
    assert metrics(tmp_path)["args"]["compile"] == "aot_eager" and metrics(tmp_path)["epochs"][0]["test_samples"] == 64


def test_curves_title_says_when_the_digits_were_synthetic(tmp_path, monkeypatch):
    import matplotlib.figure

    from common.history import plot_curves
    titles = []
    original = matplotlib.figure.Figure.suptitle
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle", lambda fig, text, **kw: titles.append(text) or
                        original(fig, text, **kw))
    row = {"epoch": 1, "train_loss": 1.0, "test_loss": 0.9, "test_accuracy": 0.5}
    for data in ("synthetic", "mnist"):
        record = {"lesson": "04_ddp_training", "world_size": 2, "device": "cpu", "args": {"data": data}, "epochs": [row]}
        plot_curves(record, tmp_path / f"{data}.png")
    assert titles == ["04_ddp_training: 2 processes, cpu, SYNTHETIC digits (not MNIST)", "04_ddp_training: 2 processes, cpu"]


def test_a_log_file_gets_a_progress_line_where_a_terminal_gets_a_bar(capsys):
    """In a Slurm log (not a terminal) rank 0 prints `desc: step i/total` every `every_s` seconds, not a tqdm bar."""
    from common.log import _periodic

    assert list(_periodic(range(3), "epoch 1", 3, every_s=0)) == [0, 1, 2]
    assert capsys.readouterr().out.splitlines() == ["epoch 1: step 1/3", "epoch 1: step 2/3", "epoch 1: step 3/3"]
