"""The release's noise: per-block std as configured, effective multiplier σ, empty lots."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import tiny_gpt2, token_batch

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


# -- the next release's noise drawn ahead (GaussianNoise(ahead=True), used on accelerators) --------

AHEAD_SIZES = (70_000, 5, 140_001)  # one draw over two chunks, a small one, one over three


def releases(noise: GaussianNoise, steps: int, sizes=AHEAD_SIZES) -> list[torch.Tensor]:
    """`steps` releases of one draw per size, as the privatizer makes them (draw_ahead after each)."""
    out = []
    for step in range(steps):
        for i, n in enumerate(sizes):
            total = torch.linspace(-3.0, 3.0, n, dtype=torch.float64) * (step + i + 1)
            out.append(noise.grid_release(total, std=0.37))
        noise.draw_ahead(sizes)
    noise.close()
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_noise_drawn_ahead_is_the_draw_made_in_turn_bit_for_bit(threads):
    in_turn = releases(GaussianNoise(SecretStream(7), threads=threads), steps=3)
    ahead = GaussianNoise(SecretStream(7), threads=threads, ahead=True)
    assert all(torch.equal(a, b) for a, b in zip(in_turn, releases(ahead, steps=3), strict=True))
    assert ahead.stream.draws == 3 * len(AHEAD_SIZES)  # each draw made once, in its place


def test_noise_drawn_ahead_is_not_used_after_a_reseed_a_restore_or_for_another_size():
    noise = GaussianNoise(SecretStream(7), threads=1, ahead=True)
    reference = GaussianNoise(SecretStream(7), threads=1)
    releases(noise, steps=1)  # the next release's draws are made ahead (then closed: made again below)
    noise.draw_ahead(AHEAD_SIZES)
    reference.stream.draws = noise.stream.draws
    # Another size at the same position: drawn in turn, as the reference draws it.
    total = torch.ones(11, dtype=torch.float64)
    assert torch.equal(noise.grid_release(total.clone(), 0.37), reference.grid_release(total.clone(), 0.37))
    # A reseed between drawing ahead and using the draws: the new key's draws, never the old key's.
    noise.draw_ahead(AHEAD_SIZES)
    noise.stream.key = reference.stream.key = 12345
    total = torch.zeros(AHEAD_SIZES[0], dtype=torch.float64)
    assert torch.equal(noise.grid_release(total.clone(), 0.37), reference.grid_release(total.clone(), 0.37))
    # A restored (earlier) position: the draw of that position, not the one made ahead for later.
    noise.draw_ahead(AHEAD_SIZES)
    noise.stream.load_state_dict({"key": f"{12345:032x}", "draws": 0})
    reference.stream.load_state_dict({"key": f"{12345:032x}", "draws": 0})
    assert torch.equal(noise.grid_release(total.clone(), 0.37), reference.grid_release(total.clone(), 0.37))
    # A position restored to a draw made ahead and already used (consumed in place): drawn again in turn.
    noise.draw_ahead(AHEAD_SIZES)
    position = {"key": f"{12345:032x}", "draws": noise.stream.draws}
    first = noise.grid_release(total.clone(), 0.37)
    noise.stream.load_state_dict(position)
    reference.stream.load_state_dict(position)
    expected = reference.grid_release(total.clone(), 0.37)
    assert torch.equal(first, expected) and torch.equal(noise.grid_release(total.clone(), 0.37), expected)
    noise.close()


def test_a_privatizer_whose_noise_is_drawn_ahead_releases_what_one_drawing_in_turn_releases():
    grads = []
    for ahead in (False, True):
        pz = make_privatizer("uniform")
        pz.noise = GaussianNoise(SecretStream(3), ahead=ahead)
        batch = token_batch(4)
        steps = []
        for _ in range(3):
            pz.release([batch], per_example_lm_loss)
            steps.append({n: p.grad.clone() for n, p in pz.params.items()})
        assert (pz.noise._next is not None) == ahead  # the next release's draws are under way
        pz.close()
        grads.append(steps)
    assert all(torch.equal(a[n], b[n]) for a, b in zip(*grads, strict=True) for n in a)


# --- the sharded release: each rank draws the noise of its own coordinates -------------------------


def test_a_slice_of_a_draw_is_that_slice_of_the_whole_draw_bit_for_bit():
    """Slices within a chunk, across one or two chunk edges, at the ends, empty: the values the
    whole draw gives those coordinates (a chunk's values depend on the earlier ones in it)."""
    from dpmuon.privacy.randomness import CHUNK

    size = 3 * CHUNK + 123
    sources = SecretStream(7).normal_sources_at(4, 4)  # draw 4, as the whole release draws it: chunk by chunk
    whole = np.concatenate([sources[c](min(CHUNK, size - c * CHUNK)) for c in range(4)])
    stream = SecretStream(7)
    for start, stop in [(0, size), (5, 17), (CHUNK - 3, CHUNK + 9), (CHUNK // 2, 2 * CHUNK + 7), (3 * CHUNK, size), (size - 1, size), (10, 10)]:
        assert (stream.normal_slice_at(4, size, start, stop) == whole[start:stop]).all(), (start, stop)
    assert stream.draws == 0  # reading a draw moves no position
    with pytest.raises(ValueError, match="slice"):
        stream.normal_slice_at(4, size, 10, size + 1)


@pytest.mark.parametrize("shards", [2, 3])
def test_shards_released_on_their_own_ranks_equal_the_whole_release_bit_for_bit(shards):
    """FSDP shards a matrix by rows: each rank holds a contiguous range of the flattened sum.
    Released shard by shard (each from a stream at the same position), the pieces are the whole
    release's, and each stream advances one draw, as the whole release's does."""
    from dpmuon.privacy.randomness import CHUNK

    total = torch.randn(2 * CHUNK // 64 + 5, 64 * 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 0.1
    whole_noise = GaussianNoise(SecretStream(11), threads=2)
    whole_noise.grid_release(torch.zeros(3, dtype=torch.float64), 0.5)  # an earlier release: not at the stream's start
    whole = whole_noise.grid_release(total.clone(), 0.03)
    rows = torch.tensor_split(torch.arange(total.shape[0]), shards)
    for held in rows:
        rank_noise = GaussianNoise(SecretStream(11), threads=1)
        rank_noise.stream.draws = 1
        piece = total[held].clone()
        released = rank_noise.grid_release_slice(piece, 0.03, total.numel(), int(held[0]) * total.shape[1])
        assert torch.equal(released, whole[held]) and rank_noise.stream.draws == 2
    assert not torch.equal(whole, total)  # the noise was added
