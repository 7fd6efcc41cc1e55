"""`dpmuon.make_private`: the driver's mechanism for a user's own model, data and loop.

The façade releases what the driver's mechanism (privacy/mechanism.py, as training/loop.py
configures it) releases for the same lot and seed; ε is the plan's; the budget guard stops the
lots; settings that void the guarantee are refused in one line; the lots are secret by default.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers_train import compose_config
from torch import nn

import dpmuon
from dpmuon.errors import UserError
from dpmuon.models import Shape, build_random_lm, hidden_matrices, per_example_lm_loss
from dpmuon.privacy import LEDGER_FILE
from dpmuon.privacy.accountant import PrivacyAccountant, epsilon_after
from dpmuon.privacy.mechanism import build_mechanism
from dpmuon.privacy.randomness import OS_ENTROPY
from dpmuon.privacy.seed import MECHANISM_SEED_ENV
from dpmuon.training.loop import privacy_settings

REPO = Path(__file__).resolve().parents[1]
N, LENGTH, VOCAB = 64, 8, 32
SEED = 0x7A57_FACADE_0123_4567_89AB_CDEF  # ≥ 2^64: no weak-seed warning
# The façade's keyword arguments and the driver's overrides for the same mechanism.
SETTINGS = dict(target_epsilon=8.0, delta=1e-3, steps=3, expected_lot_size=16, clip_norm=0.5, noise_multiplier=1.0, accountant="rdp")
OVERRIDES = [
    "privacy.target_epsilon=8.0", "privacy.delta=1e-3", "trainer.steps=3", "privacy.expected_lot_size=16", "privacy.clip_norm=0.5",
    "privacy.noise_multiplier=1.0", "privacy.accountant=rdp", "privacy.constant_time=false", "optimizer=dp_muon",
]  # fmt: skip


def tiny_model() -> nn.Module:
    return build_random_lm("gpt2", Shape(VOCAB, n_layer=1, n_embd=16, n_head=2, n_positions=LENGTH), seed=0).train()


def dataset() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (LENGTH,), generator=g) for _ in range(N)]


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.stack(rows)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def make(tmp_path: Path, model: nn.Module | None = None, name: str = "run", **overrides):
    settings = {**SETTINGS, "micro_batch_size": 8, **overrides}
    return dpmuon.make_private(model or tiny_model(), dataset(), collate, per_example_lm_loss, run_dir=tmp_path / name, **settings)


def test_the_release_equals_the_drivers_mechanism_for_the_same_lot_and_seed(tmp_path, monkeypatch):
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(SEED))
    private = make(tmp_path)
    model = tiny_model()
    (tmp_path / "driver").mkdir()
    driver = build_mechanism(
        model,
        N,
        privacy_settings(compose_config(*OVERRIDES)),
        hidden_matrices=hidden_matrices(model),
        user_secret=SEED,
        run_dir=tmp_path / "driver",
        dataset_name="custom",
        log=lambda message: None,
    )
    assert private.plan == driver.plan
    lot = next(private.lots())
    assert lot.indices == driver.next_lot() and len(lot) > 0
    private.release(lot)
    driver.release.release(lot.micro_batches(), per_example_lm_loss, step=1)
    for name, p in private.params.items():
        assert torch.equal(p.grad, driver.release.params[name].grad), name
    assert private.release_noise_std() == driver.release_noise_std()
    assert private.epsilon == driver.epsilon > 0


def test_epsilon_is_the_plans_and_the_ledger_records_every_release(tmp_path):
    private = make(tmp_path)
    optimizer = dpmuon.optim.build("dp_muon", private.model, private, lr=1e-3)
    released = 0
    for lot in private.lots():
        private.release(lot)
        optimizer.step()
        released += 1
    plan = private.plan
    assert released == plan.steps == 3
    assert private.epsilon == plan.planned_epsilon == epsilon_after(plan.noise_multiplier, plan.sample_rate, 3, plan.delta, "rdp", plan.slack)
    lines = [json.loads(line) for line in (tmp_path / "run" / LEDGER_FILE).read_text().splitlines()]
    assert lines[0]["kind"] == "header" and lines[0]["dataset_size"] == N
    assert [(r["step"], r["charged"]) for r in lines[1:]] == [(1, True), (2, True), (3, True)]


def test_the_budget_guard_stops_the_lots_before_the_target(tmp_path):
    first = make(tmp_path, noise_multiplier=0.5, steps=2, target_epsilon=100.0)  # the same run directory: its ledger continues
    for lot in first.lots():
        first.release(lot)
    history = PrivacyAccountant(1e-3, "rdp", first.plan.slack)
    history.history = list(first.mechanism.release.accountant.history)
    # A target that one more σ = 1 release just fits under (a second adds far more than 0.01%).
    target = history.epsilon_with(1, 1.0, first.plan.sample_rate) * 1.0001
    second = make(tmp_path, steps=5, target_epsilon=target)  # its plan alone fits: 5 steps at σ = 1
    released = 0
    for lot in second.lots():
        second.release(lot)
        released += 1
    assert released == 1 and second.epsilon <= target  # the ledger's two releases and this one


def test_a_lot_is_released_once_and_only_lots_from_lots_are_released(tmp_path):
    private = make(tmp_path)
    lot = next(private.lots())
    private.release(lot)
    with pytest.raises(UserError, match="released already"):
        private.release(lot)
    with pytest.raises(UserError, match="takes a lot from lots()"):
        private.release([collate(dataset()[:4])])


def test_lots_drawn_ahead_are_released_under_their_own_steps(tmp_path):
    private = make(tmp_path)
    lots = list(private.lots())
    for lot in reversed(lots):
        private.release(lot)
    lines = [json.loads(line) for line in (tmp_path / "run" / LEDGER_FILE).read_text().splitlines()[1:]]
    assert [(r["step"], r["charged"]) for r in lines] == [(3, True), (2, True), (1, True)]


def test_batch_norm_in_train_mode_is_refused(tmp_path):
    model = tiny_model()
    model.transformer.add_module("bn", nn.BatchNorm1d(16))
    with pytest.raises(UserError, match=r"^model module 'transformer.bn' is a BatchNorm1d in train mode"):
        make(tmp_path, model)


def test_shuffled_lots_need_an_explicit_opt_in(tmp_path):
    with pytest.raises(UserError, match=r"^make_private: sampling='shuffle' .* allow_shuffle_sampling=True"):
        make(tmp_path, sampling="shuffle")
    with pytest.warns(UserWarning, match="not a valid guarantee"):
        private = make(tmp_path, sampling="shuffle", allow_shuffle_sampling=True)
    assert len(next(private.lots())) == SETTINGS["expected_lot_size"]


def test_a_module_the_engine_cannot_handle_is_refused_in_one_line(tmp_path):
    class Scale(nn.Module):  # a trainable parameter outside every layer rule
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(16))

        def forward(self, x):
            return x * self.weight

    model = tiny_model()
    model.transformer.add_module("scale", Scale())
    with pytest.raises(UserError, match=r"^make_private: .*'transformer\.scale\.weight'") as caught:
        make(tmp_path, model, engine_fallback="error")
    assert "\n" not in str(caught.value)


def test_lots_are_secret_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv(MECHANISM_SEED_ENV, raising=False)
    draws = []
    for name in ("a", "b"):
        private = make(tmp_path, name=name)
        assert private.mechanism.randomness.source == OS_ENTROPY
        lots = private.lots()
        draws.append([next(lots).indices for _ in range(3)])
    assert draws[0] != draws[1]


def test_the_optimizer_needs_a_known_name_and_a_learning_rate(tmp_path):
    private = make(tmp_path)
    with pytest.raises(ValueError, match="unknown optimizer 'muon'; valid: dp_sgd, dp_adam, dp_muon, dp_muonbc"):
        dpmuon.optim.build("muon", private.model, private, lr=1e-3)
    with pytest.raises(ValueError, match="needs lr="):
        dpmuon.optim.build("dp_adam", private.model, private)
    muon = dpmuon.optim.build("dp_muonbc", private.model, private, lr=1e-3)
    assert set(muon.parts) == {"muon", "adam"}


def test_the_example_trains_privately_on_a_jsonl_file_and_prints_epsilon(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (MECHANISM_SEED_ENV, "DPMUON_TOKENIZER")}  # bytes: offline, small
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_private_jsonl.py"), "--run-dir", str(tmp_path), "--steps", "3", "--noise-multiplier", "1.0"],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    epsilon = float(re.search(r"^epsilon = (\S+) \(target 8,", done.stdout, re.M).group(1))
    assert math.isfinite(epsilon) and 0 < epsilon <= 8
    lines = (tmp_path / LEDGER_FILE).read_text().splitlines()
    assert len(lines) == 1 + 3 and all(json.loads(line)["charged"] for line in lines[1:])
