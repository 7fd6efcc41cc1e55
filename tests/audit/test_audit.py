"""The empirical privacy audit: the one-run bound's math, the auditor's score, the canary
settings, the broken mechanisms, and the verdicts of quick mode (the CI audit)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

from dpmuon.audit import (
    BREAK_LABELS,
    BREAKS,
    MODES,
    DiracCanaries,
    GPT2Canaries,
    Seeds,
    audit_ceiling,
    break_settings,
    build_mechanism,
    count_correct,
    draw_inclusion,
    membership_guesses,
    one_run_audit,
    one_run_epsilon_lower_bound,
    one_run_p_value,
    randomized_response_accuracy,
    run_audits,
    sampled_release_log_likelihood_ratio,
    train_and_score,
)
from dpmuon.audit import canaries as audit_module
from dpmuon.audit.cli import main as audit_main
from dpmuon.privacy import PoissonLotSampler, epsilon_after

QUICK_FAST, QUICK_OPACUS = MODES["quick"]
(FULL_GPT2,) = [setup for setup in MODES["full"] if setup.model == "gpt2"]


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


def test_the_ceiling_is_set_by_the_guessed_fraction_not_the_number_of_canaries():
    """The 2mδ term grows with m as fast as the guesses do: at δ = 1e-5 the ceiling levels off
    near log(fβ/δ) — why the designs guess a few percent of 10⁴–10⁵ canaries, not more."""
    ceilings = [audit_ceiling(m, 1e-5, 0.95, (0.03,)) for m in (30_000, 100_000, 1_000_000)]
    assert max(ceilings) - min(ceilings) < 0.3
    assert all(c < math.log(0.03 * 0.05 / 1e-5) for c in ceilings)
    assert audit_ceiling(100_000, 1e-5, 0.95, (0.3,)) > ceilings[1] + 1.5


def test_guesses_take_both_tails_and_abstain_in_between():
    scores = np.array([0.5, -3.0, 2.0, 0.0, 9.0, -1.0])
    assert membership_guesses(scores, 3).tolist() == [0, -1, 1, 0, 1, 0]
    included = np.array([True, False, True, False, False, False])
    assert count_correct(membership_guesses(scores, 3), included) == (2, 3)


def test_upper_tail_guesses_are_all_in():
    scores = np.array([0.5, -3.0, 2.0, 0.0, 9.0, -1.0])
    assert membership_guesses(scores, 3, "upper").tolist() == [1, 0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="tails"):
        membership_guesses(scores, 3, "lower")


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


# --- the auditor's score ---------------------------------------------------------------------


def test_log_likelihood_ratio_by_hand():
    # snr = 2, q = 0.1: a release of exactly the canary (projection 1) vs exactly nothing (0).
    assert sampled_release_log_likelihood_ratio(np.array(1.0), 2.0, 0.1) == pytest.approx(math.log(0.9 + 0.1 * math.e**2))
    assert sampled_release_log_likelihood_ratio(np.array(0.0), 2.0, 0.1) == pytest.approx(math.log(0.9 + 0.1 * math.e**-2))
    # q = 1: the canary is in every lot, and the ratio is that of two Gaussians.
    assert sampled_release_log_likelihood_ratio(np.array(0.8), 2.0, 1.0) == pytest.approx(4 * 0.3)


def test_log_likelihood_ratio_is_the_ratio_of_the_two_densities():
    projection, snr, q = np.linspace(-2, 3, 11), 1.7, 0.05
    std = 1 / snr
    sampled_or_not = (1 - q) * stats.norm.pdf(projection, 0, std) + q * stats.norm.pdf(projection, 1, std)
    expected = np.log(sampled_or_not / stats.norm.pdf(projection, 0, std))
    np.testing.assert_allclose(sampled_release_log_likelihood_ratio(projection, snr, q), expected, rtol=1e-10, atol=1e-12)


# --- the canary settings ---------------------------------------------------------------------

TINY_DIRAC = replace(QUICK_FAST, canaries=4, ordinary=3, ordinary_rows=2, expected_lot_size=2, blocks=3)
TINY_GPT2 = replace(FULL_GPT2, canaries=6, ordinary=4, ordinary_rows=8, expected_lot_size=2)


def noise_free_release(world, setup, lot: list[int], breakage: str = "none", engine: str = "fast"):
    privatizer = build_mechanism(world, replace(setup, engine=engine), 0.0, breakage, torch.Generator())
    privatizer.release([world.batch(torch.tensor(lot))], world.loss)
    privatizer.close()
    return privatizer


@pytest.mark.parametrize("engine", ["fast", "opacus"])
def test_a_sampled_dirac_canary_adds_exactly_its_clip_norm_in_its_row_of_every_block(engine):
    world = DiracCanaries(TINY_DIRAC, np.array([True, True, False, True]), torch.Generator().manual_seed(0))
    noise_free_release(world, TINY_DIRAC, [1, 4, 5], engine=engine)  # canary 1 and two ordinary points
    claimed = world.partition(TINY_DIRAC.clip_norm)
    for block, table in zip(claimed.blocks, world.model.tables):
        assert block.threshold == pytest.approx(TINY_DIRAC.clip_norm / math.sqrt(3))
        canary_rows = table.weight.grad[: TINY_DIRAC.canaries, 0]
        expected = torch.zeros(TINY_DIRAC.canaries)
        expected[1] = -block.threshold / TINY_DIRAC.expected_lot_size
        torch.testing.assert_close(canary_rows, expected)  # the ordinary points stay in their rows
    projection, norm = world.canary_projections(claimed, TINY_DIRAC.expected_lot_size)
    np.testing.assert_allclose(projection, [0, 1, 0, 0], atol=1e-6)
    np.testing.assert_allclose(norm, claimed.sensitivity)


def test_an_excluded_canarys_slot_is_a_blank():
    world = DiracCanaries(TINY_DIRAC, np.array([True, False, True, True]), torch.Generator().manual_seed(0))
    assert len(world) == TINY_DIRAC.dataset_size  # N does not depend on who is in
    noise_free_release(world, TINY_DIRAC, [1])
    assert all(torch.count_nonzero(table.weight.grad) == 0 for table in world.model.tables)


def test_the_gpt2_auditor_recomputes_exactly_what_the_release_adds():
    """White-box: the auditor's clipped canary gradient, from the model alone, is the canary's
    contribution to the embedding rows of the (noise-free) release."""
    included = np.array([True, True, True, False, True, True])
    world = GPT2Canaries(TINY_GPT2, included, torch.Generator().manual_seed(0))
    claimed = world.partition(TINY_GPT2.clip_norm)
    noise_free_release(world, TINY_GPT2, [2, 3, 6, 7])  # canary 2, a blank, two ordinary points
    projection, norm = world.canary_projections(claimed, TINY_GPT2.expected_lot_size)
    np.testing.assert_allclose(projection, [0, 0, 1, 0, 0, 0], atol=1e-5)
    threshold = claimed.blocks[claimed.block_index()[GPT2Canaries.embedding]].threshold
    np.testing.assert_allclose(norm, threshold, rtol=1e-6)  # every canary is clipped
    assert len(claimed) == len(list(world.model.parameters())) > 20  # a block per tensor


def test_the_audit_samples_with_the_training_loops_sampler(monkeypatch):
    calls = []

    def spy(kind, num_samples, expected_lot_size, generator):
        calls.append((kind, num_samples, expected_lot_size))
        return PoissonLotSampler(num_samples, expected_lot_size / num_samples, generator)

    monkeypatch.setattr(audit_module, "build_lot_sampler", spy)
    setup = replace(QUICK_OPACUS, steps=2)
    train_and_score(setup, draw_inclusion(setup.canaries, 0), 1.0, "none", Seeds.spawn(0))
    assert calls == [("poisson", setup.dataset_size, setup.expected_lot_size)]
    assert setup.sample_rate == setup.expected_lot_size / setup.dataset_size


# --- the broken mechanisms -------------------------------------------------------------------


@pytest.mark.parametrize("breakage", BREAKS)
def test_every_mechanism_tells_the_accountant_the_calibrated_sigma(breakage):
    sigma = 2.0
    world = DiracCanaries(TINY_DIRAC, np.ones(4, dtype=bool), torch.Generator())
    claimed = world.partition(TINY_DIRAC.clip_norm)
    privatizer = build_mechanism(world, TINY_DIRAC, sigma, breakage, torch.Generator())
    release_stds = [std * privatizer.noise.scale for std in privatizer.block_stds]
    expected = {
        "none": [sigma * claimed.sensitivity] * 3,
        "tenth_noise": [sigma * claimed.sensitivity / 10] * 3,
        "half_noise": [sigma * claimed.sensitivity / 2] * 3,
        "per_block_noise": [sigma * block.threshold for block in claimed.blocks],  # σ·C_W = σΔ/√3
        "no_clip": [sigma * claimed.sensitivity] * 3,  # still calibrated to the claimed C
    }[breakage]
    assert release_stds == pytest.approx(expected)
    assert all((t > TINY_DIRAC.canary_norm) == (breakage == "no_clip") for t in privatizer.partition.thresholds)
    assert privatizer.noise_multiplier == sigma
    privatizer.close()


def test_the_per_block_break_is_refused_for_unequal_thresholds():
    world = GPT2Canaries(TINY_GPT2, np.ones(6, dtype=bool), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="equal block thresholds"):
        break_settings("per_block_noise", world.partition(0.01))


# --- the designs and the verdicts in quick mode ----------------------------------------------


@pytest.mark.parametrize("setup", MODES["quick"] + MODES["full"], ids=lambda s: f"{s.name}-{s.seed}")
def test_every_design_can_refute_its_claim(setup):
    ceiling = audit_ceiling(setup.canaries, setup.delta, setup.confidence, setup.guess_fractions)
    assert ceiling > setup.epsilon
    if "half_noise" in setup.breaks:  # room to report noise ÷ 2 (true ε > 5) well above the claim
        assert ceiling > setup.epsilon + 2


@pytest.fixture(scope="module")
def quick_results():
    torch.set_num_threads(1)
    return {(r.scenario, r.mechanism): r for setup in MODES["quick"] for r in run_audits(setup)}


@pytest.mark.parametrize("setup", MODES["quick"], ids=lambda s: s.name)
def test_quick_mode_passes_the_correct_mechanism(quick_results, setup):
    result = quick_results[setup.name, BREAK_LABELS["none"]]
    assert result.claimed_epsilon <= setup.epsilon
    assert result.bound.epsilon < 1.0 < setup.epsilon  # not a near miss
    assert not result.detected


@pytest.mark.parametrize(
    "setup, breakage", [(s, b) for s in MODES["quick"] for b in s.breaks if b != "none"], ids=lambda x: getattr(x, "name", x)
)
def test_quick_mode_detects_every_break(quick_results, setup, breakage):
    result = quick_results[setup.name, BREAK_LABELS[breakage]]
    # The break is invisible to the accountant: it claims what the calibrated σ buys.
    assert result.claimed_epsilon == pytest.approx(epsilon_after(result.noise_multiplier, setup.sample_rate, setup.steps, setup.delta))
    assert result.bound.epsilon > result.claimed_epsilon
    assert result.detected


def test_quick_mode_audits_the_moderate_breaks():
    """Noise ÷ 2 and per-block noise (÷ √3 with 3 blocks) are what the design is sized for."""
    assert {"half_noise", "per_block_noise"} <= set(QUICK_FAST.breaks) and QUICK_FAST.blocks == 3


def test_script_writes_json_and_markdown(tmp_path):
    out, table = tmp_path / "audit.json", tmp_path / "table.md"
    assert audit_main(["--scenario", "dirac-opacus", "--break", "no_clip", "--json", str(out), "--markdown", str(table)]) == 0
    report = json.loads(out.read_text())
    (result,) = report["scenarios"][0]["results"]
    assert result["mechanism"] == "broken: clipping off" and result["detected"]
    assert result["bound"]["epsilon"] > result["claimed_epsilon"]
    assert "--break no_clip" in report["command"]
    assert "| dirac-opacus | 0 | broken: clipping off |" in table.read_text()


@pytest.mark.slow
def test_gpt2_scenario_passes_the_correct_mechanism_and_catches_gross_breaks():
    results = run_audits(replace(FULL_GPT2, steps=40))
    verdicts = {r.mechanism: r.detected for r in results}
    assert verdicts == {BREAK_LABELS["none"]: False, BREAK_LABELS["tenth_noise"]: True, BREAK_LABELS["no_clip"]: True}
