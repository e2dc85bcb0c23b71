# Two commands on a fresh machine: `make run` (the main job) and `make test`.
# The venv lives outside the clone and is rebuilt when pyproject.toml changes.
PYTHON ?= python3
VENV ?= $(HOME)/.cache/lbt/venv-$(shell sha256sum pyproject.toml | cut -c1-12)
BIN := $(VENV)/bin
ARGS ?=

.PHONY: setup run train test clean-venv

setup: $(VENV)/.deps-installed
	@# Point the (shared) venv's lbt at this checkout; cheap, so done every time.
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
