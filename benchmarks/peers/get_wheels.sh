#!/usr/bin/env bash
# The wheels the peers need on a GPU image that has torch and transformers only (4.7 MB, all but torchao pure Python),
# into benchmarks/peers/wheels/ (git ignores it: carry it to the GPU machine). Install there with --no-deps:
#   python3 -m pip install --no-deps benchmarks/peers/wheels/*.whl
# torchtitan 0.2.2 (2026-02-20): the newest release before torch 2.11; 0.3.0 needs spmd_types and torch_checkpointing.
# torchao 0.18.0: the float8 runs of the llm suites on torch 2.11.0+cu130 (docs/benchmarks.json) used it.
# tyro, docstring_parser, typeguard, typing_extensions: torchtitan's config parser; einops, torchdata: its imports.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip download --no-deps --python-version 3.12 --only-binary=:all: -d wheels \
    torchtitan==0.2.2 accelerate==1.15.0 torchao==0.18.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 \
    typing_extensions==4.16.0 einops==0.8.2 torchdata==0.11.0
du -ch wheels/*.whl | tail -1
