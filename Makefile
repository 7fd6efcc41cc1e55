# dpmuon — set-up, tests and the reproduction pipeline. `make help` lists the targets.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
# CPU machines pin the CPU wheel of torch (an unpinned torch pulls a multi-GB CUDA build);
# machines with nvidia-smi take the CUDA build. Override with TORCH_SPEC=... if needed.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch>=2.6,torch==2.13.0)
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup test test-slow data smoke bench-bias

help: ## List every target with one line each
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-22s %s\n", $$1, $$2}'

setup: ## Create .venv/ and install dpmuon (editable) with the dev extra
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet "$(TORCH_SPEC)"
	$(PYTHON) -m pip install --quiet -e ".[dev]" "$(TORCH_SPEC)"

test: ## Run the default test suite (offline, CPU; excludes slow and gpu markers)
	$(PYTHON) -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

test-slow: ## Run the slow checks too (still CPU)
	$(PYTHON) -m pytest -m "not gpu" $(PYTEST_ARGS)

bench-bias: ## Monte Carlo of the Newton–Schulz bias and DP-MuonBC's correction → results/bias/
	$(PYTHON) scripts/bench_bias.py

data: ## Fetch raw E2E and DART into data/raw/ (or LINK=DIR to link a local copy)
	$(PYTHON) scripts/download_data.py $(if $(LINK),--link $(LINK))

smoke: ## One tiny private run on real data (DP-MuonBC on E2E, under 2 minutes on 2 CPU cores)
	$(PYTHON) -m dpmuon.train experiment=smoke optimizer=dp_muonbc dataset=e2e logger=none
