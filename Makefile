# Two commands on a fresh machine: `make run` (the main job) and `make test` (what CI runs: lint, types, every test).
# `make test-fast` is the edit loop: lint and the tests that start no process and train only a few steps
# (tests/conftest.py holds every test not marked slow to that), the docs' commands left to `make test`.
# Each checkout has its own venv (.venv/, git-ignored), its dependencies reinstalled when
# pyproject.toml changes: a venv shared between clones ran whichever clone last set it up.
PYTHON ?= python3
VENV ?= $(CURDIR)/.venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: setup run train lint test test-fast clean-venv

setup: $(VENV)/.deps-installed
	@# The checkout's lbt, editable (a moved checkout re-points it); cheap, so done every time.
	@$(BIN)/pip install -q --no-deps --no-build-isolation -e .

$(VENV)/.deps-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q '.[dev]'
	$(BIN)/python -c "import torch, torchvision, hydra, mnist1d, tensorboard, pytest"
	$(BIN)/ruff --version && $(BIN)/mypy --version
	touch $@

run: setup
	$(BIN)/lbt study $(ARGS)

train: setup
	$(BIN)/lbt train $(ARGS)

lint: setup
	$(BIN)/ruff check lbt tests bench
	$(BIN)/mypy

# Two test files at a time (pytest-xdist; a file's tests and fixtures stay in one worker): a test waiting on
# the processes it started leaves a core to the other file. A worker that dies ends the run at once, naming its
# test ("worker gwN crashed while running ..."): replaced, under --dist loadfile it can leave the run waiting
# forever (pytest-dev/pytest-xdist#784; seen here once, a worker aborted by a C++ "Resource deadlock avoided").
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile --max-worker-restart=0

test: lint
	$(PYTEST) $(ARGS)

test-fast: setup
	$(BIN)/ruff check lbt tests bench
	$(PYTEST) -m "not slow" $(ARGS)

clean-venv:
	rm -rf $(VENV)
