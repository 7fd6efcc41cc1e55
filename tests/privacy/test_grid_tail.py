"""The grid release's floating-point bound, checked against the sampler itself: numpy's ziggurat,
driven word by word through a scripted bit generator, has the tail atoms, sign bit and tail mass
that privacy/grid.py charges for, and the accountant's band counts and δ are what an independent
binomial tail gives."""

from __future__ import annotations

import ctypes
import math
import threading

import mpmath
import numpy as np
import pytest
from scipy import stats

from dpmuon.privacy.grid import (
    BAND_EDGES,
    CELL_REACH,
    COUNT_TAIL,
    REDRAWN_TAIL,
    Z_MAX,
    ZIGGURAT_R,
    ZIGGURAT_SIGN_BIAS,
    ZIGGURAT_TAIL_MASS,
    ZIGGURAT_TAIL_WORDS,
    band_count,
    beyond,
    cell_eta,
    release_slack,
)
from dpmuon.privacy.randomness import TAIL_REDRAW, SecretStream, fine_uniform, gaussian_tail, redraw_tail

_U64 = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p)
_U32 = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_void_p)
_DOUBLE = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_void_p)
ONE = (2**53 - 1) << 11  # the word whose next_double is 1 − 2⁻⁵³
OLD_ETA = 2.0**-52 * (4 * (16 * 12 + 2) + 64)  # the claim before issue 37: uniform up to |z| = 12


class _BitGen(ctypes.Structure):  # numpy's bitgen_t
    _fields_ = [("state", ctypes.c_void_p), ("next_uint64", _U64), ("next_uint32", _U32), ("next_double", _DOUBLE), ("next_raw", _U64)]


class Scripted:
    """A bit generator that hands numpy's Generator the words it is given (next_double as Philox's:
    the top 53 bits), so the real ziggurat can be run on chosen words."""

    def __init__(self):
        self.words: list[int] = []
        self.used = 0

        def word(_):
            w = self.words[self.used] if self.used < len(self.words) else ONE
            self.used += 1
            return w

        self._callbacks = (_U64(word), _U32(lambda s: word(s) >> 32), _DOUBLE(lambda s: (word(s) >> 11) * 2.0**-53), _U64(word))
        self._struct = _BitGen(None, *self._callbacks)
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
        self.capsule = new(ctypes.addressof(self._struct), b"BitGenerator", None)
        self.lock = threading.Lock()
        self.generator = np.random.Generator(self)

    def normal(self, *words: int) -> tuple[float, int]:
        self.words, self.used = list(words), 0
        return self.generator.standard_normal(), self.used


def base_word(rabs: int, sign: int = 0) -> int:
    """The ziggurat's first word: layer 0 (low 8 bits), the body's sign (bit 8), rabs (52 bits)."""
    return rabs << 9 | sign << 8


TAIL = 2**52 - 1  # an rabs that enters the tail


def tail_atom(sampler: Scripted, k: int) -> float:
    """numpy's tail draw from u₁ = k·2⁻⁵³, u₂ = 1 − 2⁻⁵³ (always kept where the tail reaches);
    a rejected u₁ is followed by u₁ = 0, whose draw is exactly ±r."""
    z, used = sampler.normal(base_word(TAIL), k << 11, ONE, 0, ONE)
    return z if used == 3 else math.nan


@pytest.fixture(scope="module")
def sampler() -> Scripted:
    return Scripted()


def atom_index(sampler: Scripted, z: float) -> int:
    """The first k whose (negative: bit 8 of rabs is set) tail atom lies beyond −z."""
    lo, hi = 0, 2**53 - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if -tail_atom(sampler, mid) >= z else (mid, hi)
    return hi


def test_the_ziggurat_is_the_one_the_bound_describes(sampler):
    # The base layer enters the tail from rabs = 0xEF33D8025EF6A on: 2⁵² − that words.
    lo, hi = 0, 2**52 - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if sampler.normal(base_word(mid), 0, ONE)[1] == 1 else (lo, mid)
    assert 2**52 - hi == ZIGGURAT_TAIL_WORDS
    # The tail's sign is bit 8 of rabs, which among the tail's words is set 150 times more often.
    assert sampler.normal(base_word(TAIL), 0, ONE)[0] == -ZIGGURAT_R
    assert sampler.normal(base_word(TAIL - 256), 0, ONE)[0] == ZIGGURAT_R
    first = 2**52 - ZIGGURAT_TAIL_WORDS
    set_bit = sum(1 for rabs in range(first, -(-first // 512) * 512) if rabs >> 8 & 1)
    unset = -(-first // 512) * 512 - first - set_bit
    assert (set_bit - unset) / ZIGGURAT_TAIL_WORDS == pytest.approx(ZIGGURAT_SIGN_BIAS, rel=1e-12)
    # Its tail is r + xx, xx = −log1p(−u)/r with u = k·2⁻⁵³, for every u tried.
    for k in (1, 12345, 2**40, 2**52, 2**53 - 2**30):
        xx = -0.27366123732975828 * math.log1p(-k * 2.0**-53)
        assert -tail_atom(sampler, k) == ZIGGURAT_R + xx or xx > 8.58  # beyond 8.58 it rejects
    # The tail's mass, against the Gaussian's beyond r (the base layer's width is rabs·wi[0]).
    mpmath.mp.dps = 30
    width = sampler.normal(base_word(1), 0, ONE)[0]
    rel = (
        ZIGGURAT_TAIL_WORDS * mpmath.mpf(width) * mpmath.exp(-(ZIGGURAT_R**2) / 2) / mpmath.quad(lambda x: mpmath.exp(-x * x / 2), [ZIGGURAT_R, mpmath.inf]) - 1
    )
    assert abs(rel) <= ZIGGURAT_TAIL_MASS


def one_atom_jump(sampler: Scripted, z: float, width: float = 1 / 15) -> float:
    """Two valid cells [b − w, b) and [b − w, b + 2ε) with b just below the first atom beyond z:
    their ideal probabilities differ by ~ε·φ, the sampler's by that atom. Half the log-ratio of
    the jump is a lower bound on the worst |ln P̃/P| of the two: returned."""
    k = atom_index(sampler, z)
    top, above = -tail_atom(sampler, k), -tail_atom(sampler, k + 1)
    assert top < above and not math.isnan(above)  # distinct, consecutive atoms
    r = ZIGGURAT_R
    mpmath.mp.dps = 30
    x_top, x_low = mpmath.mpf(top) - r, mpmath.mpf(top) - width - r
    # In the tail's own measure (u uniform, kept with e^{−x²/2}): the cell's mass, and one atom's.
    cell = mpmath.quad(lambda x: r * mpmath.exp(-r * x - x * x / 2), [x_low, x_top])
    atom = mpmath.mpf(2.0**-53) * mpmath.exp(-(x_top**2) / 2)
    return float(atom / cell) / 2


def test_the_ziggurats_deep_tail_breaks_the_old_uniform_claim(sampler):
    """Consecutive tail atoms near |z| = 10 are 3.6e-7 apart, so a cell gains or loses a whole
    atom at once: 3.8e-6 of its mass, against the uniform 1.9e-13 once claimed up to |z| = 12."""
    k = atom_index(sampler, 10.0)
    assert -tail_atom(sampler, k + 1) + tail_atom(sampler, k) > 1e-7
    jump = one_atom_jump(sampler, 10.0)
    assert jump > 1e6 * OLD_ETA
    # And past 12.23 the ziggurat has no atom at all: a u₁ for |z| = 12.3 is rejected.
    k = math.ceil(-math.expm1(-(12.3 - ZIGGURAT_R) * ZIGGURAT_R) * 2**53)
    assert math.isnan(tail_atom(sampler, k))


@pytest.mark.parametrize("z", [5.0, 6.5, 7.9])
def test_the_band_bound_covers_the_ziggurats_atoms_up_to_the_redraw(sampler, z):
    assert one_atom_jump(sampler, z) <= cell_eta(z + 1 / 15)


def test_draws_beyond_the_redraw_come_from_the_fine_tail():
    # The ziggurat's draws beyond ±8 are replaced, the rest of the draw kept bit for bit.
    stream = SecretStream(7)
    plain = stream.generators(1)[0].standard_normal(1 << 16)
    redrawn = SecretStream(7).normal_sources(1)[0](1 << 16)
    far = np.abs(plain) > TAIL_REDRAW
    assert np.array_equal(plain[~far], redrawn[~far]) and not far.any()
    z = np.array([1.0, -9.5, 12.1])
    redraw_tail(z, lambda: np.random.default_rng(1).bit_generator.random_raw)
    assert z[0] == 1.0 and z[1] < -TAIL_REDRAW and z[2] > TAIL_REDRAW and (z[1], z[2]) != (-9.5, 12.1)
    # The fine tail's atoms: consecutive mantissas at depth 11 are ~2⁻⁵²/x apart (below x's own
    # ulp: the float rounding of x, in the arithmetic's budget, is all that remains), so a cell of
    # u-measure ≥ 0.39 of its binade errs by 3 atoms of u at most: within REDRAWN_TAIL.
    depth = math.ceil((11**2 - TAIL_REDRAW**2) / 2 / math.log(2))  # G with x ≈ 11
    words = np.array([[1 << depth] * 2, [0, 0], [7 << 12, 8 << 12]], dtype=np.uint64)
    u = fine_uniform(words)
    assert u[1] - u[0] == pytest.approx(2.0**-53 * 2.0**-depth)  # the spacing is 2⁻⁵² of the binade
    x = np.sqrt(TAIL_REDRAW**2 - 2 * np.log(u))
    assert 0 <= x[0] - x[1] <= np.spacing(x[0]) and 3 * 2.0**-52 / (1 - math.exp(-TAIL_REDRAW / 16)) <= REDRAWN_TAIL
    # And its law is the Gaussian's beyond 8.
    draws = gaussian_tail(TAIL_REDRAW, 20_000, np.random.default_rng(0).bit_generator.random_raw)
    assert stats.kstest(draws, stats.truncnorm(TAIL_REDRAW, np.inf).cdf).pvalue > 1e-3
    assert draws.min() > TAIL_REDRAW


@pytest.mark.parametrize("coordinates", [10_000, 124_000_000])
def test_release_slack_matches_an_independent_binomial_computation(coordinates):
    """ε and δ of one release, recomputed with scipy's exact binomial and Gaussian tails."""
    eta = [cell_eta(edge) for edge in BAND_EDGES]
    loss, bad = coordinates * eta[0], 0.0
    for lower, (a, b) in zip(BAND_EDGES[:-1], zip(eta, eta[1:], strict=False), strict=True):
        p_ideal = 2 * stats.norm.sf(lower - CELL_REACH)
        assert beyond(lower - CELL_REACH) == pytest.approx(2 * p_ideal, rel=1e-9)  # the sampler's own tail is within a factor 2
        k = band_count(coordinates, beyond(lower - CELL_REACH))
        exact = stats.binom.sf(k, coordinates, beyond(lower - CELL_REACH))  # P(N > k)
        assert exact <= COUNT_TAIL
        loss += k * (b - a)
        bad += exact
    bad += coordinates * 2 * 2 * stats.norm.sf(Z_MAX - CELL_REACH)
    slack = release_slack(coordinates)
    assert slack.epsilon == pytest.approx(2 * loss, rel=1e-12)
    assert bad <= slack.bad_event <= bad * 1.01 + len(BAND_EDGES) * COUNT_TAIL
    if coordinates == 124_000_000:  # GPT-2 small: the tail bands add 1% to the body's ε
        assert slack.epsilon < 4.1e-5 and 2 * coordinates * eta[0] > 0.98 * slack.epsilon and slack.bad_event < 1e-23
        assert (1 + math.exp(8)) * 5000 * slack.bad_event < 1e-3 * 1e-5  # 5000 steps at ε = 8 fit the first δ share


def test_the_bound_is_monotone_and_past_z_max_charged():
    eta = [cell_eta(edge) for edge in BAND_EDGES]
    assert eta == sorted(eta) and eta[0] < OLD_ETA and Z_MAX == 12.0
    assert release_slack(0).epsilon == 0 and release_slack(0).bad_event == 0
