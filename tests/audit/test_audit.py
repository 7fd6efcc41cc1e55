"""The empirical privacy audit: the one-run bounds' math ((ε, δ) and f-DP / Gaussian DP), the
auditor's score, the canary settings (every block type), the mutations, the white-box checks,
the verdicts of quick mode (the CI audit) and the command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

from dpmuon.audit import (
    BREAK_LABELS,
    BREAKS,
    MODES,
    MUTATIONS,
    BlockCanaries,
    DiracCanaries,
    GPT2Canaries,
    Mutation,
    PrivacyProfile,
    Seeds,
    audit_ceiling,
    audit_mechanism,
    build_mechanism,
    build_sampler,
    count_correct,
    draw_inclusion,
    engine_mutation,
    expected_verdict,
    fdp_refutes,
    gdp_blow_up_inverse,
    gdp_delta,
    gdp_epsilon,
    gdp_mu_lower_bound,
    gdp_profile,
    lot_reuse_p_value,
    membership_guesses,
    noise_reuse_p_value,
    one_run_audit,
    one_run_epsilon_lower_bound,
    one_run_p_value,
    profile_blow_up_inverse,
    randomized_response_accuracy,
    run_audits,
    sampled_release_log_likelihood_ratio,
    train_and_score,
)
from dpmuon.audit import canaries as audit_module
from dpmuon.audit.canaries import ONE_RUN_BLIND
from dpmuon.audit.cli import main as audit_main
from dpmuon.audit.cli import parse_args, selected_setups
from dpmuon.paths import REPO_ROOT
from dpmuon.privacy import PoissonLotSampler, epsilon_after
from dpmuon.privacy.engines.fast.layers import AffineLayer
from dpmuon.privacy.randomness import SecretStream

QUICK_BLOCKS, QUICK_FAST, QUICK_OPACUS = MODES["quick"]
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


# --- f-DP and Gaussian DP ---------------------------------------------------------------------


def test_gdp_delta_and_epsilon_by_hand():
    assert gdp_delta(1.0, 0.0) == pytest.approx(2 * stats.norm.cdf(0.5) - 1)
    assert gdp_delta(0.0, 1.0) == 0.0
    epsilon = gdp_epsilon(1.0, 1e-5)
    assert gdp_delta(1.0, epsilon) == pytest.approx(1e-5, rel=1e-3)
    assert gdp_epsilon(0.5, 1e-5) < epsilon < gdp_epsilon(2.0, 1e-5)


def test_the_envelope_of_a_gdp_profile_is_its_blow_up():
    """min_ε e^ε x + δ_μ(ε) is 1 − f_μ(x) (the profile determines the curve); on a grid of ε it
    lies above it — a weaker hypothesis, so refuting it stays valid."""
    exact, envelope = gdp_blow_up_inverse(1.0), profile_blow_up_inverse(gdp_profile(1.0))
    for y in (0.01, 0.1, 0.5, 0.9):
        assert envelope(y) <= exact(y) + 1e-12
        assert envelope(y) == pytest.approx(exact(y), rel=0.05)


@pytest.mark.parametrize("epsilon", [1.0, 2.0])
def test_the_fdp_test_of_a_pure_dp_profile_has_size_beta_against_randomized_response(epsilon):
    """Exactly, as for the (ε, δ) bound: ε-randomized response is the leakiest ε-DP mechanism, its
    correct count Binomial(m, e^ε/(1+e^ε)); the counts the f-DP test refutes carry ≤ 5% of it —
    and start where the (ε, δ) bound's do (within a count): the recursion loses nothing there."""
    canaries, inverse = 500, profile_blow_up_inverse(PrivacyProfile((epsilon,), (0.0,)))
    refuted = [v for v in range(canaries // 2, canaries + 1) if fdp_refutes(canaries, canaries, v, inverse, 0.05)]
    size = stats.binom.pmf(refuted, canaries, randomized_response_accuracy(epsilon)).sum()
    assert 0.01 < size <= 0.05
    first = min(v for v in range(canaries // 2, canaries + 1) if one_run_epsilon_lower_bound(canaries, canaries, v, 0.0) > epsilon)
    assert abs(refuted[0] - first) <= 1


def gaussian_guesses(mu: float, canaries: int, guesses: int, rng: np.random.Generator) -> int:
    """Right guesses among the top-scored canaries of a μ-GDP mechanism (each canary observed
    through N(μ·[in], 1), the tight case of μ-GDP)."""
    included = rng.random(canaries) < 0.5
    scores = rng.normal(mu * included, 1.0)
    return count_correct(membership_guesses(scores, guesses, "upper"), included)[0]


@pytest.mark.parametrize("mu", [0.5, 2.0])
def test_gdp_lower_bound_stays_below_the_true_mu(mu):
    rng = np.random.default_rng(7)
    bounds = [gdp_mu_lower_bound(3000, 150, gaussian_guesses(mu, 3000, 150, rng), 0.95) for _ in range(20)]
    assert max(bounds) <= mu  # 95% per run; all 20 in practice
    assert np.mean(bounds) > 0.3 * mu  # and not vacuous


def test_gdp_refutation_is_monotone_and_needs_accuracy():
    assert not fdp_refutes(1000, 100, 50, gdp_blow_up_inverse(0.01), 0.05)  # chance accuracy refutes nothing
    assert fdp_refutes(1000, 100, 100, gdp_blow_up_inverse(1.0), 0.05)
    bounds = [gdp_mu_lower_bound(1000, 100, v, 0.95) for v in (60, 70, 80, 90, 100)]
    assert all(b2 > b1 for b1, b2 in zip(bounds, bounds[1:]))


def test_a_gross_mutation_is_refuted_at_small_scale(monkeypatch):
    """Noise × 0.3 through the real mechanism, 2000 block canaries, 40 steps: μ̂ passes the
    claim in GDP terms and the claimed profile is refuted (the correct mechanism: quick mode)."""
    monkeypatch.setitem(MUTATIONS, "noise_0.3", Mutation("broken: noise × 0.3", noise_scale=0.3))
    monkeypatch.setitem(BREAK_LABELS, "noise_0.3", "broken: noise × 0.3")
    gross = audit_mechanism(QUICK_BLOCKS, "noise_0.3")
    assert gross.detected and gross.fdp.mu > gross.fdp.mu_claim and gross.fdp.epsilon > gross.claimed_epsilon
    assert gross.fdp.epsilon > gross.bound.epsilon  # past the (ε, δ) bound's ceiling
    assert gross.bound.epsilon <= gross.ceiling


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

# The privatizer clips to C_W·(1 − 2⁻¹⁰) (a margin for fp32 rounding): "exactly C_W" up to that.
CLIPPED = 2e-3
TINY_DIRAC = replace(QUICK_FAST, canaries=4, ordinary=3, ordinary_rows=2, expected_lot_size=2, blocks=3)
TINY_GPT2 = replace(FULL_GPT2, canaries=6, ordinary=4, ordinary_rows=8, expected_lot_size=2)


def noise_free_release(world, setup, lot: list[int], breakage: str = "none", engine: str = "fast"):
    privatizer = build_mechanism(world, replace(setup, engine=engine), 0.0, breakage, SecretStream(0))
    with engine_mutation(breakage, engine):
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
        torch.testing.assert_close(canary_rows, expected, rtol=CLIPPED, atol=1e-9)  # the ordinary points stay in their rows
    projection, norm = world.canary_projections(claimed, TINY_DIRAC.expected_lot_size)
    np.testing.assert_allclose(projection, [0, 1, 0, 0], atol=CLIPPED)
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
    np.testing.assert_allclose(projection, [0, 0, 1, 0, 0, 0], atol=CLIPPED)
    threshold = claimed.blocks[claimed.block_index()[GPT2Canaries.embedding]].threshold
    np.testing.assert_allclose(norm, threshold, rtol=1e-6)  # every canary is clipped
    assert len(claimed) == len(list(world.model.parameters())) > 20  # a block per tensor


def test_the_audit_samples_with_the_training_loops_sampler(monkeypatch):
    calls = []

    def spy(kind, num_samples, expected_lot_size, stream):
        calls.append((kind, num_samples, expected_lot_size))
        return PoissonLotSampler(num_samples, expected_lot_size / num_samples, stream)

    monkeypatch.setattr(audit_module, "build_lot_sampler", spy)
    setup = replace(QUICK_OPACUS, steps=2)
    train_and_score(setup, draw_inclusion(setup.canaries, 0), 1.0, "none", Seeds.spawn(0))
    assert calls == [("poisson", setup.dataset_size, setup.expected_lot_size)]
    assert setup.sample_rate == setup.expected_lot_size / setup.dataset_size


# --- canaries in every block type ------------------------------------------------------------

TINY_BLOCKS = replace(QUICK_BLOCKS, canaries=6, ordinary=3, ordinary_rows=2, expected_lot_size=2)
BLOCK_PARAMS = ("embedding.weight", "hidden.weight", "norm.weight", "norm.bias", "rms_norm.weight", "lm_head.weight")


def canary_entries(world: BlockCanaries, canary: int) -> dict[str, float]:
    params = dict(world.model.named_parameters())
    return {name: float(params[name].grad.flatten()[world.canary_coordinates[name][canary]]) for name in BLOCK_PARAMS}


def test_block_canaries_live_in_every_block_type():
    world = BlockCanaries(TINY_BLOCKS, np.ones(6, dtype=bool), torch.Generator().manual_seed(0))
    kinds = {name: type(module).__name__ for name, module in world.model.named_children()}
    assert kinds == {"embedding": "Embedding", "hidden": "Linear", "norm": "LayerNorm", "rms_norm": "RMSNorm", "lm_head": "Linear"}
    claimed = world.partition(TINY_BLOCKS.clip_norm)
    assert [block.params for block in claimed.blocks] == [(name,) for name in BLOCK_PARAMS]  # a block each
    coordinates = np.stack([world.canary_coordinates[name].numpy() for name in BLOCK_PARAMS])
    assert all(len(set(row)) == 6 for row in coordinates)  # every canary its own coordinate in every block


def test_a_sampled_block_canary_adds_exactly_its_clip_norm_at_its_coordinate_of_every_block():
    """Canary 1 and two ordinary points, noise-free: canary 1's coordinates hold −C_W/L in every
    block (ordinary points never touch a canary's coordinates), every other canary's hold 0."""
    world = BlockCanaries(TINY_BLOCKS, np.ones(6, dtype=bool), torch.Generator().manual_seed(0))
    noise_free_release(world, TINY_BLOCKS, [1, 6, 7])
    claimed = world.partition(TINY_BLOCKS.clip_norm)
    threshold = claimed.blocks[0].threshold
    assert threshold == pytest.approx(TINY_BLOCKS.clip_norm / math.sqrt(6))
    assert canary_entries(world, 1) == pytest.approx(dict.fromkeys(BLOCK_PARAMS, -threshold / TINY_BLOCKS.expected_lot_size), rel=CLIPPED)
    assert all(canary_entries(world, j) == dict.fromkeys(BLOCK_PARAMS, 0.0) for j in (0, 2, 3, 4, 5))
    projection, norm = world.canary_projections(claimed, TINY_BLOCKS.expected_lot_size)
    np.testing.assert_allclose(projection, [0, 1, 0, 0, 0, 0], atol=CLIPPED)
    np.testing.assert_allclose(norm, claimed.sensitivity)
    np.testing.assert_allclose(world.canary_release()[1], -threshold / TINY_BLOCKS.expected_lot_size, rtol=CLIPPED)


def test_linear_norms_low_lets_the_canary_through_ten_times_in_the_linear_blocks_only():
    world = BlockCanaries(TINY_BLOCKS, np.ones(6, dtype=bool), torch.Generator().manual_seed(0))
    original = AffineLayer.squared_norms
    noise_free_release(world, TINY_BLOCKS, [2], breakage="linear_norms_low")
    assert AffineLayer.squared_norms is original  # the patch is undone
    unit = world.partition(TINY_BLOCKS.clip_norm).blocks[0].threshold / TINY_BLOCKS.expected_lot_size
    linear = {"hidden.weight", "lm_head.weight"}
    assert canary_entries(world, 2) == pytest.approx({n: -unit * (10 if n in linear else 1) for n in BLOCK_PARAMS}, rel=CLIPPED)


def test_lots_at_2q_sample_at_twice_the_rate_the_privatizer_and_accountant_are_told():
    world = BlockCanaries(TINY_BLOCKS, np.ones(6, dtype=bool), torch.Generator().manual_seed(0))
    sampler = build_sampler(world, TINY_BLOCKS, SecretStream(0), "lots_2q")
    assert sampler.sample_rate == pytest.approx(2 * TINY_BLOCKS.sample_rate)
    privatizer = build_mechanism(world, TINY_BLOCKS, 1.0, "lots_2q", SecretStream(0))
    assert privatizer.sample_rate == TINY_BLOCKS.sample_rate and privatizer.expected_lot_size == TINY_BLOCKS.expected_lot_size
    privatizer.close()


# --- the mutations -----------------------------------------------------------------------------


@pytest.mark.parametrize("breakage", BREAKS)
def test_every_mutation_tells_the_accountant_the_calibrated_sigma(breakage):
    sigma = 2.0
    world = BlockCanaries(TINY_BLOCKS, np.ones(6, dtype=bool), torch.Generator())
    claimed = world.partition(TINY_BLOCKS.clip_norm)
    privatizer = build_mechanism(world, TINY_BLOCKS, sigma, breakage, SecretStream(0))
    scale = {"tenth_noise": 0.1, "half_noise": 0.5, "noise_0.8": 0.8, "noise_0.9": 0.9}.get(breakage, 1.0)
    expected = [sigma * claimed.sensitivity * scale] * 6  # no_clip: still calibrated to the claimed C
    if breakage == "per_block_noise":
        expected = [sigma * block.threshold for block in claimed.blocks]  # σ·C_W = σΔ/√6
    assert privatizer.block_stds == pytest.approx(expected)
    assert all((t > TINY_BLOCKS.canary_norm) == (breakage == "no_clip") for t in privatizer.partition.thresholds)
    assert privatizer.noise_multiplier == sigma and privatizer.sample_rate == TINY_BLOCKS.sample_rate
    privatizer.close()


def test_true_epsilon_is_what_each_mutation_really_spends():
    setup = replace(TINY_BLOCKS, steps=50)
    world = BlockCanaries(setup, np.ones(6, dtype=bool), torch.Generator())
    claimed, sigma = world.partition(setup.clip_norm), 0.9
    q, delta = setup.sample_rate, setup.delta

    def spent(breakage: str) -> float:
        privatizer = build_mechanism(world, setup, sigma, breakage, SecretStream(0))
        privatizer.close()
        return audit_module.true_epsilon(MUTATIONS[breakage], world.model, claimed, privatizer.block_stds, setup)

    assert spent("none") == pytest.approx(epsilon_after(sigma, q, 50, delta))
    assert spent("noise_0.8") == pytest.approx(epsilon_after(0.8 * sigma, q, 50, delta))
    assert spent("lots_2q") == pytest.approx(epsilon_after(sigma, 2 * q, 50, delta))
    assert spent("per_block_noise") == pytest.approx(epsilon_after(sigma / math.sqrt(6), q, 50, delta))
    # two of six blocks (hidden, head) let 10·C_W through: Δ² = (4 + 200)·C_W² instead of 6·C_W²
    assert spent("linear_norms_low") == pytest.approx(epsilon_after(sigma * math.sqrt(6 / 204), q, 50, delta))
    assert spent("no_clip") == math.inf
    assert spent("tenth_noise") == math.inf  # σ/10 = 0.1·σ < TINY_SIGMA: ε in the hundreds at least, not computed


def test_per_block_noise_follows_unequal_thresholds():
    world = GPT2Canaries(TINY_GPT2, np.ones(6, dtype=bool), torch.Generator().manual_seed(0))
    claimed = world.partition(TINY_GPT2.clip_norm)
    assert len(set(claimed.thresholds)) > 1
    privatizer = build_mechanism(world, TINY_GPT2, 2.0, "per_block_noise", SecretStream(0))
    assert privatizer.block_stds == pytest.approx([2.0 * t for t in claimed.thresholds])
    privatizer.close()


def test_the_noise_check_measures_the_released_noise_std():
    """Through the real release (grid and all): the correct mechanism's noise on undrawn canary
    coordinates is what the accountant was told; noise × 0.9 is flagged with its ratio."""
    setup = replace(QUICK_BLOCKS, steps=8)
    correct, low = (audit_mechanism(setup, b) for b in ("none", "noise_0.9"))
    assert correct.noise_std_ratio == pytest.approx(1.0, abs=0.01) and not correct.noise_flagged
    assert low.noise_std_ratio == pytest.approx(0.9, abs=0.01) and low.noise_flagged
    assert not correct.sampler_flagged and expected_verdict(correct) and expected_verdict(low)


# --- independence across steps ----------------------------------------------------------------


def fresh_noise(steps: int, values: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Independent N(0, 1) noise per step, each coordinate pure noise w.p. 0.99 (else a lot member's)."""
    return rng.standard_normal((steps, values)), rng.random((steps, values)) < 0.99


def test_the_noise_reuse_check_has_its_size_and_is_blind_to_the_noise_scale():
    """Exact Student-t per pair, Bonferroni over pairs: fresh noise is flagged at most at the level
    (p < 0.05 in ≤ 5% of runs, and not vacuously so), whatever its std — the std is the other check's business."""
    rng = np.random.default_rng(0)
    p_values = np.array([noise_reuse_p_value(*fresh_noise(10, 500, rng)) for _ in range(300)])
    assert 0.01 < np.mean(p_values < 0.05) < 0.08
    values, undrawn = fresh_noise(10, 500, rng)
    assert noise_reuse_p_value(0.8 * values, undrawn) == pytest.approx(noise_reuse_p_value(values, undrawn))


@pytest.mark.parametrize("reuse", ["same", "negated", "half-mixed"])
def test_the_noise_reuse_check_flags_one_draw_shared_by_two_steps(reuse):
    values, undrawn = fresh_noise(40, 2000, np.random.default_rng(1))
    earlier = values[3]
    values[17] = {"same": earlier, "negated": -earlier, "half-mixed": (earlier + values[17]) / math.sqrt(2)}[reuse]
    assert noise_reuse_p_value(values, undrawn) < 1e-20


def test_the_lot_reuse_check_flags_exactly_the_overlaps_poisson_sampling_does_not_explain():
    """Deterministic, not by chance: with the other lots disjoint, a lot repeated once is flagged
    if and only if it has k* members, k* fixed by N, q and the steps before the run."""
    size, rate, steps = 2500, 0.01, 40
    pairs = steps * (steps - 1) // 2
    threshold = next(k for k in range(1, 50) if pairs * stats.binom.sf(k - 1, size, rate**2) < 1e-3)
    assert threshold == 6  # quick mode's block scenario: a Poisson(25) lot is smaller w.p. ~1e-6
    for members in (threshold - 1, threshold, 25):
        lots = [list(range(60 * t, 60 * t + members)) for t in range(steps)]
        lots[9] = lots[2]
        assert (lot_reuse_p_value(lots, size, rate) < 1e-3) == (members >= threshold)
    rng = np.random.default_rng(2)
    poisson = [[lot.tolist() for lot in (np.flatnonzero(rng.random(size) < rate) for _ in range(steps))] for _ in range(50)]
    assert min(lot_reuse_p_value(lots, size, rate) for lots in poisson) > 1e-3


REUSE_SETUP = replace(QUICK_BLOCKS, steps=8)  # quick mode's block scenario, 8 of its 40 steps: ~2 s a run


@pytest.fixture(scope="module")
def reuse_results():
    torch.set_num_threads(1)
    return {b: audit_mechanism(REUSE_SETUP, b) for b in ("none", "noise_reused", "lot_reused", "noise_0.8")}


@pytest.mark.parametrize("breakage", ["noise_reused", "lot_reused", "noise_0.8"])
def test_reused_noise_reused_lots_and_noise_0_8_are_each_flagged_by_their_check(reuse_results, breakage):
    """One noise draw every step (ε = ∞) and one lot every step pass the one-run audit and the
    per-step checks (the lot-rate check sees a repeated lot only if its size is far from L); the
    independence checks catch them in 8 steps."""
    result, check = reuse_results[breakage], ONE_RUN_BLIND[breakage]
    assert result.flags[check] and expected_verdict(result)
    assert not result.detected
    assert result.true_epsilon > 1.9 * result.claimed_epsilon  # noise × 0.8: 3.96 against 1.99
    if breakage == "noise_reused":
        assert math.isinf(result.true_epsilon) and not result.noise_flagged  # each release alone looks right
    if breakage == "lot_reused":
        assert not (result.sampler_flagged or result.noise_reuse_flagged)


def test_the_correct_mechanism_passes_the_independence_checks(reuse_results):
    result = reuse_results["none"]
    assert not any(result.flags.values()) and expected_verdict(result)
    assert result.noise_reuse_p_value > 1e-3 and result.lot_reuse_p_value > 1e-3


def test_the_reuse_mutations_restore_the_stream_and_the_sampler_every_step(monkeypatch):
    """The mutation is the mechanism's own secret streams rewound before each step: the lots (and
    the released noise) repeat exactly."""
    lots = []
    original = PoissonLotSampler.next_lot

    def spy(self):
        lots.append(original(self))
        return lots[-1]

    monkeypatch.setattr(PoissonLotSampler, "next_lot", spy)
    setup = replace(QUICK_BLOCKS, steps=3)
    train_and_score(setup, draw_inclusion(setup.canaries, 0), 1.0, "lot_reused", Seeds.spawn(0))
    assert lots[0] == lots[1] == lots[2] and len(lots[0]) > 10


def test_quick_mode_runs_noise_0_8_and_the_reuse_mutations():
    """`make audit-quick MUTATION=noise_0.8` (and the reuse mutations) select a quick scenario."""
    for breakage in ("noise_0.8", "noise_reused", "lot_reused"):
        (setup,) = selected_setups(parse_args(["--mode", "quick", "--mutation", breakage]))
        assert setup is not None and breakage in setup.breaks
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "--mode quick $(if $(MUTATION),--mutation $(MUTATION))" in makefile


# --- the designs and the verdicts in quick mode ----------------------------------------------


@pytest.mark.parametrize("setup", MODES["quick"] + MODES["full"] + MODES["mutations"], ids=lambda s: f"{s.name}-{s.seed}")
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
    assert result.fdp.mu < 0.5 * result.fdp.mu_claim and result.fdp.epsilon < 1.0 and result.fdp.claim_p_value > 0.5
    assert not (result.detected or result.noise_flagged or result.sampler_flagged)


@pytest.mark.parametrize("setup, breakage", [(s, b) for s in MODES["quick"] for b in s.breaks if b != "none"], ids=lambda x: getattr(x, "name", x))
def test_quick_mode_catches_every_mutation(quick_results, setup, breakage):
    result = quick_results[setup.name, BREAK_LABELS[breakage]]
    # The mutation is invisible to the accountant: it claims what the calibrated σ buys.
    assert result.claimed_epsilon == pytest.approx(epsilon_after(result.noise_multiplier, setup.sample_rate, setup.steps, setup.delta))
    assert expected_verdict(result)
    if breakage == "lots_2q":  # a one-run blind spot: the sampler check's
        assert result.sampler_flagged and not result.noise_flagged
    elif breakage in ONE_RUN_BLIND:
        assert result.flags[ONE_RUN_BLIND[breakage]]
    else:
        assert result.detected and result.fdp.mu > 0.5


def test_quick_mode_audits_the_moderate_breaks():
    """Noise ÷ 2 and per-block noise (÷ √3 with 3 blocks) are what the design is sized for."""
    assert {"half_noise", "per_block_noise"} <= set(QUICK_FAST.breaks) and QUICK_FAST.blocks == 3


def test_quick_mode_audits_every_block_type_with_the_linear_norm_mutation():
    assert QUICK_BLOCKS.model == "blocks"
    assert {"linear_norms_low", "per_block_noise", "lots_2q", "noise_0.8", "noise_reused", "lot_reused"} <= set(QUICK_BLOCKS.breaks)
    assert set(MODES["mutations"][0].breaks) == set(BREAKS) - {"tenth_noise", "half_noise"}


def test_script_writes_json_and_markdown(tmp_path):
    out, table = tmp_path / "audit.json", tmp_path / "table.md"
    assert audit_main(["--scenario", "dirac-opacus", "--break", "no_clip", "--json", str(out), "--markdown", str(table)]) == 0
    report = json.loads(out.read_text())
    (result,) = report["scenarios"][0]["results"]
    assert result["mechanism"] == "broken: clipping off" and result["detected"]
    assert result["bound"]["epsilon"] > result["claimed_epsilon"]
    assert "--break no_clip" in report["command"]
    assert "| dirac-opacus | 0 | broken: clipping off |" in table.read_text()
    rerendered = tmp_path / "again.md"
    assert audit_main(["--from-json", str(out), "--markdown", str(rerendered)]) == 0
    assert rerendered.read_text() == table.read_text()


def test_from_json_refuses_a_summary_of_another_version_in_one_line(tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"method": "m", "command": "c", "wall_seconds": 1.0, "scenarios": [{"description": "d", "results": [{}]}]}))
    assert audit_main(["--from-json", str(old), "--markdown", str(tmp_path / "t.md")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: --from-json {old}: not a readable audit summary") and "KeyError" in line
    assert not (tmp_path / "t.md").exists()


def test_the_module_runs_as_a_command():
    done = subprocess.run([sys.executable, "-m", "dpmuon.audit.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--mutation" in done.stdout and "noise_0.8" in done.stdout


COMMITTED = REPO_ROOT / "results" / "audit"


@pytest.mark.skipif(not (COMMITTED / "mutations.json").exists(), reason="no committed mutation table")
def test_the_committed_mutation_table_regenerates_from_its_json(tmp_path):
    table = tmp_path / "mutations.md"
    assert audit_main(["--from-json", str(COMMITTED / "mutations.json"), "--markdown", str(table)]) == 0
    assert table.read_text() == (COMMITTED / "mutations.md").read_text()
    results = [r for scenario in json.loads((COMMITTED / "mutations.json").read_text())["scenarios"] for r in scenario["results"]]
    assert {r["mutation"] for r in results} == set(MODES["mutations"][0].breaks)


@pytest.mark.slow
def test_gpt2_scenario_passes_the_correct_mechanism_and_catches_gross_breaks():
    results = run_audits(replace(FULL_GPT2, steps=40))
    verdicts = {r.mechanism: r.detected for r in results}
    assert verdicts == {BREAK_LABELS["none"]: False, BREAK_LABELS["tenth_noise"]: True, BREAK_LABELS["no_clip"]: True}
