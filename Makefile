# The README's two commands: `make demo` (the main job) and `make test` (lint, import contracts, the suite).
# Each creates .venv on first use. TORCH is pinned so that pip takes the CPU wheel on this machine
# instead of a multi-GB CUDA build; override it (make TORCH=2.11.0) on a GPU machine.
PYTHON ?= python3
TORCH ?= 2.13.0
VENV := .venv
BIN := $(VENV)/bin
# One stamp per torch version: `make test TORCH=2.11.0` on an existing .venv reinstalls torch.
STAMP := $(VENV)/.installed-torch-$(TORCH)

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed-torch-*
	$(BIN)/pip install --quiet "torch==$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]" "torch==$(TORCH)"  # torch stays pinned beside the extras
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/lds-train

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports  # the layering declared in pyproject.toml: the library never imports the app
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) outputs multirun lightning_logs
