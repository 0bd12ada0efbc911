# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test test-slow coverage test-floor test-slurm demo bench clean

setup: $(STAMP)

# Where torch and torchvision come from: empty = PyPI (on Linux CUDA 13 wheels: Turing or newer, driver >= 580).
# A V100 or an older driver: make setup TORCH_INDEX=https://download.pytorch.org/whl/cu126 (docs/install.md).
TORCH_INDEX ?=

# Reinstall only when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX),$(PY) -m pip install --quiet torch torchvision --index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

# Two pytest workers (tests/conftest.py says how the tests are shared out); TEST_WORKERS=0 runs them in one process.
# --durations=10: the ten slowest tests, printed at the end of every run, so a slow new test shows at once.
TEST_WORKERS ?= 2
# The slowest checks, which `make test` leaves to `make test-slow` (CI runs both, README.md says so): the real
# two-node Slurm cluster (where the machine can host it: root), the failure lab, the benchmark runner's CPU mode,
# the signals' exact resumes, FSDP2's memory sweep, lesson 08's scripts, the walks of every README and reference
# page, the executed notebooks, the bytes docs/strategy.md gives FSDP2 and DDP, and the trainer's --amp, early
# stopping, Ctrl-C and --config runs.
SLOW_TESTS := $(wildcard tests/test_slurm_*.py) tests/test_troubleshooting.py tests/test_troubleshooting_host.py \
    tests/test_bench.py tests/test_bench_llm.py tests/test_reliability.py tests/test_fsdp_memory.py \
    tests/test_port.py tests/test_digits_lm.py tests/test_hf_pretrained.py tests/test_async_checkpoint.py \
    tests/test_will_it_fit.py tests/test_interrupts_08.py tests/test_notebook_08.py tests/test_exercises_08.py \
    tests/test_reference_walk.py tests/test_readme_walk.py tests/test_notebooks.py tests/test_notebook_06.py \
    tests/test_notebook_07.py tests/test_strategy_bytes.py tests/test_text_data.py tests/test_text_model.py \
    tests/test_late_stops.py tests/test_finetune_text.py tests/test_llama8b.py tests/test_amp.py \
    tests/test_early_stopping.py tests/test_interrupts.py tests/test_config_and_logging.py
test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --no-loadscope-reorder --durations=10 tests $(addprefix --ignore=,$(SLOW_TESTS))

test-slow: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --no-loadscope-reorder --durations=10 $(SLOW_TESTS)

# `make test` under coverage.py, subprocesses included (.coveragerc): line and branch coverage per file,
# in the terminal and in build/coverage/html/index.html. The report is printed even when a test fails.
coverage: setup
	rm -rf build/coverage && mkdir -p build/coverage
	$(PY) -m coverage run -m pytest -n $(TEST_WORKERS) --no-loadscope-reorder tests; status=$$?; \
	$(PY) -m coverage combine --quiet && $(PY) -m coverage report && \
	$(PY) -m coverage html --quiet -d build/coverage/html && exit $$status

# The oldest torch the course supports (pyproject's floor), in its own venv: the lessons run on it too. Two tests are
# left out, both counts of lesson 06's collectives on a mesh with a 1-rank dimension: on torch 2.9, fully_shard
# reduce-scatters even over a 1-rank "dp" (1 x 2: one reduce_scatter per unit more than its README derives), and a
# 4 x 1 mesh's step has one all_reduce of 1,024 bytes more (torch 2.14 runs neither; measured with both).
# On x86_64, PyPI's torch 2.9.1 is a CUDA build: about 3 GB of wheels and 7 GB installed, so no pip cache (it would
# hold the wheels a second time), and a dropped download is retried.
FLOOR_TORCH ?= torch==2.9.1 torchvision==0.24.1
test-floor:
	test -x .venv-floor/bin/python || $(PYTHON) -m venv .venv-floor
	.venv-floor/bin/python -m pip install --quiet --upgrade pip
	for attempt in 1 2 3; do \
	  .venv-floor/bin/python -m pip install --quiet --no-cache-dir --resume-retries 10 $(FLOOR_TORCH) && break; \
	  echo "test-floor: installing $(FLOOR_TORCH) failed (attempt $$attempt of 3); disk: $$(df -h . | tail -1)"; \
	  [ $$attempt -lt 3 ] || exit 1; \
	done
	.venv-floor/bin/python -m pip install --quiet -e '.[dev]'
	.venv-floor/bin/python -c "import torch; assert torch.__version__.startswith('2.9.'), torch.__version__"
	.venv-floor/bin/python -m pytest tests/test_lessons.py tests/test_fsdp.py tests/test_config_and_logging.py \
	    tests/test_tensor_parallel.py tests/test_pipeline.py tests/test_pipeline_floor.py \
	    --deselect tests/test_tensor_parallel.py::test_tp_on_2_ranks_and_the_checkpoint_on_1x2 \
	    --deselect tests/test_tensor_parallel.py::test_2d_on_4_ranks_and_the_checkpoint_on_4x1

# A real two-node Slurm cluster on this machine (needs root; apt-installs slurm and munge if missing).
test-slurm: setup
	REQUIRE_SLURM=1 $(PY) -m pytest tests/test_slurm_cluster.py tests/test_slurm_scripts.py tests/test_slurm_lessons.py \
	    tests/test_slurm_preemption.py tests/test_slurm_hsdp.py tests/test_slurm_sweep.py tests/test_slurm_lesson06.py \
	    tests/test_slurm_lesson07.py tests/test_slurm_lesson08.py -v

DEMO_FLAGS ?= --epochs 2 --train-samples 12000
# The course's main job on CPU: lesson 04's DDP script with 2 gloo processes. Real MNIST when it is in
# ./data or can be downloaded; otherwise the synthetic digits, and it says so.
demo: setup
	@if $(PY) 01_setup/download_mnist.py --data-dir data >/dev/null 2>&1; then data=mnist; \
	else data=synthetic; echo "NOTICE: MNIST is not in ./data and could not be downloaded:" \
	  "this demo trains on SYNTHETIC digits (get the real set: python 01_setup/download_mnist.py)"; fi; \
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=2 \
	  04_ddp_training/mnist_ddpmodel.py --data $$data --data-dir data $(DEMO_FLAGS) \
	  --num-workers 0 --output-dir runs/demo

# Every benchmark on real MNIST (BENCH_ARGS="--data-dir DIR --reference pytorch-examples/mnist/main.py"; default
# ./data, no parity run), on 1, 2 (4, 8) GPUs (how long: bench.py's docstring; list: --plan, pick: --suite, cap:
# --budget), writes docs/benchmarks.md, .json and plots. CPU smoke mode, no results: BENCH_ARGS=--quick
bench: setup
	$(PY) benchmarks/bench.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .venv-floor *.egg-info runs outputs .pytest_cache
