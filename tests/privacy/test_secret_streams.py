"""The mechanism's secret has 128 bits in every stream: no part of a key can be searched alone,
draws depend on the key and their position only (so a resume replays them), and secure-mode
noise reaches past the tail the release's analysis covers."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from dpmuon.privacy import GaussianNoise, MechanismRandomness, PoissonLotSampler, SecretStream
from dpmuon.privacy import randomness as randomness_module
from dpmuon.privacy.grid import Z_MAX
from dpmuon.privacy.randomness import CHUNK, secure_standard_normal


def draws(randomness: MechanismRandomness, steps: int = 3) -> tuple[list[list[int]], np.ndarray]:
    sampler = PoissonLotSampler(2000, 0.05, randomness.sampler)
    lots = [sampler.next_lot() for _ in range(steps)]
    return lots, GaussianNoise(randomness.noise).standard_normal(64)


def test_secrets_equal_in_their_low_64_bits_draw_different_lots_and_noise():
    low = 0x0123456789ABCDEF
    lots_a, noise_a = draws(MechanismRandomness(low))
    lots_b, noise_b = draws(MechanismRandomness(low + (5 << 64)))
    assert lots_a != lots_b
    assert not np.array_equal(noise_a, noise_b)


@pytest.mark.parametrize("bit", [32, 64, 100, 127])
def test_every_bit_of_a_stream_key_changes_its_draws(bit):
    """A torch CPU generator keeps 32 bits of its seed; a stream key keeps all 128."""
    key = 0xDEADBEEF
    a, b = SecretStream(key), SecretStream(key ^ (1 << bit))
    lots = [PoissonLotSampler(2000, 0.05, s).next_lot() for s in (a, b)]
    assert lots[0] != lots[1]
    noise = [GaussianNoise(SecretStream(k)).standard_normal(16) for k in (key, key ^ (1 << bit))]
    assert not np.array_equal(*noise)


def test_keys_are_128_bits_and_saved_in_full():
    randomness = MechanismRandomness(None)
    state = randomness.state_dict()
    keys = [int(state[s]["key"], 16) for s in ("sampler", "noise")]
    assert keys[0] != keys[1] and max(k.bit_length() for k in keys) > 96  # 2⁻³² chance each to fail
    with pytest.raises(ValueError, match="128 bits"):
        SecretStream(1 << 128)


def test_draws_are_functions_of_key_and_position_only():
    a = MechanismRandomness(11)
    first = draws(a, steps=2)
    state = a.state_dict()
    upcoming = draws(a, steps=2)
    b = MechanismRandomness(None)
    b.load_state_dict(state)
    replayed = draws(b, steps=2)
    assert replayed[0] == upcoming[0] and np.array_equal(replayed[1], upcoming[1])
    assert first[0] != upcoming[0]


def test_parallel_chunks_draw_what_one_thread_draws():
    n = CHUNK + 1000  # two chunks
    serial = GaussianNoise(SecretStream(3), threads=1).standard_normal(n)
    parallel = GaussianNoise(SecretStream(3), threads=2).standard_normal(n)
    assert np.array_equal(serial, parallel)
    assert abs(serial.mean()) < 0.01 and serial.std() == pytest.approx(1.0, abs=0.01)


def test_the_noise_is_numpys_ziggurat_on_philox_words_at_the_draws_counter():
    """The format, from numpy directly: draw k's chunk c is `standard_normal` of
    Philox(key, counter (0, c, k, 0)); the key's low 64 bits first. Two draws through one
    source's threads, so the pool kept between draws cannot mix them."""
    key = (0x0123456789ABCDEF << 64) | 0xFEDCBA9876543210
    noise = GaussianNoise(SecretStream(key), threads=2)
    n = 2 * CHUNK + 17
    made = [noise.standard_normal(n) for _ in range(2)]
    noise.close()
    words = np.array([key & (2**64 - 1), key >> 64], dtype=np.uint64)
    for k, drawn in enumerate(made):
        expected = [np.random.Generator(np.random.Philox(key=words, counter=[0, c, k, 0])).standard_normal(min(CHUNK, n - c * CHUNK)) for c in range(3)]
        assert np.array_equal(drawn, np.concatenate(expected))


def test_the_tail_generator_is_made_only_for_a_draw_beyond_the_redraw():
    made = []

    def words():
        made.append(1)
        return np.random.default_rng(0).bit_generator.random_raw

    assert np.array_equal(randomness_module.redraw_tail(np.array([0.5, -7.9]), words), [0.5, -7.9]) and not made
    assert randomness_module.redraw_tail(np.array([0.5, 9.0]), words)[1] > randomness_module.TAIL_REDRAW and len(made) == 1


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
@pytest.mark.filterwarnings("ignore:.*multi-threaded.*fork:DeprecationWarning")  # the point of the test
def test_a_forked_child_draws_with_threads_of_its_own():
    """The chunks' pool is kept between draws; a child forked after a draw inherits it without its
    threads, and would wait forever on it."""
    noise = GaussianNoise(SecretStream(5), threads=2)
    parent = noise.standard_normal(2 * CHUNK)  # the pool now exists, with its threads
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child_process = context.Process(target=lambda: results.put(noise.standard_normal(2 * CHUNK)))  # forked: nothing pickled
    child_process.start()
    try:
        child = results.get(timeout=30)  # the old pool's threads are not in the child: without its own, this times out
    finally:
        child_process.kill()  # a child stuck on the inherited pool must not outlive the test
        child_process.join()
    again = noise.standard_normal(2 * CHUNK)
    noise.close()
    reference = GaussianNoise(SecretStream(5), threads=1)
    assert np.array_equal(parent, reference.standard_normal(2 * CHUNK))
    assert np.array_equal(child, reference.standard_normal(2 * CHUNK))  # the child made draw 1 of its copy
    assert np.array_equal(again, child)  # the parent's position moved on to draw 1 as well


def test_truncated_lots_are_uniform_subsets_of_the_poisson_lot():
    full = PoissonLotSampler(500, 0.2, SecretStream(8))
    capped = PoissonLotSampler(500, 0.2, SecretStream(8), max_lot_size=50)
    kept_counts = np.zeros(500)
    for _ in range(200):
        lot, kept = full.next_lot(), capped.next_lot()
        assert len(kept) == min(len(lot), 50) and set(kept) <= set(lot) and kept == sorted(kept)
        kept_counts[kept] += 1
    # Every example is kept at the same rate (≈ 200·50/500 = 20), whatever its index.
    assert kept_counts[:250].sum() == pytest.approx(kept_counts[250:].sum(), rel=0.1)


def test_secure_noise_reaches_past_the_analysed_tail(monkeypatch):
    """The smallest radius uniform (all-zero CSPRNG words) gives |z| > Z_MAX: the sampler does not
    stop inside the region whose probabilities the grid release's bound covers."""
    monkeypatch.setattr(randomness_module.secrets, "token_bytes", lambda n: bytes(n))
    z = secure_standard_normal(2)
    assert abs(z[0]) > Z_MAX
