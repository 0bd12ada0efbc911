# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test test-slurm demo clean

setup: $(STAMP)

# Reinstall only when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

test: setup
	$(PY) -m pytest tests

# A real two-node Slurm cluster on this machine (needs root; apt-installs slurm and munge if missing).
test-slurm: setup
	REQUIRE_SLURM=1 $(PY) -m pytest tests/test_slurm_cluster.py -v

demo: setup
	@echo "make demo will run lesson 04 (DDP, 2 gloo processes on CPU) once the lessons land."

clean:
	rm -rf $(VENV) *.egg-info runs outputs .pytest_cache
