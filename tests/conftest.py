"""Shared test settings: quiet, deterministic, and no accidental network."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # many small processes share 2 cores
os.environ.pop("MNIST_MIRROR", None)
