"""Oracle diagnostics: the noise-free buffer beside the real one, without touching training."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers_train import compose_config, require_real_data, seed_file_override

from dpmuon.diagnostics import OracleAlignment
from dpmuon.diagnostics.oracle import frobenius_cosine
from dpmuon.errors import UserError
from dpmuon.eval.runs import read_run_rows
from dpmuon.optim import Muon
from dpmuon.training.loop import run

TINY = [
    "experiment=smoke", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.n_positions=128",
    "data.max_train_examples=200", "data.max_valid_examples=4", "data.max_test_sources=1", "privacy.expected_lot_size=16",
    "privacy.noise_multiplier=1.0", "trainer.steps=4", "trainer.micro_batch_size=16", "eval.test=false",
    "logging.progress=false", "logger=none", "trainer.num_threads=1", seed_file_override(4 << 100),
]  # fmt: skip


def oracle_step(noise: torch.Tensor, signal: torch.Tensor, std: float, steps: int = 3) -> dict:
    p = torch.nn.Parameter(torch.zeros(signal.shape))
    muon = Muon([p], lr=0.0, momentum=0.9, bias_correction=True, release_noise_std={p: std})
    oracle = OracleAlignment(muon, {p: "w"}, {"w": std})
    for _ in range(steps):
        oracle.observe({"w": signal})
        p.grad = signal + noise
        fields = oracle.step()
        muon.step()
        assert torch.equal(oracle.noisy[p], muon.state[p]["momentum_buffer"])  # the mirror is exact
    return fields


def test_true_snr_is_the_noise_free_buffer_energy_over_the_update_noise():
    signal = torch.full((8, 6), 0.5)
    fields = oracle_step(torch.zeros(8, 6), signal, std=0.1, steps=3)
    buffer = signal * (1 + 0.9 + 0.81)  # heavy-ball buffer after three equal gradients
    variance = 0.1**2 * (1 + 0.9**2 + 0.9**4)
    assert fields["oracle_snr"]["w"] == pytest.approx(float(buffer.pow(2).sum()) / (variance * 48), rel=1e-6)
    assert fields["oracle_cos_plain"]["w"] == pytest.approx(1.0, abs=1e-6)  # no noise drawn: M = M₀


def test_alignment_falls_with_the_noise():
    g = torch.Generator().manual_seed(0)
    signal = torch.randn(16, 12, generator=g)
    quiet = oracle_step(0.01 * torch.randn(16, 12, generator=g), signal, std=0.01)
    loud = oracle_step(10.0 * torch.randn(16, 12, generator=g), signal, std=10.0)
    assert quiet["oracle_cos_plain_median"] > 0.99 > loud["oracle_cos_plain_median"]
    assert math.isfinite(loud["oracle_cos_bc_median"])
    assert frobenius_cosine(signal, -signal) == pytest.approx(-1.0)


def test_probe_averaged_corrected_map_and_signals_see_what_one_draw_cannot():
    """At SNR ~1 the single-draw cosine carries the probes' variance; averaging 16 pairs removes
    most of it, so the averaged map points closer to F(M₀) than one draw does, and the signals
    are projections: F(M₀)'s own would be exactly 1."""
    g = torch.Generator().manual_seed(2)
    signal = torch.randn(24, 16, generator=g)
    fields = oracle_step(1.0 * torch.randn(24, 16, generator=g), signal, std=1.0, steps=2)
    assert fields["oracle_cos_bc_mean"]["w"] > fields["oracle_cos_bc"]["w"]
    assert 0 < fields["oracle_signal_plain"]["w"] < 1 and 0 < fields["oracle_signal_bc"]["w"]
    clean = oracle_step(torch.zeros(24, 16), signal, std=1e-9, steps=2)
    assert clean["oracle_signal_plain"]["w"] == pytest.approx(1.0, abs=1e-4)


def test_a_resumed_oracle_continues_its_mirrors_exactly():
    """Mirrors and probe stream restored from state_dict give the rows of an uninterrupted run."""
    g = torch.Generator().manual_seed(1)
    signals = [torch.randn(8, 6, generator=g) for _ in range(4)]
    noises = [torch.randn(8, 6, generator=g) for _ in range(4)]

    def parts():
        p = torch.nn.Parameter(torch.zeros(8, 6))
        muon = Muon([p], lr=0.0, momentum=0.9, bias_correction=True, release_noise_std={p: 0.3})
        return p, muon, OracleAlignment(muon, {p: "w"}, {"w": 0.3}, seed=5)

    def advance(p, muon, oracle, steps):
        rows = []
        for signal, noise in steps:
            oracle.observe({"w": signal})
            p.grad = signal + noise
            rows.append(oracle.step())
            muon.step()
        return rows

    steps = list(zip(signals, noises))
    whole = advance(*parts(), steps)
    p, muon, oracle = parts()
    advance(p, muon, oracle, steps[:2])
    saved_muon, saved_oracle = muon.state_dict(), oracle.state_dict()
    q, resumed_muon, resumed = parts()
    resumed_muon.load_state_dict(saved_muon)
    resumed.load_state_dict(saved_oracle)
    assert advance(q, resumed_muon, resumed, steps[2:]) == whole[2:]


def test_oracle_rows_are_logged_and_training_is_unchanged(tmp_path):
    require_real_data()
    plain = run(compose_config(*TINY, "optimizer=dp_muonbc"), tmp_path / "off")
    traced = run(compose_config(*TINY, "optimizer=dp_muonbc", "logging.oracle_alignment=true"), tmp_path / "on")
    assert traced["final_weights_sha256"] == plain["final_weights_sha256"]  # M₀ never reaches the optimizer
    assert plain["metric_implementations"] == {} and plain["bleu"] is None  # eval.test=false: nothing scored, no scorers
    published = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    assert not any(key.startswith("oracle") for row in published for key in row)  # by default: the owner-only file
    rows = [r for r in read_run_rows(tmp_path / "on", diagnostics=True) if r["step"] > 0]  # (step 0: the initial weights' validation NLL)
    assert all(len(r["oracle_snr"]) == 4 and -1 <= r["oracle_cos_bc_median"] <= 1 for r in rows)
    assert all(-1 <= r["oracle_cos_bc_mean_median"] <= 1 and "oracle_signal_bc_median" in r for r in rows)


def test_oracle_needs_diagnostics_and_a_muon_optimizer(tmp_path):
    require_real_data()
    with pytest.raises(UserError, match="nonprivate_diagnostics"):
        run(compose_config(*TINY, "optimizer=dp_muon", "logging.oracle_alignment=true", "logging.nonprivate_diagnostics=false"), tmp_path / "a")
    with pytest.raises(UserError, match="Muon-family"):
        run(compose_config(*TINY, "optimizer=dp_adam", "logging.oracle_alignment=true"), tmp_path / "b")
