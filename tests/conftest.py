"""Shared test settings: quiet, deterministic, and no accidental network."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # many small processes share 2 cores
os.environ.pop("MNIST_MIRROR", None)

import pytest

from common.data import prepare_data


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory) -> str:
    """One synthetic MNIST (genuine IDX files) for the whole session; lesson scripts reuse it."""
    data_dir = tmp_path_factory.mktemp("data")
    prepare_data(data_dir, "synthetic")
    return str(data_dir)

# Session fixture `slurm_cluster`: a real two-node Slurm cluster (tests/slurm/fixtures.py).
from slurm.fixtures import slurm_cluster  # noqa: E402,F401
