# Two commands on a fresh machine: `make run` (the main job) and `make test`.
# Each checkout has its own venv (.venv/, git-ignored), its dependencies reinstalled when
# pyproject.toml changes: a venv shared between clones ran whichever clone last set it up.
PYTHON ?= python3
VENV ?= $(CURDIR)/.venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: setup run train test clean-venv

setup: $(VENV)/.deps-installed
	@# The checkout's lbt, editable (a moved checkout re-points it); cheap, so done every time.
	@$(BIN)/pip install -q --no-deps --no-build-isolation -e .

$(VENV)/.deps-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q '.[dev]'
	$(BIN)/python -c "import torch, torchvision, hydra, mnist1d, tensorboard, pytest"
	touch $@

run: setup
	$(BIN)/lbt study $(ARGS)

train: setup
	$(BIN)/lbt train $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

clean-venv:
	rm -rf $(VENV)
