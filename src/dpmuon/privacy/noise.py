"""Gaussian noise for the joint release, calibrated to the joint sensitivity Δ.

`uniform`: every coordinate of every block gets std σ·Δ. `proportional`: block W gets std
σ·sqrt(K)·C_W. Whitening each block by its std turns the release into one Gaussian mechanism
with sensitivity sqrt(Σ_W C_W²/std_W²), which is 1/σ in both cases: the effective noise
multiplier is σ, and the accountant sees exactly one subsampled Gaussian per step.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from .blocks import BlockPartition
from .grid import release_on_grid
from .randomness import CHUNK, KEY_BITS, SecretStream, secure_standard_normal
from .settings import NOISE_ALLOCATIONS, default


def block_noise_stds(partition: BlockPartition, noise_multiplier: float, allocation: str = default("noise_allocation")) -> list[float]:
    """Std of the noise added to each block's clipped sum (before dividing by the lot size)."""
    if noise_multiplier < 0:
        raise ValueError(f"noise multiplier must be >= 0, got {noise_multiplier}")
    if allocation == "uniform":
        return [noise_multiplier * partition.sensitivity] * len(partition)
    if allocation == "proportional":
        k = len(partition)
        return [noise_multiplier * math.sqrt(k) * b.threshold for b in partition.blocks]
    raise ValueError(f"unknown noise allocation {allocation!r}; valid: {', '.join(NOISE_ALLOCATIONS)}")


class GaussianNoise:
    """Source of N(0, 1) draws in float64: a secret stream (privacy/randomness.py; by default a
    fresh one keyed from OS entropy), or the OS CSPRNG in secure mode. One call is one draw of the
    stream: CHUNK-sized pieces from their own generators, filled by parallel threads (numpy and
    torch release the GIL), so the result does not depend on the number of threads.

    With `ahead`, `draw_ahead` makes the next release's draws in a background thread while the
    caller computes the lot's gradients: the noise depends on no data, only on the key and the
    draw's index, so a draw made early is the same draw bit for bit. A draw is used only if the
    stream asks for exactly it (same key, index and size); anything else (a reseed, a restored
    position, another size) discards what was drawn ahead and draws in turn."""

    def __init__(self, stream: SecretStream | None = None, secure: bool = False, threads: int | None = None, ahead: bool = False, pin_memory: bool = False):
        self.secure = secure
        self.stream = stream if stream is not None else SecretStream(secrets.randbits(KEY_BITS))
        self.threads = threads or torch.get_num_threads()
        self.ahead = ahead and not secure  # the OS CSPRNG has no position to draw ahead of
        self.pin_memory = pin_memory  # page-locked buffers: the copy to an accelerator does not stage
        self._next: _Ahead | None = None
        self._buffers: list[torch.Tensor] = []  # reused from release to release: no page faults per step
        self._filler: ThreadPoolExecutor | None = None
        # The chunks' threads, kept from draw to draw: a pool started for each parameter's draw,
        # its threads' memory new each time, cost 7–12% of a release (scripts/bench_noise_draws.py).
        # Its process id: a forked child inherits the pool but none of its threads, so it starts its own.
        self._pool: tuple[int, ThreadPoolExecutor] | None = None
        self._pool_lock = threading.Lock()  # the draw-ahead thread and the caller may both draw

    def standard_normal(self, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.float64)
        self._chunks(n, _store, out)
        return out

    def grid_release(self, total: torch.Tensor, std: float) -> torch.Tensor:
        """`release_on_grid(total, std, z)` with this source's next draw z, in place in `total`.

        On the CPU each chunk is noised where it is drawn (or read, if drawn ahead), while it is
        in cache; on an accelerator the draw crosses over once and the grid arithmetic runs there."""
        z = self._drawn_ahead(total.numel())
        if z is not None:
            self.stream.draws += 1  # the draw made ahead is this one: consume its place
            if total.device.type != "cpu":
                # A blocking copy: the buffer is refilled with later draws as soon as the release
                # ends, and a copy still in flight would then carry pieces of them.
                return release_on_grid(total, std, z.view(total.shape).to(total.device))
            flat, drawn = total.view(-1).numpy(), z.numpy()  # numpy in the chunks' threads: release_on_grid says why
            self._each_chunk(_chunk_count(flat.size), lambda c: release_on_grid(flat[c * CHUNK : (c + 1) * CHUNK], std, drawn[c * CHUNK : (c + 1) * CHUNK]))
            return total
        if total.device.type != "cpu":
            z = torch.from_numpy(self.standard_normal(total.numel())).view(total.shape)
            return release_on_grid(total, std, z)
        self._chunks(total.numel(), lambda piece, z: release_on_grid(piece, std, z), total.view(-1).numpy())
        return total

    def grid_release_slice(self, piece: torch.Tensor, std: float, size: int, start: int) -> torch.Tensor:
        """`grid_release` of the coordinates [start, start + piece.numel()) of a `size`-long
        total, in place in `piece`: the values the whole tensor's release would give them, bit for
        bit (the grid arithmetic is elementwise; `SecretStream.normal_slice_at`). One draw of the
        stream, as for the whole tensor: a sharded release draws each coordinate's noise once,
        on the rank that holds it. In secure mode the OS CSPRNG draws this rank's coordinates."""
        self._discard()  # drawn-ahead draws are whole tensors
        n = piece.numel()
        if self.secure:
            z = secure_standard_normal(n)
        else:
            z = self.stream.normal_slice_at(self.stream.draws, size, start, start + n)
            self.stream.draws += 1
        return release_on_grid(piece, std, torch.from_numpy(z).view(piece.shape).to(piece.device))

    def draw_ahead(self, sizes: Sequence[int]) -> None:
        """Start making the stream's next len(sizes) draws, of these sizes, in the background (a
        no-op unless `ahead`). They are kept until the stream asks for them."""
        if not self.ahead:
            return
        self._discard()
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="dpmuon-noise")
        while len(self._buffers) < len(sizes):
            self._buffers.append(torch.empty(0, dtype=torch.float64))
        for i, n in enumerate(sizes):
            if self._buffers[i].numel() != n:
                self._buffers[i] = torch.empty(n, dtype=torch.float64, pin_memory=self.pin_memory)
        snapshot = SecretStream(self.stream.key)  # a reseed of self.stream must not reach these draws
        first = self.stream.draws

        def fill(i: int) -> None:
            out = self._buffers[i].numpy()
            sources = snapshot.normal_sources_at(first + i, _chunk_count(sizes[i]))
            self._each_chunk(len(sources), lambda c: _store(out[c * CHUNK : (c + 1) * CHUNK], sources[c](len(out[c * CHUNK : (c + 1) * CHUNK]))))

        # One task per draw, in the order the release consumes them: the first waits only for itself.
        self._next = _Ahead(self.stream.key, first, tuple(sizes), [self._filler.submit(fill, i) for i in range(len(sizes))])

    def close(self) -> None:
        self._discard()
        if self._filler is not None:
            self._filler.shutdown()
            self._filler = None
        with self._pool_lock:
            if self._pool is not None:
                self._pool[1].shutdown()
                self._pool = None

    def _drawn_ahead(self, n: int) -> torch.Tensor | None:
        """The stream's next draw if it was drawn ahead with size n, else None (and the rest discarded)."""
        ahead = self._next
        if ahead is None:
            return None
        i = self.stream.draws - ahead.first
        # In order and once each: a draw already used (a position restored to it) may have been
        # consumed in place, and is drawn again in turn.
        if ahead.key != self.stream.key or i != ahead.taken or i >= len(ahead.sizes) or ahead.sizes[i] != n:
            self._discard()
            return None
        ahead.filled[i].result()  # waits for that draw (and raises its error)
        ahead.taken += 1
        return self._buffers[i]

    def _discard(self) -> None:
        """Drop what was drawn ahead; a fill in progress finishes first (it writes a reused buffer)."""
        ahead, self._next = self._next, None
        if ahead is None:
            return
        for future in ahead.filled:
            future.cancel()
        wait(ahead.filled)

    def _chunks(self, n: int, consume: Callable, target) -> None:
        """consume(target[chunk], z_chunk) for every chunk of one draw of n normals."""
        count = _chunk_count(n)
        sources = None if self.secure else self.stream.normal_sources(count)

        def one(chunk: int) -> None:
            piece = target[chunk * CHUNK : (chunk + 1) * CHUNK]
            z = secure_standard_normal(len(piece)) if sources is None else sources[chunk](len(piece))
            consume(piece, z)

        self._each_chunk(count, one)

    def _each_chunk(self, count: int, one: Callable[[int], None]) -> None:
        if count == 1 or self.threads == 1:
            for chunk in range(count):
                one(chunk)
        else:
            list(self._chunk_pool().map(one, range(count)))

    def _chunk_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None or self._pool[0] != os.getpid():
                self._pool = (os.getpid(), ThreadPoolExecutor(self.threads, thread_name_prefix="dpmuon-chunks"))
            return self._pool[1]


@dataclass
class _Ahead:
    """Draws made ahead: the stream's key, the index of the first, their sizes, one future each,
    and how many were used."""

    key: int
    first: int
    sizes: tuple[int, ...]
    filled: list[Future]
    taken: int = 0


def _chunk_count(n: int) -> int:
    return max(1, -(-n // CHUNK))


def _store(piece: np.ndarray, z: np.ndarray) -> None:
    piece[:] = z
