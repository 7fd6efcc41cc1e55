"""The mechanism's randomness — which examples join a lot, and the Gaussian noise — kept secret.

Whoever can regenerate these draws can undo the mechanism: re-derive every lot, subtract the
noise from a released gradient and read off the exact clipped sum. So they never come from the
published `seed`, and the secret is large enough that nobody can search for it: two 128-bit keys
(one for lots, one for noise) of Philox4x64-10 counter-based generators. (torch's CPU generator,
used before, keeps only 32 bits of its seed: a search over 2³² candidates, testable against the
published lot sizes, recovered every lot.)

Draw k of a stream is `Philox(key, counter=(0, chunk, k, 0))`: a function of the key and k alone,
so a stream's position is one integer (what a resume restores), and the chunks of one large draw
come from disjoint counter ranges that threads fill in parallel. Normals are numpy's ziggurat on
those words, except that a draw beyond ±TAIL_REDRAW is redrawn from the Gaussian tail at full
resolution (`gaussian_tail`) with words of `(0, chunk, k, 1)`: the ziggurat's own deep tail is
coarse (privacy/grid.py), and such a draw has probability 1.2e-15. By default each run draws its
keys from OS entropy; a user secret (`DPMUON_MECHANISM_SEED`) is hashed into them with a 256-bit
`SeedSequence` pool, so every bit of it counts. In secure mode nothing is keyed at all: lots and
noise come straight from the OS CSPRNG, so even a leaked key reveals nothing.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable

import numpy as np

OS_ENTROPY = "os entropy"
USER_SEED = "user seed (the guarantee assumes it stays secret)"
PUBLISHED_SEED = "published seed — no guarantee"  # a user seed the run declares published (privacy.published_seed)
SECURE = "os csprng (secure mode: every draw from the OS, nothing seeded)"
KEY_BITS = 128  # Philox4x64's key
CHUNK = 1 << 16  # elements per generator of a draw: fits in cache while it is noised, and shares out over threads
# |z| past which a normal draw is redrawn by `gaussian_tail`: numpy's ziggurat draws its tail by
# −log1p(−u)/r from 53-bit u, whose atoms thin out as e^{r·(|z|−r)} (privacy/grid.py bounds it up
# to here); past 12.23 it has none at all. A draw beyond it has probability 1.2e-15, so the outputs
# of every practical run are those of the plain ziggurat.
TAIL_REDRAW = 8.0
LENGTHS_DOMAIN = 1  # the noise key's counters of the one length-histogram release (lanes 2 and 3)


class SecretStream:
    """Independent draws from one 128-bit key; the stream's position is the number of draws made.

    Streams of one key in different domains never share a draw (domain 0: the steps' noise;
    LENGTHS_DOMAIN: the length histogram's, privacy/lot_bound.py). The domain goes in the
    counter's last word, above the lane: its first word is the one Philox increments as it runs,
    so a domain there would only start the same stream a block later."""

    def __init__(self, key: int, domain: int = 0):
        if not 0 <= key < 1 << KEY_BITS:
            raise ValueError(f"a stream key has {KEY_BITS} bits, got {key.bit_length()}")
        self.key = key
        self.domain = domain
        self.draws = 0

    def generators(self, chunks: int = 1) -> list[np.random.Generator]:
        """The generators of the next draw, one per chunk (disjoint counter ranges)."""
        draw, self.draws = self.draws, self.draws + 1
        return [self._generator(chunk, draw, 0) for chunk in range(chunks)]

    def normal_sources(self, chunks: int = 1) -> list[Callable[[int], np.ndarray]]:
        """The next draw as N(0, 1) sources, one per chunk: the ziggurat on counter (0, chunk, k, 0),
        its draws beyond ±TAIL_REDRAW redrawn from the words of (0, chunk, k, 1)."""
        draw, self.draws = self.draws, self.draws + 1
        return self.normal_sources_at(draw, chunks)

    def normal_sources_at(self, draw: int, chunks: int = 1) -> list[Callable[[int], np.ndarray]]:
        """Draw `draw` of the stream (made or not) as N(0, 1) sources; the position does not move.
        A draw is a function of the key and its index alone, so it may be made ahead of its turn."""

        def source(chunk: int) -> Callable[[int], np.ndarray]:
            def normals(n: int) -> np.ndarray:
                z = self._generator(chunk, draw, 0).standard_normal(n)
                # The tail's generator is made only for a draw that needs it (1.2e-15 a normal): a
                # generator costs about 30 µs, near half of drawing a small LoRA matrix's 4,608 normals.
                return redraw_tail(z, lambda: self._generator(chunk, draw, 1).bit_generator.random_raw)

            return normals

        return [source(chunk) for chunk in range(chunks)]

    def normal_slice_at(self, draw: int, size: int, start: int, stop: int) -> np.ndarray:
        """Coordinates [start, stop) of draw `draw` made `size` long: bit for bit that slice of the
        whole draw, so that ranks holding disjoint shards of one tensor each draw their own noise
        and together draw every coordinate once. Each chunk the slice touches is drawn whole: a
        chunk's values (and its tail redraws, in order) depend on the values before them in it."""
        if not 0 <= start <= stop <= size:
            raise ValueError(f"slice [{start}, {stop}) of a draw of {size}")
        if start == stop:  # a rank holding none of the rows: nothing to draw
            return np.empty(0)
        first, last = start // CHUNK, -(-stop // CHUNK)
        sources = self.normal_sources_at(draw, last)
        drawn = [sources[c](min(CHUNK, size - c * CHUNK)) for c in range(first, last)]
        whole = np.concatenate(drawn) if drawn else np.empty(0)
        return whole[start - first * CHUNK : stop - first * CHUNK]

    def _generator(self, chunk: int, draw: int, lane: int) -> np.random.Generator:
        key = np.array([self.key & (2**64 - 1), self.key >> 64], dtype=np.uint64)
        return np.random.Generator(np.random.Philox(key=key, counter=[0, chunk, draw, 2 * self.domain + lane]))

    def state_dict(self) -> dict:
        return {"key": f"{self.key:032x}", "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.key, self.draws = int(state["key"], 16), int(state["draws"])


class MechanismRandomness:
    """The lot sampler's and the noise's secret streams (or, in secure mode, the OS CSPRNG)."""

    def __init__(self, secret: int | None, secure: bool = False):
        self.secure = secure
        self.source = SECURE if secure else (OS_ENTROPY if secret is None else USER_SEED)
        self.sampler, self.noise = SecretStream(0), SecretStream(0)
        self._key(fresh_secret() if secret is None else int(secret))

    def _key(self, secret: int) -> None:
        # Two independent keys from one secret: neither stream reveals the other's.
        words = np.random.SeedSequence(secret, pool_size=8).generate_state(4, dtype=np.uint64)
        self.sampler.key = int(words[0]) | int(words[1]) << 64
        self.noise.key = int(words[2]) | int(words[3]) << 64

    def length_stream(self) -> SecretStream:
        """The noise key's stream of the length histogram's release: never a step's draw."""
        return SecretStream(self.noise.key, domain=LENGTHS_DOMAIN)

    def reseed_from_os_entropy(self) -> None:
        """Fresh, never-used draws from here on (after a replay that did not reproduce its output)."""
        self._key(fresh_secret())
        if not self.secure:
            self.source = OS_ENTROPY + " (reseeded on resume)"

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "noise": self.noise.state_dict(), "source": self.source}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.noise.load_state_dict(state["noise"])
        self.source = state["source"]


def fresh_secret() -> int:
    return secrets.randbits(2 * KEY_BITS)


def secure_uniform(n: int) -> np.ndarray:
    """n uniforms in (0, 1) — never exactly 0 or 1 — from 53 random bits each of the OS CSPRNG."""
    bits = np.frombuffer(secrets.token_bytes(8 * n), dtype=np.uint64)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def secure_words(n: int) -> np.ndarray:
    return np.frombuffer(secrets.token_bytes(8 * n), dtype=np.uint64)


def secure_standard_normal(n: int) -> np.ndarray:
    """n draws of N(0, 1) in float64 by Box–Muller on OS CSPRNG bits: no seed exists to recover.

    The radius' uniform has full floating-point resolution (`fine_uniform`: relative 2⁻⁵² down to
    2⁻¹²⁹), so the radius is as fine at 12 as at 1 and reaches 13.4; draws beyond ±TAIL_REDRAW are
    redrawn by `gaussian_tail`, as the streams' are.
    """
    pairs = (n + 1) // 2
    radius = np.sqrt(-2.0 * np.log(fine_uniform(secure_words(3 * pairs).reshape(3, pairs))))
    angle = 2.0 * math.pi * secure_uniform(pairs)
    return redraw_tail(np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n], lambda: secure_words)


def fine_uniform(words: np.ndarray) -> np.ndarray:
    """Uniforms in (0, 1) at floating-point resolution from 3 words each (rows): U = V·2^−G, G the
    trailing zeros of two words (geometric, P(G = g) = 2^−(g+1), capped at 128), V in [1/2, 1) on
    52 bits. Each atom's probability is its spacing, 2⁻⁵² of its binade: −ln U has atoms 2⁻⁵² apart
    at every depth, where a 53-bit fixed-point u has ln-spacing 2⁻⁵³/u."""
    zeros = _trailing_zeros(words[0])
    zeros += np.where(zeros == 64, _trailing_zeros(words[1]), 0)
    half_to_one = ((words[2] >> np.uint64(12)) | np.uint64(1 << 52)).astype(np.float64) * 2.0**-53
    return np.ldexp(half_to_one, -zeros.astype(np.int64))  # exact: U ≥ 2^−129 is a normal float


def _trailing_zeros(words: np.ndarray) -> np.ndarray:
    lowest = words & (~words + np.uint64(1))  # the lowest set bit; 0 for a zero word
    return np.bitwise_count(lowest - np.uint64(1)).astype(np.int64)  # a zero word wraps to 64 ones


def gaussian_tail(beyond: float, n: int, words: Callable[[int], np.ndarray]) -> np.ndarray:
    """n draws of Z | Z > beyond, Z ~ N(0, 1), from 64-bit words (Marsaglia 1964): X = √(b² + 2E),
    E = −ln U ~ Exp(1), kept with probability b/X. U is `fine_uniform`, so the atoms of X are about
    2⁻⁵²/X apart at every depth up to √(b² + 256 ln 2) (15.5 at b = 8), and U₂ (53 bits) sets the
    acceptance b/X ≥ 1/2 to 2⁻⁵³."""
    out = np.empty(n, dtype=np.float64)
    todo = np.arange(n)
    while todo.size:
        w = words(4 * todo.size).reshape(4, todo.size)
        x = np.sqrt(beyond * beyond - 2.0 * np.log(fine_uniform(w[:3])))
        kept = (w[3] >> np.uint64(11)).astype(np.float64) * 2.0**-53 * x < beyond
        out[todo[kept]] = x[kept]
        todo = todo[~kept]
    return out


def redraw_tail(z: np.ndarray, words: Callable[[], Callable[[int], np.ndarray]]) -> np.ndarray:
    """z with each draw beyond ±TAIL_REDRAW replaced, in place, by a `gaussian_tail` draw of its
    sign, from the source of words that `words()` makes (called only if some draw is redrawn)."""
    far = np.flatnonzero(np.abs(z) > TAIL_REDRAW)
    if far.size:
        z[far] = np.copysign(gaussian_tail(TAIL_REDRAW, far.size, words()), z[far])
    return z
