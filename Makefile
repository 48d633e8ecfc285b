# The README's two commands: `make demo` (the main job) and `make test` (lint, import contracts, the suite).
# `make test-oldest`, run by hand: a subset on the oldest declared versions (.ci/oldest.txt) in .venv-oldest.
# Each creates its venv on first use. TORCH is pinned so that pip takes the CPU wheel on this machine
# instead of a multi-GB CUDA build; override it (make TORCH=2.11.0) on a GPU machine.
PYTHON ?= python3
TORCH ?= 2.13.0
VENV := .venv
BIN := $(VENV)/bin
# One stamp per torch version: `make test TORCH=2.11.0` on an existing .venv reinstalls torch.
STAMP := $(VENV)/.installed-torch-$(TORCH)
OLDEST := .venv-oldest
# uv installs the test venv: pip's resolving and unpacking took 98 s of CI's 15 minutes, uv 46 s from a cold cache.
# Bytecode is compiled at install, as pip does (the test processes start with -B: without .pyc files every one of
# them compiled torch's sources). uv reads pip's find-links from the environment only (this machine's CPU torch).
UV = $(1)/bin/uv pip install --quiet --compile-bytecode --python $(1)/bin/python $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
# torchtitan 0.3 is a test dependency only (tests/parallel/test_expert_conventions.py builds its MoE): its own
# dependencies are training tools the tests do not import, so it comes without them, with what its import needs.
TORCHTITAN := torchtitan==0.3.0 spmd-types==0.2.3 triton==3.9.0
# The pipeline compositions' refusals (their 4- and 8-rank spawns stay in `make test` only, see OLDEST_SKIP).
COMPOSE_REFUSALS := test_a_stage_boundary_inside_a_tensor_parallel_pair_is_refused \
	test_what_does_not_compose_yet_is_refused_at_construction test_compressing_a_model_parallel_stage_exchange_is_refused
# One fast test of each component and the tests that depend on the versions (transformers' plans, Hydra, Optuna,
# Lightning's checkpoint and model-parallel contract, torch's pipelining and fake process group).
OLDEST_TESTS := tests/test_versions.py tests/moe tests/parallel/test_hf_families.py tests/parallel/test_expert.py \
	tests/parallel/test_activation_checkpointing.py tests/parallel/test_fsdp.py tests/parallel/test_plan.py \
	tests/parallel/test_lightning_contract.py tests/parallel/test_checkpoint.py tests/hpo/test_upstream_sweeper.py \
	tests/hpo/test_search.py tests/precision tests/compression/test_hook.py tests/compression/test_callback.py \
	tests/elastic/test_components.py tests/optim tests/data tests/models tests/autotune/test_decision.py \
	tests/planning/test_fake_world.py tests/app/test_cli.py tests/app/test_summary.py \
	$(addprefix tests/parallel/test_pipeline_compose.py::, $(COMPOSE_REFUSALS)) tests/parallel/test_pipeline_overlap.py \
	tests/parallel/test_sequence_parallel.py tests/parallel/test_loss_parallel.py
# The 4- and 8-rank pipeline compositions (a spawn each, minutes) stay in `make test` only: the oldest job keeps the
# compositions' refusals and one 4-rank pipeline spawn (pp=2 x ep=2, test_pipeline_overlap.py).

.PHONY: demo install test test-oldest lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed-torch-*
	$(BIN)/pip install --quiet uv
	$(call UV,$(VENV)) -e ".[dev]" "torch==$(TORCH)"  # torch stays pinned beside the extras
	$(call UV,$(VENV)) --no-deps $(TORCHTITAN) && $(call UV,$(VENV)) tyro
	touch $(STAMP)

# pip, not uv: its 2.6 GB install took 94 CPU s, uv's 78 (not worth a second installer's way of resolving here).
$(OLDEST)/.installed: pyproject.toml .ci/oldest.txt
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install --quiet -c .ci/oldest.txt torch
	$(OLDEST)/bin/pip install --quiet -c .ci/oldest.txt -e ".[dev]" lightning optuna hydra-core transformers torchao
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/lds-train

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports  # the layering declared in pyproject.toml: the library never imports the app
	# Two workers, a file each at a time, the longest files first (tests/conftest.py): the ranks of most tests wait on
	# each other, so one worker keeps the 2 cores about half busy. The slowest listed: under 15 minutes in CI.
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests

# Run by hand (not in CI: beside `make test` it took CI over its 15 minutes), on two workers.
test-oldest: $(OLDEST)/.installed
	$(OLDEST)/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $(OLDEST_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) $(OLDEST) outputs multirun lightning_logs
