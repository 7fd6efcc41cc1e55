"""The privatizer: the only code that touches private data.

One step: (the caller samples a lot) → per-example gradients → per-block clipping → joint
Gaussian noise, added on an integer grid so that the release is private as computed in floats
(privacy/grid.py) → released gradient g̃_W = grid(Σ_i H_i,W + noise_W) / B_expected → one ledger
line (durable) and one accountant step → written to p.grad. Before any of it, user code that
would void the clipping is refused (privacy/conformance.py). Optimizers only ever read p.grad
afterwards: post-processing.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from .accountant import NullAccountant, PrivacyAccountant
from .blocks import BlockPartition
from .conformance import StateGuard, check_first_micro_batch, public_stand_in
from .distributed import SINGLE, DataParallel
from .engines import PerExampleLoss, build_engine
from .ledger import PrivacyLedger, release_digest
from .noise import GaussianNoise, block_noise_stds
from .settings import default
from .sharded import as_shard_grad, reduce_rows_in_rank_order, rows_of, shard_digest, sharded, together
from .subnormals import flush_supported, flushing, start_flushing_threads, workers_flush

WORKERS_DO_NOT_FLUSH = (
    "torch's CPU worker threads were started before the private run could make them flush subnormal floats to zero, so a "
    "step's time can still depend on the values of its examples (docs/privacy.md, 'subnormal floats'): call "
    "dpmuon.privacy.start_flushing_threads() first thing in the process, before any torch work"
)


class NonFiniteReleaseError(RuntimeError):
    """The released gradient is not finite: stop rather than corrupt the model."""


class ReplayMismatchError(RuntimeError):
    """A re-run step drew the same noise as its earlier release but produced another output.

    Publishing it would reveal the noise-free difference of two clipped sums — no amount of
    accounting covers that — so nothing is written; the caller must redo the step with fresh
    randomness (a new lot and new noise), which is then an ordinary, charged release.
    """


@dataclass
class ReleaseStats:
    """What one step saw, computed from raw per-example values: non-private diagnostics."""

    lot_size: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    norm_sum: float = 0.0
    nonfinite: int = 0
    clipped: torch.Tensor | None = None  # [K] examples clipped per block
    charged: bool = True  # False: a replay identical to a release the ledger already holds

    @property
    def train_loss(self) -> float:
        return self.loss_sum / self.loss_count if self.loss_count else math.nan

    @property
    def mean_grad_norm(self) -> float:
        finite = self.lot_size - self.nonfinite
        return self.norm_sum / finite if finite else math.nan

    def clip_fraction(self) -> list[float]:
        finite = self.lot_size - self.nonfinite
        if self.clipped is None or finite == 0:
            return []
        return (self.clipped.double() / finite).tolist()


@dataclass
class Privatizer:
    """Clip → noise → release → account, for one model and one block partition."""

    model: nn.Module
    partition: BlockPartition
    noise_multiplier: float
    expected_lot_size: float
    sample_rate: float
    accountant: PrivacyAccountant
    noise: GaussianNoise = field(default_factory=GaussianNoise)
    noise_allocation: str = default("noise_allocation")
    engine: str = default("engine")
    engine_fallback: str = default("engine_fallback")  # modules without a rule: torch.func gradients ("generic"), or refused
    parallel: DataParallel = SINGLE  # this rank's place; micro_batches are then its shard of the lot
    ledger: PrivacyLedger | None = None  # durable record of every release (rank 0 writes it)
    constant_time: bool = False  # lots padded to a fixed size: the engine's work must not depend on the real rows
    # Non-private diagnostics only: receives each step's clipped sum / B *before* noise.
    observe_noise_free: Callable[[dict[str, torch.Tensor]], None] | None = None

    def __post_init__(self):
        if self.expected_lot_size <= 0:
            raise ValueError(f"expected lot size must be > 0, got {self.expected_lot_size}")
        self._engine = build_engine(self.engine, self.model, self.partition, self.constant_time, fallback=self.engine_fallback)
        self.engine_note = self._engine.fallback_summary  # the run log's line on fallback modules (None: none)
        self.forms_row_gradients = self._engine.forms_row_gradients  # memory grows with rows: cap them in widths
        self.params = self._engine.params
        self.block_stds = block_noise_stds(self.partition, self.noise_multiplier, self.noise_allocation)
        block_of = self.partition.block_index()
        # The sizes of one release's draws, in the order `_noised` makes them.
        self._noise_sizes = [p.numel() for name, p in self.params.items() if self.block_stds[block_of[name]] > 0]
        # Whether a re-run step may draw the noise of its earlier release again: true for seeded
        # noise restored from saved state, false in secure mode and after a fresh reseed.
        self.noise_may_repeat = not self.noise.secure
        # Whether a micro-batch passed the loss and coupling checks (conformance.py): once per privatizer.
        self.conformance_checked = False
        # FSDP2 row shards (privacy/sharded.py): each rank releases, and noises, only its own rows.
        self.sharded = sharded(self.params, self.parallel.world_size)
        if self.sharded and self.observe_noise_free is not None:
            raise ValueError("the noise-free diagnostics need the whole clipped sum on one rank; a sharded release has no rank that holds it")
        # Constant-time lots fix a step's shapes; on the CPU, flush-to-zero keeps subnormal values
        # from setting its time (privacy/subnormals.py). Starting the threads here covers make_private
        # and DPTrainer where the user's process has not started them yet.
        on_cpu = all(p.device.type == "cpu" for p in self.params.values())
        self.flush_subnormals = self.constant_time and on_cpu and flush_supported()
        self._warned_workers = False
        if self.flush_subnormals:
            start_flushing_threads()

    def release_noise_std(self) -> dict[str, float]:
        """Public per-entry noise std of g̃ for each parameter: std_W / B_expected."""
        block_of = self.partition.block_index()
        return {n: self.block_stds[block_of[n]] / self.expected_lot_size for n in self.params}

    def noise_std_range(self) -> dict[str, float]:
        """Per-entry noise std of g̃ over blocks (median, min, max: they differ when thresholds
        differ under proportional allocation), as the release uses it."""
        stds = sorted(s / self.expected_lot_size for s in self.block_stds)
        return {"noise_std": statistics.median(stds), "noise_std_min": stds[0], "noise_std_max": stds[-1]}

    def public_step_fields(self, with_epsilon: bool) -> dict[str, float]:
        """What a metrics row shows of the mechanism after a release: the noise std and, when
        asked (an accountant call is not free), ε spent so far."""
        return ({"epsilon": self.accountant.epsilon()} if with_epsilon else {}) | self.noise_std_range()

    def release(self, micro_batches: Iterable[Mapping[str, Any]], loss_fn: PerExampleLoss, step: int | None = None) -> ReleaseStats:
        """Privatize one lot (given as physical micro-batches) into p.grad and account for it.

        With a ledger, `step` names the release; the ledger line is durable before p.grad is set.
        """
        if self.sharded:
            return self._release_shards(micro_batches, loss_fn, step)
        summed, stats = self._guarded_total(micro_batches, loss_fn)
        # In the parameters' order, zeros for what this rank's share of the lot did not book (all
        # of it when the share is empty): the all-reduce below adds the ranks' totals as one flat
        # buffer, position by position, so every rank must list them in the same order.
        summed = {name: summed[name] if name in summed else torch.zeros_like(p, dtype=torch.float64) for name, p in self.params.items()}
        noise_free = {n: (t / self.expected_lot_size).float() for n, t in summed.items()} if self.observe_noise_free else None
        if self.parallel.world_size > 1:  # the grid rounds the whole lot's sum: add the shards first
            self.parallel.all_reduce_sum(list(summed.values()))
            stats = _reduce_stats(stats, self.parallel)
        if self.noise.secure and self.parallel.world_size > 1:  # CSPRNG draws differ per rank: rank 0 noises
            released = self._noised(summed) if self.parallel.is_main else {n: torch.zeros_like(p) for n, p in self.params.items()}
            self.parallel.all_reduce_sum(list(released.values()))  # x + 0 = x: rank 0's values exactly
        else:  # every rank draws the same keyed noise: the same release, with no second all-reduce
            released = self._noised(summed)
        _refuse_nonfinite(released)  # before any p.grad is written: nothing half-released
        with record_function("dpmuon.ledger"):
            stats.charged = self._record(step, release_digest(released) if self.parallel.is_main and self.ledger is not None else None)
        if noise_free is not None:
            self.observe_noise_free(noise_free)
        if stats.charged:
            self.accountant.step(self.noise_multiplier, self.sample_rate)
        for name, p in self.params.items():
            p.grad = released[name]
        # The next release's noise depends on no data: it is drawn while the next lot is computed.
        self.noise.draw_ahead(self._noise_sizes)
        return stats

    def _guarded_total(self, micro_batches: Iterable[Mapping[str, Any]], loss_fn: PerExampleLoss) -> tuple[dict[str, torch.Tensor], ReleaseStats]:
        """`_clipped_total`, with refusals of user code that voids clipping (privacy/conformance.py)
        coming before anything is noised, recorded or charged, and leaving the model's buffers as
        they were."""
        guard = StateGuard(self.model)
        try:
            summed, stats = self._clipped_total(micro_batches, loss_fn)
            guard.check()
        except BaseException:
            guard.restore()
            raise
        return summed, stats

    def _release_shards(self, micro_batches: Iterable[Mapping[str, Any]], loss_fn: PerExampleLoss, step: int | None) -> ReleaseStats:
        """`release` on FSDP2's row shards (privacy/sharded.py): the lot's float64 totals reduced in
        rank order to this rank's rows, its rows noised, p.grad its shard of the release. A
        failure on any rank stops every rank (`together`) before the next collective. No noise
        is drawn ahead: a shard's is drawn at its offset (`GaussianNoise.grid_release_slice`),
        not as a whole tensor."""
        rank, world = self.parallel.rank, self.parallel.world_size
        summed, stats = together(lambda: self._guarded_total(micro_batches, loss_fn), rank, world)
        stats = _reduce_stats(stats, self.parallel)
        shards = {}
        for name, p in self.params.items():  # every rank, every parameter, in order: collectives
            total = summed.pop(name) if name in summed else torch.zeros(p.shape, dtype=torch.float64, device=p.device)
            shards[name] = reduce_rows_in_rank_order(total, world, rank)
        released = together(lambda: self._noised_shards(shards), rank, world)
        with record_function("dpmuon.ledger"):
            stats.charged = self._record(step, shard_digest(released, rank))
        if stats.charged:
            self.accountant.step(self.noise_multiplier, self.sample_rate)
        for name, p in self.params.items():
            p.grad = as_shard_grad(released[name], p)
        return stats

    def _noised_shards(self, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`_noised` on this rank's rows: each parameter's noise drawn at its rows' flat offset, one
        draw of the stream per noised parameter as in the whole release."""
        block_of = self.partition.block_index()
        released = {}
        with record_function("dpmuon.noise"):
            for name, p in self.params.items():
                piece, std = shards.pop(name), self.block_stds[block_of[name]]
                if std > 0:
                    start, _ = rows_of(p, self.parallel.world_size, self.parallel.rank)
                    row_size = p.numel() // p.shape[0] if p.shape[0] else 0
                    piece = self.noise.grid_release_slice(piece, std, p.numel(), start * row_size)
                released[name] = piece.div_(self.expected_lot_size).to(p.dtype)
        _refuse_nonfinite(released)
        return released

    def _clipped_total(self, micro_batches: Iterable[Mapping[str, Any]], loss_fn: PerExampleLoss) -> tuple[dict[str, torch.Tensor], ReleaseStats]:
        """`_sum_clipped`, with subnormals flushed to zero on every thread that computes it where
        constant-time lots run on the CPU."""
        if not self.flush_subnormals:
            return self._sum_clipped(micro_batches, loss_fn)
        if not (workers_flush() or self._warned_workers):  # checked at every lot: user code may start threads
            warnings.warn(WORKERS_DO_NOT_FLUSH, stacklevel=2)
            self._warned_workers = True
        with flushing():
            return self._sum_clipped(micro_batches, loss_fn)

    def _sum_clipped(self, micro_batches: Iterable[Mapping[str, Any]], loss_fn: PerExampleLoss) -> tuple[dict[str, torch.Tensor], ReleaseStats]:
        """The lot's clipped sum (float64) and statistics; a public stand-in of the first micro-batch
        with rows is first checked for a per-example loss that does not couple the examples (once
        per privatizer)."""
        summed: dict[str, torch.Tensor] = {}
        stats = ReleaseStats(clipped=torch.zeros(len(self.partition), dtype=torch.long))
        for batch in micro_batches:
            if not self.conformance_checked:
                with record_function("dpmuon.conformance"):
                    self.conformance_checked = check_first_micro_batch(self.model, public_stand_in(batch), loss_fn)
            losses, clip = self._engine.add_clipped_sum(batch, loss_fn, summed)
            finite = torch.isfinite(losses)  # filler rows' losses are NaN
            stats.lot_size += clip.examples
            stats.loss_sum += float(losses.masked_fill(~finite, 0).sum())
            stats.loss_count += int(finite.sum())
            stats.norm_sum += clip.norm_sum
            stats.nonfinite += clip.nonfinite
            stats.clipped += clip.clipped
        return summed, stats

    def _noised(self, summed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The release g̃ = grid(S + noise)/B of each parameter, noised on the integer grid
        (privacy/grid.py) in float64, then cast. One parameter at a time, freeing each sum as its
        release is made, so the peak never holds two float64 copies of the model."""
        block_of = self.partition.block_index()
        released = {}
        with record_function("dpmuon.noise"):
            for name, p in self.params.items():
                total, std = summed.pop(name), self.block_stds[block_of[name]]
                if std > 0:
                    total = self.noise.grid_release(total, std)
                released[name] = total.div_(self.expected_lot_size).to(p.dtype)
        return released

    def _record(self, step: int | None, digest: str | None) -> bool:
        """Write the release's digest to the ledger (rank 0, which alone needs it) and say whether
        it is charged, on every rank."""
        if self.ledger is None and self.parallel.world_size == 1:
            return True
        outcome = "charged"
        if self.parallel.is_main and self.ledger is not None:
            if step is None:
                raise ValueError("a privatizer with a ledger needs the step of each release")
            earlier = self.ledger.earlier_digests(step)
            if earlier and digest not in earlier and self.noise_may_repeat:
                outcome = "mismatch"
            else:
                outcome = "charged" if self.ledger.record(step, self.noise_multiplier, self.sample_rate, digest) else "replay"
        if self.parallel.world_size > 1:
            outcome = self.parallel.broadcast_object(outcome)
        if outcome == "mismatch":
            raise ReplayMismatchError(f"step {step} was re-run with its earlier noise but released a different gradient")
        return outcome == "charged"

    def epsilon(self) -> float:
        return self.accountant.epsilon()

    def close(self) -> None:
        self._engine.close()
        self.noise.close()


def _refuse_nonfinite(released: Mapping[str, torch.Tensor]) -> None:
    bad = [name for name, g in released.items() if not _all_finite(g)]
    if bad:
        raise NonFiniteReleaseError(
            f"released gradient is not finite in {len(bad)} tensor(s) (first: {bad[0]}); refusing to "
            "update the model — the clipped sum or the noise is broken, not the data"
        )


def _all_finite(t: torch.Tensor) -> bool:
    # A finite sum needs finite entries (NaN and ±inf propagate); only an overflowing sum of
    # finite entries needs the entry-wise check, which costs a pass and a mask.
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _reduce_stats(stats: ReleaseStats, parallel: DataParallel) -> ReleaseStats:
    packed = torch.tensor(
        [stats.lot_size, stats.loss_sum, stats.loss_count, stats.norm_sum, stats.nonfinite, *stats.clipped.tolist()],
        dtype=torch.float64,
    )
    parallel.all_reduce_sum([packed])
    lot, loss_sum, count, norm_sum, nonfinite, *clipped = packed.tolist()
    return ReleaseStats(int(lot), loss_sum, int(count), norm_sum, int(nonfinite), torch.tensor(clipped).long())


class NonPrivateRelease:
    """The non-private reference with the privatizer's interface: p.grad = mean gradient of the
    lot, no clipping, no noise, nothing accounted."""

    def __init__(self, model: nn.Module, parallel: DataParallel = SINGLE):
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.model = model
        self.noise_multiplier = 0.0
        self.parallel = parallel
        self.accountant = NullAccountant()

    def release_noise_std(self) -> dict[str, float]:
        return {n: 0.0 for n in self.params}

    def public_step_fields(self, with_epsilon: bool) -> dict[str, float]:
        return {}

    def release(self, micro_batches: Iterable[Mapping[str, Any]], loss_fn: PerExampleLoss, step: int | None = None) -> ReleaseStats:
        for p in self.params.values():
            p.grad = None
        stats = ReleaseStats(clipped=torch.zeros(0, dtype=torch.long))
        for batch in micro_batches:
            losses = loss_fn(self.model, batch)
            losses.sum().backward()
            stats.lot_size += int(losses.shape[0])
            stats.loss_sum += float(losses.detach().sum())
            stats.loss_count += int(losses.shape[0])
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params.values()]
        if self.parallel.world_size > 1:
            self.parallel.all_reduce_sum(grads)
            stats = _reduce_stats(stats, self.parallel)
        for p, grad in zip(self.params.values(), grads):
            p.grad = grad / stats.lot_size if stats.lot_size else grad
        return stats

    def close(self) -> None:
        pass
