"""Shared test settings: quiet, deterministic, no accidental network, and how `make test` shares out the tests."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # many small processes share 2 cores
# A process that keeps torch's default threads (the walk's: a learner's environment) must not spin: an idle OpenMP
# thread busy-waits for its next task by default, taking the core another test needs (lesson 03's walked run:
# 25 s of training instead of 4.5 s beside one busy process). Only the speed changes, not a printed number.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.pop("MNIST_MIRROR", None)

import pytest

from common.download import prepare_data

# `make test` runs two pytest workers (pytest-xdist, `-n 2`): much of a test's time is spent
# waiting (for Slurm, for a timeout to fire, for processes to start), so two keep both cores busy. Tests that
# share one costly thing run on one worker, one after another: the Slurm cluster (one per machine) and a module's
# module-scoped runs. The longest groups are handed out first, so no worker is left with a long tail.
SLOW_FIRST = ["test_slurm_", "test_troubleshooting", "test_reference_walk.py", "test_readme_walk.py",
              "test_fsdp_memory.py", "test_bad_inputs.py", "test_lesson_inputs.py", "test_reliability.py",
              "test_notebooks.py", "test_interrupts.py", "test_early_stopping.py", "test_tensor_parallel.py",
              "test_pipeline.py", "test_notebook_06.py", "test_notebook_07.py", "test_port.py", "test_digits_lm.py",
              "test_async_checkpoint.py", "test_interrupts_08.py", "test_late_stops.py", "test_notebook_08.py",
              "test_bench_llm.py", "test_exercises_"]
ONE_WORKER = {"test_bad_inputs.py", "test_lesson_inputs.py", "test_early_stopping.py", "test_fsdp_memory.py",
              "test_interrupts.py", "test_predict.py", "test_troubleshooting.py", "test_troubleshooting_host.py",
              "test_port.py", "test_digits_lm.py", "test_will_it_fit.py", "test_async_checkpoint.py",
              "test_interrupts_08.py", "test_text_data.py", "test_finetune_text.py"}


def group(nodeid: str) -> str:
    """The unit of work a worker takes whole: the Slurm tests, a module in ONE_WORKER, or else one test."""
    file = nodeid.split("::")[0].rsplit("/", 1)[-1]
    return "slurm" if file.startswith("test_slurm_") else file if file in ONE_WORKER else nodeid


def pytest_collection_modifyitems(config, items):
    rank = lambda name: next((i for i, p in enumerate(SLOW_FIRST) if name.startswith(p)), len(SLOW_FIRST))
    items.sort(key=lambda item: rank(item.path.name))  # stable: each file keeps its own order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler with our groups (its xdist_group marks are ignored under pytest 9)."""
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return group(nodeid)

    return Groups(config, log)


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory) -> str:
    """One synthetic MNIST (genuine IDX files) for the whole session (per worker); lesson scripts reuse it."""
    data_dir = tmp_path_factory.mktemp("data")
    prepare_data(data_dir, "synthetic")
    return str(data_dir)

# Session fixture `slurm_cluster`: a real two-node Slurm cluster (tests/slurm/fixtures.py).
from slurm.fixtures import slurm_cluster  # noqa: E402,F401
