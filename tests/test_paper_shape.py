"""The paper's E2E configuration at full size, on the CPU (slow: minutes per run).

`experiment=e2e` composed as `make reproduce-e2e` composes it, with three changes: a random-init
model of GPT-2 small's shape from a local config (`model=gpt2_small_random`: 12 × 768, 1024
positions, GPT-2's full vocabulary; no hub), an expected lot of 64 instead of 1024, and
`trainer.steps=2`; plus small validation and test subsets so that evaluation stays short. The
run goes end to end — the privacy plan over the full training set, Poisson lots split into
micro-batches of the experiment's 32, per-matrix clipping of all 148–149 blocks, beam-5
decoding of a few test sources, every artifact — for the tied and the untied LM head.
Step time and peak memory are printed (`pytest -s`).
"""

from __future__ import annotations

import json
import resource
import time

import pytest
import torch
from helpers_train import compose_config, require_real_data

from dpmuon.data import group_references, load_examples
from dpmuon.eval.runs import read_run_rows
from dpmuon.privacy.accountant import ReleaseSlack, epsilon_after
from dpmuon.training.loop import run

GPT2_VOCAB = 50257 + 1  # GPT-2's BPE plus the added pad token
TEST_SOURCES = 4

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("untie", "optimizer"), [(False, "dp_muonbc"), (True, "dp_adam")], ids=["tied-dp_muonbc", "untied-dp_adam"])
def test_paper_e2e_configuration_runs_end_to_end_at_gpt2_small_size(tmp_path, untie, optimizer):
    require_real_data()
    cfg = compose_config(
        "experiment=e2e", f"optimizer={optimizer}", "seed=0",  # as `make reproduce-e2e` has it
        "model=gpt2_small_random", f"model.untie_head={str(untie).lower()}",
        "privacy.expected_lot_size=64", "trainer.steps=2",
        "data.max_valid_examples=32", f"data.max_test_sources={TEST_SOURCES}",
        "trainer.num_threads=1", "logging.progress=false", "logger=none",
    )  # fmt: skip
    assert (cfg.privacy.target_epsilon, cfg.privacy.clip_norm, cfg.trainer.micro_batch_size, cfg.eval.num_beams) == (8.0, 0.1, 32, 5)
    started, cpu_started = time.perf_counter(), time.process_time()
    summary = run(cfg, tmp_path)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started

    # The plan: the full training set, the paper's δ and ε, σ calibrated for two steps.
    assert summary["dataset_size"] == 42_057 and summary["steps"] == 2 and summary["delta"] == 8e-6
    # Constant-time lots in width buckets (fp32 on the CPU): the length histogram's release first.
    slack, prior = ReleaseSlack(**summary["release_slack"]), ((20.0, 1.0, 1),)
    assert summary["length_noise_multiplier"] == 20.0 and len(summary["widths"]) > 1
    assert summary["epsilon"] == pytest.approx(epsilon_after(summary["noise_multiplier"], 64 / 42_057, 2, 8e-6, "prv", slack, prior))
    assert summary["epsilon"] <= 8.0 and summary["tied_lm_head"] is (not untie)
    rows = read_run_rows(tmp_path, diagnostics=True)  # with the owner-only diagnostics (train loss, lot size, step time)
    assert rows[0]["step"] == 0 and set(rows[0]) == {"step", "val_nll"}  # the initial weights' validation NLL
    rows = rows[1:]
    assert [r["step"] for r in rows] == [1, 2] and all(r["train_loss"] > 0 for r in rows)
    # Poisson lots of mean 64 take more than one micro-batch of 32 (P(lot ≤ 32) < 1e-4).
    assert all(r["lot_size"] > 32 for r in rows)

    # Beam decoding of the first sources (one output per distinct source) and their scores.
    items = group_references(load_examples("e2e", "test"))[:TEST_SOURCES]
    generations = (tmp_path / "generations.txt").read_text().split("\n")[:-1]
    assert len(generations) == summary["test_sources"] == len({item.source for item in items}) == TEST_SOURCES
    assert all(summary[key] is not None for key in ("test_nll", "bleu", "bleu_lowercase", "rouge_l"))

    # The checkpoint holds the full-size model (a separate head when untied) and the optimizer.
    state = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=False, mmap=True)
    weights = state["model"]
    assert weights["transformer.wte.weight"].shape == (GPT2_VOCAB, 768)
    assert weights["lm_head.weight"].shape == (GPT2_VOCAB, 768)
    assert (weights["lm_head.weight"].data_ptr() == weights["transformer.wte.weight"].data_ptr()) is (not untie)
    assert len([k for k in weights if k.startswith("transformer.h.")]) == 12 * 12
    assert state["optimizer"]

    step_seconds = [r["step_seconds"] for r in rows]
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    measured = {"step_seconds": step_seconds, "lot_sizes": [r["lot_size"] for r in rows], "run_wall_seconds": wall,
                "run_cpu_seconds": cpu, "peak_rss_gib": peak_rss_gib}  # fmt: skip
    print(f"paper shape ({'untied' if untie else 'tied'}, {optimizer}): {json.dumps(measured)}")
