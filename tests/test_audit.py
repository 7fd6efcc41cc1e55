"""The empirical privacy audit: the one-run bound's math, the canary setting, and the verdicts
on the correct mechanism and on deliberately broken ones (fast mode)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from dpmuon.privacy import epsilon_after
from dpmuon.privacy.audit import (
    MODES,
    NOISE_BREAK_FACTOR,
    CanaryData,
    audit_ceiling,
    audit_mechanism,
    build_mechanism,
    calibrated_noise_multiplier,
    count_correct,
    draw_inclusion,
    linear_loss,
    membership_guesses,
    one_run_audit,
    one_run_epsilon_lower_bound,
    one_run_p_value,
    randomized_response_accuracy,
)

FAST = MODES["fast"][0]
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "audit_privacy.py"


def randomized_response_correct(epsilon: float, canaries: int, rng: np.random.Generator) -> int:
    """Correct guesses of an auditor who guesses every bit from ε-randomized response's output."""
    secret = rng.random(canaries) < 0.5
    kept = rng.random(canaries) < randomized_response_accuracy(epsilon)
    output = np.where(kept, secret, ~secret)
    return count_correct(np.where(output, 1, -1), secret)[0]


# --- the bound -------------------------------------------------------------------------------


def test_pure_p_value_is_the_randomized_response_binomial_tail():
    p = randomized_response_accuracy(1.5)
    assert one_run_p_value(300, 200, 150, 1.5, 0.0) == pytest.approx(stats.binom.sf(149, 200, p))


def test_delta_only_loosens_the_bound():
    assert one_run_p_value(1000, 200, 150, 1.0, 1e-5) > one_run_p_value(1000, 200, 150, 1.0, 0.0)
    assert one_run_epsilon_lower_bound(1000, 200, 180, 1e-5) <= one_run_epsilon_lower_bound(1000, 200, 180, 0.0)


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("delta", [0.0, 1e-6])
def test_bound_approaches_but_stays_below_epsilon_for_randomized_response(epsilon, delta):
    canaries = 200_000
    correct = randomized_response_correct(epsilon, canaries, np.random.default_rng(1))
    bound = one_run_epsilon_lower_bound(canaries, canaries, correct, delta)
    assert epsilon - 0.06 < bound <= epsilon


@pytest.mark.parametrize("delta", [0.0, 1e-4])
def test_bound_exceeds_epsilon_with_probability_at_most_beta(delta):
    """Exactly, not by simulation: against ε-randomized response (as leaky as ε-DP allows) the
    correct count is Binomial(m, e^ε/(1+e^ε)); sum its pmf over the counts whose 95% bound
    exceeds ε."""
    epsilon, canaries = 1.0, 500
    exceeding = [v for v in range(canaries // 2, canaries + 1) if one_run_epsilon_lower_bound(canaries, canaries, v, delta) > epsilon]
    size = stats.binom.pmf(exceeding, canaries, randomized_response_accuracy(epsilon)).sum()
    assert 0.01 < size <= 0.05  # valid, and not vacuously so


@pytest.mark.parametrize("delta", [0.0, 1e-5])
def test_more_correct_guesses_give_a_larger_bound(delta):
    canaries, guesses = 1000, 400
    bounds = [one_run_epsilon_lower_bound(canaries, guesses, v, delta) for v in range(200, guesses + 1, 10)]
    assert bounds[0] == 0.0  # chance-level accuracy refutes nothing
    assert all(b2 >= b1 for b1, b2 in zip(bounds, bounds[1:]))
    assert bounds[-1] > bounds[len(bounds) // 2] > 0


def test_more_guesses_at_equal_accuracy_give_a_larger_bound():
    assert one_run_epsilon_lower_bound(2000, 1000, 900, 1e-5) > one_run_epsilon_lower_bound(2000, 100, 90, 1e-5)


def test_higher_confidence_gives_a_smaller_bound():
    assert one_run_epsilon_lower_bound(1000, 500, 450, 1e-5, 0.99) < one_run_epsilon_lower_bound(1000, 500, 450, 1e-5, 0.9)


def test_guesses_take_both_tails_and_abstain_in_between():
    scores = np.array([0.5, -3.0, 2.0, 0.0, 9.0, -1.0])
    assert membership_guesses(scores, 3).tolist() == [0, -1, 1, 0, 1, 0]
    included = np.array([True, False, True, False, False, False])
    assert count_correct(membership_guesses(scores, 3), included) == (2, 3)


def test_bonferroni_reports_the_overall_confidence():
    rng = np.random.default_rng(3)
    included = rng.random(500) < 0.5
    scores = included + rng.normal(0, 0.5, 500)
    fractions = (0.1, 0.5, 0.9)
    bound = one_run_audit(scores, included, 1e-5, 0.95, fractions)
    assert bound.tests == 3 and bound.confidence == 0.95
    single = one_run_epsilon_lower_bound(500, bound.guesses, bound.correct, 1e-5, 1 - 0.05 / 3)
    assert bound.epsilon == single
    assert bound.epsilon <= audit_ceiling(500, 1e-5, 0.95, fractions)


# --- the canary setting ----------------------------------------------------------------------


def test_canary_lives_alone_in_its_coordinate():
    included = np.array([False, True, False, True])
    setup = replace(FAST, canaries=4, ordinary=3, ordinary_dim=2)
    data = CanaryData(setup, included, torch.Generator().manual_seed(0))
    x = data.batch(torch.tensor([1, 3, 4]))["x"]  # an ordinary point, then canaries 1 and 3
    assert torch.count_nonzero(x[0, 2:]) == 0
    assert x[1].tolist() == [0, 0, 0, setup.canary_norm, 0, 0]
    assert x[2].tolist() == [0, 0, 0, 0, 0, setup.canary_norm]


def test_a_sampled_canary_adds_exactly_the_clip_norm():
    """Noise-free release of one canary: its clipped gradient is C in its own coordinate."""
    setup = replace(FAST, canaries=3, ordinary=2, ordinary_dim=2)
    data = CanaryData(setup, np.array([True, True, True]), torch.Generator().manual_seed(0))
    model = nn.Linear(setup.input_dim, 1, bias=False)
    privatizer = build_mechanism(model, setup, 0.0, "none", torch.Generator())
    privatizer.release([data.batch(torch.tensor([3]))], linear_loss)  # canary 1
    expected = torch.zeros(setup.input_dim)
    expected[setup.ordinary_dim + 1] = -setup.clip_norm / setup.expected_lot_size
    torch.testing.assert_close(model.weight.grad[0], expected)
    privatizer.close()


@pytest.mark.parametrize("breakage", ["none", "noise", "clip"])
def test_every_mechanism_tells_the_accountant_the_calibrated_sigma(breakage):
    model = nn.Linear(FAST.input_dim, 1, bias=False)
    privatizer = build_mechanism(model, FAST, 2.0, breakage, torch.Generator())
    release_std = privatizer.block_stds[0] * privatizer.noise.scale
    claimed_std = 2.0 * FAST.clip_norm
    assert release_std == pytest.approx(claimed_std / (NOISE_BREAK_FACTOR if breakage == "noise" else 1.0))
    assert (privatizer.partition.thresholds[0] > FAST.canary_norm) == (breakage == "clip")
    assert privatizer.noise_multiplier == 2.0
    privatizer.close()


def test_inclusion_is_fair_and_seeded():
    included = draw_inclusion(10_000, 7)
    assert np.array_equal(included, draw_inclusion(10_000, 7))
    assert abs(included.mean() - 0.5) < 0.02


# --- verdicts in fast mode -------------------------------------------------------------------


@pytest.fixture(scope="module")
def sigma() -> float:
    return calibrated_noise_multiplier(FAST)


@pytest.mark.parametrize("engine", ["opacus", "fast"])
def test_correct_mechanism_passes(sigma, engine):
    result = audit_mechanism(replace(FAST, engine=engine), "none", sigma)
    assert result.claimed_epsilon <= FAST.epsilon
    assert result.bound.epsilon <= result.claimed_epsilon
    assert not result.detected


@pytest.mark.parametrize("engine", ["opacus", "fast"])
@pytest.mark.parametrize("breakage", ["noise", "clip"])
def test_broken_mechanism_is_detected(sigma, engine, breakage):
    result = audit_mechanism(replace(FAST, engine=engine), breakage, sigma)
    # The break is invisible to the accountant: it claims what the calibrated σ buys.
    assert result.claimed_epsilon == pytest.approx(epsilon_after(sigma, FAST.sample_rate, FAST.steps, FAST.delta))
    assert result.bound.epsilon > result.claimed_epsilon
    assert result.detected


def test_script_writes_json(tmp_path):
    spec = importlib.util.spec_from_file_location("audit_privacy", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "audit.json"
    assert script.main(["--break", "clip", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (result,) = report["scenarios"][0]["results"]
    assert result["mechanism"] == "broken: clip" and result["detected"]
    assert result["bound"]["epsilon"] > result["claimed_epsilon"]
