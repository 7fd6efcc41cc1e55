"""The release is private as computed in floats: every released coordinate is a whole number of
grid steps, that number is exactly round(S/γ + s·z) for the float64 clipped sum S and the
stream's own draw z, and so no output of a lot with a target is impossible without it (the
one-release membership test of issue 23 finds nothing)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from conftest import VOCAB, tiny_gpt2, token_batch

from dpmuon.models import hidden_matrices, per_example_lm_loss
from dpmuon.privacy import GaussianNoise, PrivacyAccountant, Privatizer, SecretStream, build_partition
from dpmuon.privacy.accountant import BAD_EVENT_SHARES, ReleaseSlack, calibrate_noise_multiplier, epsilon_after
from dpmuon.privacy.grid import BAND_EDGES, GRID_NOISE_STD, cell_eta, grid_step, release_on_grid, release_slack

SIGMA, LOT = 1.0, 8


@pytest.mark.parametrize("std", [1e-6, 0.01, 0.3, 1.0, 7.5, 1e4])
def test_grid_step_is_a_power_of_two_a_tenth_of_the_noise(std):
    gamma = grid_step(std)
    assert math.frexp(gamma)[0] == 0.5  # a power of two: scaling by it is exact
    assert GRID_NOISE_STD[0] <= std / gamma < GRID_NOISE_STD[1]


def test_grid_release_is_exactly_the_rounded_gaussian_of_the_float64_sum():
    rng = np.random.default_rng(0)
    total = torch.from_numpy(rng.normal(size=2000) * 3.7 + rng.normal(size=2000) * 1e-9)
    z = torch.from_numpy(rng.standard_normal(2000))
    std = 0.37
    got = release_on_grid(total.clone(), std, z.clone())
    gamma = Fraction(grid_step(std))
    for i in range(0, 2000, 37):  # exact rational arithmetic: round(S/γ + (std/γ)·z), then ·γ
        value = Fraction(float(total[i])) / gamma + Fraction(std) / gamma * Fraction(float(z[i]))
        m = math.floor(value + Fraction(1, 2))
        if value + Fraction(1, 2) == m:  # a tie; float64 rounds ties to even
            m -= m % 2
        assert Fraction(float(got[i])) == m * gamma, i


def test_a_numpy_release_is_the_tensor_release_bit_for_bit():
    """The CPU release noises its chunks in numpy, an accelerator in torch: the same bits, ties
    (to even), signed zeros, sums near the grid's edge of exactness and non-finite sums included."""
    std = 1.0  # γ = 1/8, s = 8: z = h/16 puts f + s·z on exact half steps
    gamma = grid_step(std)
    rng = np.random.default_rng(3)
    ties = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5]) / 8
    total = np.concatenate([rng.normal(size=500) * 3.7, np.zeros(6), [-0.0, 0.0, 1e-300, -1e-300, 2.0**51 * gamma, -(2.0**51) * gamma, np.inf, np.nan]])
    z = np.concatenate([rng.standard_normal(500), ties, [0.0, -0.0, 0.0, 0.0, 0.25, -0.25, 0.0, 0.0]])
    by_numpy = release_on_grid(total.copy(), std, z.copy())
    by_torch = release_on_grid(torch.from_numpy(total.copy()), std, torch.from_numpy(z.copy())).numpy()
    assert by_numpy.tobytes() == by_torch.tobytes()
    assert list(by_numpy[500:506] / gamma) == [0.0, 2.0, 2.0, -0.0, -2.0, -2.0]  # the ties went to even
    # A float32 draw is widened first, as the tensor path widens it: never noised in float32.
    assert (
        release_on_grid(total.copy(), std, z.astype(np.float32)).tobytes()
        == release_on_grid(torch.from_numpy(total.copy()), std, torch.from_numpy(z.astype(np.float32))).numpy().tobytes()
    )
    with pytest.raises(OverflowError, match="too large"):
        release_on_grid(np.array([2.0**52 * gamma]), std, np.zeros(1))


def make_privatizer(tie: bool, secure: bool, seed: int = 0) -> Privatizer:
    model = tiny_gpt2(tie=tie, seed=1)
    names = [n for n, _ in model.named_parameters()]
    partition = build_partition(names, clip_norm=0.1, matrix_names=hidden_matrices(model))
    noise = GaussianNoise(secure=True) if secure else GaussianNoise(SecretStream(seed))
    return Privatizer(model, partition, SIGMA, LOT, 0.01, PrivacyAccountant(1e-5), noise=noise)


def decoded_steps(privatizer: Privatizer) -> dict[str, torch.Tensor]:
    """Each released coordinate as the number of grid steps it must be: m = g̃·B/γ, rounded."""
    steps = {}
    for name, std in privatizer.release_noise_std().items():
        gamma = grid_step(std * LOT)
        grad = privatizer.params[name].grad.double()
        steps[name] = torch.round(grad * LOT / gamma)
        # The adversary's check: is this output producible at all? Only whole grid steps are.
        producible = (steps[name] * gamma / LOT).float()
        if not torch.equal(producible, privatizer.params[name].grad):
            return {}
    return steps


@pytest.mark.parametrize("secure", [False, True], ids=["default", "secure"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_one_release_membership_test_detects_nothing(tie, secure):
    """The target is the only example using some tokens (and the longest: it alone reaches the
    last position rows). With float noise, some of its releases cannot be produced without it;
    on the grid every whole number of steps can come from either lot: 0 of 20 releases flag."""
    half = VOCAB // 2
    others, target = token_batch(LOT - 1, length=12, seed=3), token_batch(1, length=16, seed=4)
    for batch, offset in ((others, 0), (target, half)):  # the target alone uses the upper half
        for key in ("input_ids", "labels"):
            ids = batch[key]
            ids[ids >= 0] = ids[ids >= 0] % half + offset
    lot = [others, target]
    flagged = 0
    for trial in range(20):
        privatizer = make_privatizer(tie, secure, seed=trial)
        privatizer.release([dict(b) for b in lot], per_example_lm_loss)
        flagged += not decoded_steps(privatizer)
    assert flagged == 0


def test_released_steps_are_the_clipped_sum_plus_the_streams_own_noise():
    """Replaying the noise stream, the test recomputes m = k + round(f + s·z) from the float64
    clipped sum: the privatizer adds exactly that noise, no more and no less."""
    privatizer = make_privatizer(tie=False, secure=False, seed=5)
    batch = token_batch(LOT, seed=6)
    summed, _, _ = privatizer._engine.clipped_sum(batch, per_example_lm_loss)
    privatizer.release([batch], per_example_lm_loss)
    replay = GaussianNoise(SecretStream(5))
    standardized = []
    for name, param in privatizer.params.items():
        std = privatizer.release_noise_std()[name] * LOT
        z = torch.from_numpy(replay.standard_normal(param.numel())).view(param.shape)
        expected = release_on_grid(summed[name].double(), std, z).div_(LOT).float()
        assert torch.equal(param.grad, expected), name
        standardized.append(((param.grad.double() * LOT - summed[name].double()) / std).flatten())
    noise = torch.cat(standardized)  # N(0, 1) plus the grid's rounding (variance 1/(12 s²) ≤ 1/768)
    assert float(noise.mean()) == pytest.approx(0.0, abs=0.02) and float(noise.std()) == pytest.approx(1.0, abs=0.02)


def test_float_slack_is_charged_in_epsilon_and_the_tail_in_delta():
    coordinates = 124_000_000  # GPT-2 small
    slack = release_slack(coordinates)
    assert 2 * coordinates * cell_eta(BAND_EDGES[0]) < slack.epsilon < 4.1e-5  # the body's, and 1% for the tail bands
    assert 0 < slack.bad_event < 1e-20
    ideal = epsilon_after(1.0, 0.02, 400, 1e-5)
    charged = epsilon_after(1.0, 0.02, 400, 1e-5, "prv", slack)
    # ε grows by T·slack.epsilon, and a little more for the δ set aside for bad events.
    assert charged - ideal >= 400 * slack.epsilon
    assert charged - ideal < 400 * slack.epsilon + 0.01
    sigma = calibrate_noise_multiplier(8.0, 1e-5, 0.02, 400, "prv", slack)
    assert epsilon_after(sigma, 0.02, 400, 1e-5, "prv", slack) <= 8.0


def test_bad_events_beyond_the_delta_share_give_no_finite_epsilon():
    assert epsilon_after(1.0, 0.02, 100, 1e-5, "prv", ReleaseSlack(bad_event=1e-6)) == math.inf
    # At ε = 1000 the (1 + e^ε) factor must not overflow: it is handled in log space.
    assert epsilon_after(0.05, 0.5, 10, 1e-5, "rdp", ReleaseSlack(bad_event=1e-30)) == math.inf


def test_runs_composed_past_the_planned_bad_event_share_take_a_larger_share_not_infinity():
    # Two constant-time runs of 24 releases planned for ε = 8 each (results/smollm2_lora): together
    # their truncation charge (1 + e^ε)·48·p outgrows the 1e-3·δ a run is planned in.
    sigma, q, delta, slack = 0.3337097, 0.0015236644, 8e-6, ReleaseSlack(epsilon=9.1e-7, bad_event=3.23e-14)
    assert epsilon_after(sigma, q, 24, delta, "prv", slack) <= 8.0
    ideal_planned = epsilon_after(sigma, q, 48, (1 - BAD_EVENT_SHARES[0]) * delta)
    assert (1 + math.exp(ideal_planned)) * 48 * slack.bad_event > BAD_EVENT_SHARES[0] * delta  # the first share does not fit
    composed = epsilon_after(sigma, q, 48, delta, "prv", slack)
    share = BAD_EVENT_SHARES[1]
    ideal = epsilon_after(sigma, q, 48, (1 - share) * delta * math.exp(-48 * slack.epsilon / 2))
    assert composed == pytest.approx(ideal + 48 * slack.epsilon)
    assert (1 + math.exp(composed)) * 48 * slack.bad_event <= share * delta  # the δ split it reports holds
    assert ideal_planned < composed < 9.0
