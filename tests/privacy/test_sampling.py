"""Poisson lot sampling: independent inclusion with rate q; resumable; shuffle is flagged."""

from __future__ import annotations

import math

import pytest
import torch

from dpmuon.privacy import PoissonLotSampler, SecretStream, build_lot_sampler


def test_poisson_lot_sizes_are_binomial_and_inclusion_is_uniform():
    n, q, steps = 400, 0.05, 2000
    sampler = PoissonLotSampler(n, q, SecretStream(0))
    sizes, counts = [], torch.zeros(n)
    for _ in range(steps):
        lot = sampler.next_lot()
        assert len(set(lot)) == len(lot)
        sizes.append(len(lot))
        counts[lot] += 1
    sizes = torch.tensor(sizes, dtype=torch.float64)
    mean, var = n * q, n * q * (1 - q)
    assert float(sizes.mean()) == pytest.approx(mean, abs=5 * math.sqrt(var / steps))
    assert float(sizes.var()) == pytest.approx(var, rel=0.15)  # a fixed-size sampler has variance 0
    # Every example is included at rate q (no example favoured).
    rates = counts / steps
    assert float((rates - q).abs().max()) < 6 * math.sqrt(q * (1 - q) / steps)


def test_poisson_inclusions_are_independent_across_examples():
    n, q, steps = 50, 0.3, 4000
    sampler = PoissonLotSampler(n, q, SecretStream(1))
    both = 0
    for _ in range(steps):
        lot = set(sampler.next_lot())
        both += (0 in lot) and (1 in lot)
    assert both / steps == pytest.approx(q * q, abs=5 * math.sqrt(q * q / steps))


def test_empty_lots_occur_and_are_returned():
    sampler = PoissonLotSampler(10, 0.05, SecretStream(2))
    assert any(len(sampler.next_lot()) == 0 for _ in range(100))


def test_sampler_resumes_from_its_state():
    """The key is the secret (saved with the mechanism's randomness); the sampler's own state is
    only its position, and with the same key the next lots replay from it."""
    a = PoissonLotSampler(1000, 0.01, SecretStream(3))
    for _ in range(5):
        a.next_lot()
    state = a.state_dict()
    expected = [a.next_lot() for _ in range(3)]
    b = PoissonLotSampler(1000, 0.01, SecretStream(3))
    b.load_state_dict(state)
    assert [b.next_lot() for _ in range(3)] == expected
    other_key = PoissonLotSampler(1000, 0.01, SecretStream(99))
    other_key.load_state_dict(state)
    assert [other_key.next_lot() for _ in range(3)] != expected


def test_shuffle_sampling_is_fixed_size_and_warns():
    with pytest.warns(UserWarning, match="not a valid guarantee"):
        sampler = build_lot_sampler("shuffle", 10, 4, SecretStream(0))
    assert [len(sampler.next_lot()) for _ in range(5)] == [4] * 5
