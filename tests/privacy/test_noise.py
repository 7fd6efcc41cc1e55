"""The release's noise: per-block std as configured, effective multiplier σ, empty lots."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_gpt2

from dpmuon.models import hidden_matrices, per_example_lm_loss
from dpmuon.privacy import GaussianNoise, PrivacyAccountant, Privatizer, SecretStream, block_noise_stds, build_partition

SIGMA = 1.3
LOT = 64


def make_privatizer(allocation: str, rule: str = "by_size", seed: int = 0):
    model = tiny_gpt2(tie=False)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    # Equal thresholds make both allocations identical; by_size gives every block its own C_W.
    partition = build_partition(list(sizes), clip_norm=0.2, threshold_rule=rule, matrix_names=hidden_matrices(model), sizes=sizes)
    return Privatizer(
        model,
        partition,
        noise_multiplier=SIGMA,
        expected_lot_size=LOT,
        sample_rate=0.01,
        accountant=PrivacyAccountant(1e-5),
        noise=GaussianNoise(SecretStream(seed)),
        noise_allocation=allocation,
    )


@pytest.mark.parametrize("allocation", ["uniform", "proportional"])
def test_empty_lot_release_has_configured_per_block_noise(allocation):
    """An empty lot releases pure noise: its per-block std must be the allocation's std / B."""
    pz = make_privatizer(allocation)
    expected = block_noise_stds(pz.partition, SIGMA, allocation)
    draws = {b.name: [] for b in pz.partition.blocks}
    for _ in range(20):
        stats = pz.release([], per_example_lm_loss)
        assert stats.lot_size == 0
        for block in pz.partition.blocks:
            draws[block.name].append(torch.cat([pz.params[n].grad.flatten() for n in block.params]))
    for block, std in zip(pz.partition.blocks, expected):
        values = torch.cat(draws[block.name]) * LOT
        assert abs(float(values.mean())) < 5 * std / math.sqrt(values.numel())
        assert float(values.std()) == pytest.approx(std, rel=max(0.05, 6 / math.sqrt(values.numel())))
    assert pz.accountant.steps == 20  # noise-only steps are still accounted


def effective_noise_multiplier(partition, stds: list[float]) -> float:
    """σ_eff = 1 / sqrt(Σ_W C_W² / std_W²): the multiplier of the whitened joint mechanism (the
    one the accountant charges), which every allocation of the noise over blocks must keep."""
    return 1.0 / math.sqrt(sum((b.threshold / s) ** 2 for b, s in zip(partition.blocks, stds)))


def test_allocations_differ_but_share_the_effective_multiplier():
    uniform = make_privatizer("uniform")
    proportional = make_privatizer("proportional")
    assert len(set(round(s, 12) for s in proportional.block_stds)) > 1
    assert len(set(round(s, 12) for s in uniform.block_stds)) == 1
    assert uniform.block_stds[0] == pytest.approx(SIGMA * uniform.partition.sensitivity)
    for pz in (uniform, proportional):
        assert effective_noise_multiplier(pz.partition, pz.block_stds) == pytest.approx(SIGMA)


def test_effective_multiplier_detects_per_block_calibration():
    """Calibrating each block as if it were its own mechanism (std σ·C_W) is weaker than σ."""
    partition = build_partition(["a", "b", "c", "d"], clip_norm=1.0, threshold_rule="split")
    per_block = [SIGMA * b.threshold for b in partition.blocks]
    assert effective_noise_multiplier(partition, per_block) == pytest.approx(SIGMA / 2)


@pytest.mark.parametrize("rule", ["split", "scalar"])
def test_equal_thresholds_make_the_allocations_coincide(rule):
    assert make_privatizer("uniform", rule).block_stds == pytest.approx(make_privatizer("proportional", rule).block_stds)


def test_release_noise_std_is_public_per_entry_std():
    pz = make_privatizer("uniform")
    stds = pz.release_noise_std()
    assert set(stds) == set(pz.params)
    assert all(s == pytest.approx(SIGMA * pz.partition.sensitivity / LOT) for s in stds.values())


def test_secure_noise_is_standard_normal_and_not_replayable():
    noise = GaussianNoise(secure=True)
    a = torch.from_numpy(noise.standard_normal(200_000))
    b = torch.from_numpy(noise.standard_normal(200_000))
    assert a.dtype == torch.float64
    assert abs(float(a.mean())) < 0.01 and float(a.std()) == pytest.approx(1.0, abs=0.01)
    # Fourth moment of a Gaussian is 3: catches uniform or otherwise non-normal draws.
    assert float(a.pow(4).mean()) == pytest.approx(3.0, abs=0.1)
    assert not torch.equal(a, b)
