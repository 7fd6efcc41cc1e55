"""The whole private release of a run, built in one place from a model, N and the privacy settings.

secret randomness (OS entropy unless the user gives a seed: privacy/seed.py) → the length
histogram's release, when constant-time lots are bucketed by width (privacy/lot_bound.py) → plan
(σ from the target ε, or ε from a given σ) → ledger (fsynced, hash-chained; its header records
that release before anything derived from it is said) → block partition → privatizer
(engine, noise, accountant whose history comes from the ledger) → Poisson lot sampler. The
training driver (training/loop.py), the façade (`dpmuon.make_private`), the bench and the tests
all build it here, so each of them releases exactly what the others would.

What the optimizers may see of it is public: `Mechanism.release_noise_std()`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from .accountant import PrivacyAccountant
from .blocks import BlockPartition, build_partition, partition_summary
from .distributed import SINGLE, DataParallel
from .ledger import LEDGER_FILE, LedgerIntegrityError, LedgerMismatchError, PrivacyLedger, ledger_header
from .lot_bound import bucketed_lot_bound, length_histogram, lot_bound
from .noise import GaussianNoise
from .plan import PrivacyPlan, check_private_inputs, make_plan, plan_length, within_budget
from .privatizer import NonPrivateRelease, Privatizer, ReleaseStats, ReplayMismatchError
from .randomness import MechanismRandomness
from .sampling import PoissonLotSampler, ShuffleLotSampler, build_lot_sampler
from .seed import STRONG_SEED, WEAK_SEED_WARNING
from .settings import PrivacySettings, default

Log = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class MechanismSettings(PrivacySettings):
    """What decides the mechanism: the privacy options (privacy/settings.py) and the run's length
    and kind, which are not privacy options (the driver's trainer.epochs/steps, optimizer.private)."""

    epochs: float | None = None
    steps: int | None = None  # given: the plan's steps; else ⌈epochs/q⌉
    private: bool = True  # False: the non-private reference (no clipping, no noise, nothing charged)


@dataclass
class Mechanism:
    """One run's private release and everything it keeps: plan, secret randomness, ledger,
    partition, privatizer (its accountant) and lot sampler."""

    plan: PrivacyPlan
    randomness: MechanismRandomness
    ledger: PrivacyLedger | None
    partition: BlockPartition | None
    release: Privatizer | NonPrivateRelease  # its accountant: a NullAccountant when non-private
    sampler: PoissonLotSampler | ShuffleLotSampler
    parallel: DataParallel = SINGLE

    def release_noise_std(self) -> dict[str, float]:
        """Public per-entry noise std of the released gradient of each parameter (what DP-Muon's
        bias correction needs; 0 when non-private)."""
        return self.release.release_noise_std()

    def next_lot(self) -> list[int]:
        """The next lot's example indices (every rank gets the same lot)."""
        lot = self.sampler.next_lot()
        if self.parallel.world_size > 1 and self.randomness.secure:  # CSPRNG lots differ per rank: rank 0's counts
            lot = self.parallel.broadcast_object(lot if self.parallel.is_main else None)
        return lot

    def redraw_fresh(self) -> None:
        """Fresh secret randomness from here on, on every rank: after a replay that could not
        reproduce its output (privatizer.ReplayMismatchError), the step is redone as a new release."""
        self.randomness.reseed_from_os_entropy()
        share_rank0_randomness(self.randomness, self.parallel)  # ranks must keep drawing one lot
        self.release.noise_may_repeat = False

    def release_lot(self, step: int, lot: list[int], micro_batches: Callable[[list[int]], Iterable], loss_fn, log: Log = print) -> ReleaseStats:
        """Release `lot` (drawn by `next_lot`) as step `step`, its micro-batches made by
        `micro_batches(lot)`. A re-run step whose saved randomness cannot reproduce its earlier
        release (ReplayMismatchError: the weights it saw changed) is redone from fresh secret
        randomness — a new lot and new noise, charged as a new release."""
        try:
            return self.release.release(micro_batches(lot), loss_fn, step)
        except ReplayMismatchError as err:
            log(f"{err}; redrawing lot and noise from fresh OS entropy (charged as a new release)")
            self.redraw_fresh()
            return self.release.release(micro_batches(self.next_lot()), loss_fn, step)

    def within_budget(self) -> bool:
        """Would one more release keep ε ≤ the target (privacy/plan.py)?"""
        return within_budget(self.release.accountant, self.plan)

    def budget_stop(self, step: int) -> str | None:
        """Why release `step` may not be made (the budget guard, said the same way by the driver,
        make_private and DPTrainer), or None when it may."""
        if self.within_budget():
            return None
        return f"budget guard: releasing step {step} would exceed ε={self.plan.target_epsilon:g} (ε spent {self.epsilon:.4f})"

    @property
    def epsilon(self) -> float | None:
        """ε spent so far, from the charged releases (None: non-private)."""
        return self.release.accountant.epsilon()

    def close(self) -> None:
        self.release.close()


def build_mechanism(
    model: nn.Module,
    dataset_size: int,
    settings: MechanismSettings,
    *,
    hidden_matrices: Mapping[str, str],
    user_secret: int | None,
    run_dir: Path | None,
    dataset_name: str,
    public_seed: int = 0,
    parallel: DataParallel = SINGLE,
    log: Log = print,
    example_lengths: Sequence[int] | None = None,
    max_length: int | None = None,
) -> Mechanism:
    """The mechanism for `model`'s trainable parameters over a data set of `dataset_size` examples.

    `hidden_matrices` (models.hidden_matrices) are the per-matrix blocks; `user_secret` the
    user's mechanism seed (privacy/seed.py; None: OS entropy); `run_dir` holds the ledger (None:
    no ledger, for timing and tests only); `dataset_name` names the private set in its header;
    `public_seed` drives only a non-private run's lots. `example_lengths` (each training
    example's tokens, none above `max_length`, the rows' width) let constant-time lots be
    bucketed by width (privacy.width_buckets); without them every row is one width.
    """
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    randomness = mechanism_randomness(user_secret, settings, parallel, public_seed, log)
    lengths = None
    if example_lengths is not None and max_length is not None and buckets_by_width(settings):
        lengths = length_release(example_lengths, max_length, float(settings.length_noise_multiplier), randomness, run_dir, parallel)
    # σ is calibrated with what the release's float noise costs, which grows with its size.
    plan = privacy_plan(settings, dataset_size, released_coordinates=sum(p.numel() for p in named.values()), lengths=lengths)
    ledger = open_ledger(run_dir, plan, dataset_name, parallel, lengths) if run_dir is not None else None
    say_plan(plan, log)
    # On an accelerator the host's cores idle while the lot's gradients are computed: the next
    # release's noise is drawn then (into page-locked buffers). On the CPU the same cores would
    # do both, and drawing ahead measured no faster (docs/performance.md).
    accelerated = any(p.device.type != "cpu" for p in named.values())
    noise = GaussianNoise(randomness.noise, secure=randomness.secure, ahead=accelerated, pin_memory=accelerated and torch.cuda.is_available())
    partition, release = build_release(model, named, hidden_matrices, plan, settings, noise, parallel, ledger, log)
    sampling = settings.sampling if plan.private else "poisson"
    sampler = build_lot_sampler(
        sampling, plan.dataset_size, plan.expected_lot_size, randomness.sampler, secure=randomness.secure, max_lot_size=plan.max_lot_size
    )
    return Mechanism(plan, randomness, ledger, partition, release, sampler, parallel)


def check_plan_inputs(settings: MechanismSettings, dataset_size: int) -> None:
    """The plan's checks that need only N (the lot, the steps, δ < 1/N, the accountant's range):
    callers run them before building or downloading a model."""
    plan_length(dataset_size, int(settings.expected_lot_size), settings.epochs, settings.steps)
    if settings.private:
        check_private_inputs(dataset_size, float(settings.target_epsilon), float(settings.delta), str(settings.accountant))


def buckets_by_width(settings: MechanismSettings) -> bool:
    """Whether constant-time lots are bucketed by width (given the examples' lengths)."""
    return settings.private and settings.constant_time and settings.sampling == "poisson" and int(settings.width_buckets) > 1


def length_release(
    example_lengths: Sequence[int], max_length: int, noise_multiplier: float, randomness: MechanismRandomness, run_dir: Path | None, parallel: DataParallel
) -> dict:
    """The length histogram's one release: {"noise_multiplier", "counts"} (counts[l]: examples of
    l tokens plus N(0, σ²), on the grid), read back from the ledger's header of a run that made
    it — a resume never draws it again — else drawn from the noise key's lengths domain (the OS
    CSPRNG in secure mode). Rank 0 reads or draws it and every rank gets it, or rank 0's refusal.
    open_ledger records it before it is used."""
    ledger = Path(run_dir) / LEDGER_FILE if run_dir is not None else None

    def read_or_draw() -> dict:
        header = ledger_header(ledger) if ledger is not None else None
        # Refused before a release is drawn that nothing would charge.
        if header is not None and header.get("kind") == "header" and not header.get("length_release"):
            raise UserError(
                f"cannot continue this run directory: {ledger} is a run whose rows were one width (it released no "
                "length histogram); continue it with width_buckets=1 (the driver: privacy.width_buckets=1), or start a new run directory"
            )
        stored = header.get("length_release") if header is not None else None
        if isinstance(stored, dict) and len(stored.get("counts", ())) != max_length + 1:  # its bounds hold for those lengths only
            raise UserError(
                f"cannot continue this run directory: {ledger} released the length histogram of examples up to "
                f"{len(stored.get('counts', ())) - 1} tokens, and this run's rows are {max_length} wide; continue it with the same width"
            )
        if stored is None:
            counts = torch.from_numpy(length_histogram(example_lengths, max_length))
            noise = GaussianNoise(randomness.length_stream(), secure=randomness.secure, threads=1)
            stored = {"noise_multiplier": noise_multiplier, "counts": noise.grid_release(counts, noise_multiplier).tolist()}
        return stored

    return parallel.on_main(read_or_draw)


def privacy_plan(settings: MechanismSettings, dataset_size: int, released_coordinates: int, lengths: dict | None = None) -> PrivacyPlan:
    """q, steps and σ, fixed before step 1; `lengths` the length histogram's release, if made."""
    widths, max_lot_size, truncation = lot_limit(settings, dataset_size, lengths)
    return make_plan(
        max_lot_size=max_lot_size,
        truncation_probability=truncation,
        released_coordinates=released_coordinates,
        widths=widths,
        length_noise_multiplier=None if lengths is None else float(lengths["noise_multiplier"]),
        private=settings.private,
        dataset_size=dataset_size,
        expected_lot_size=int(settings.expected_lot_size),
        epochs=settings.epochs,
        steps=settings.steps,
        target_epsilon=float(settings.target_epsilon),
        delta=float(settings.delta),
        accountant=str(settings.accountant),
        noise_multiplier=settings.noise_multiplier,
    )


def say_plan(plan: PrivacyPlan, log: Log = print) -> None:
    if not plan.private:
        log(f"NON-PRIVATE reference run: N={plan.dataset_size:,}, {plan.steps} steps, no clipping, no noise")
        return
    lengths = f"after the length histogram's release (σ={plan.length_noise_multiplier:g}), " if plan.length_noise_multiplier else ""
    widths = ", ".join(f"{rows}×{width}" for width, rows in plan.widths) if plan.widths else None
    log(
        f"privacy plan: N={plan.dataset_size:,}, q={plan.sample_rate:.5f}, {lengths}{plan.steps} steps, "
        f"σ={plan.noise_multiplier:.4f} → ε={plan.planned_epsilon:.4f} ≤ {plan.target_epsilon} at δ={plan.delta:g} "
        f"(δ·N={plan.delta_times_n:.3g}, {plan.accountant}; the float64 release of {plan.released_coordinates:,} "
        f"coordinates adds {(plan.steps + len(plan.prior)) * plan.slack.epsilon:.2g} to ε)"
        + (f"; constant-time lots of {plan.max_lot_size} rows" if plan.max_lot_size else "")
        + (f" in widths {widths} (rows×tokens)" if widths else "")
        + (f" (truncated w.p. {plan.truncation_probability:.2g} per step)" if plan.max_lot_size else "")
    )


def lot_limit(settings: MechanismSettings, dataset_size: int, lengths: dict | None = None) -> tuple[tuple[tuple[int, int], ...] | None, int | None, float]:
    """Constant-time lots: their widths ((width, rows) widest first; None: one width for all rows),
    the rows every step processes (B_max; None: lots as drawn) and the probability per step that a
    Poisson lot does not fit them (truncated: charged by the accountant). `lengths`: the length
    histogram's release, which the widths are chosen from."""
    if not (settings.private and settings.constant_time):
        return None, None, 0.0
    lot = int(settings.expected_lot_size)
    if settings.sampling != "poisson":  # shuffled lots all have the expected size
        return None, lot, 0.0
    q, steps = plan_length(dataset_size, lot, settings.epochs, settings.steps)
    if lengths is None:
        return None, *lot_bound(dataset_size, q, steps, float(settings.target_epsilon), float(settings.delta))
    widths, p = bucketed_lot_bound(
        lengths["counts"], float(lengths["noise_multiplier"]), dataset_size, q, steps,
        float(settings.target_epsilon), float(settings.delta), int(settings.width_buckets),
    )  # fmt: skip
    return widths, sum(rows for _, rows in widths), p


def mechanism_randomness(
    user_secret: int | None, settings: MechanismSettings, parallel: DataParallel = SINGLE, public_seed: int = 0, log: Log = print
) -> MechanismRandomness:
    """Secret lot and noise generators; all ranks share rank 0's (they must draw the same lots)."""
    secret = user_secret
    if secret is not None and secret < STRONG_SEED:
        log(WEAK_SEED_WARNING)
    if secret is None and not settings.private:
        # A non-private run's lots protect nothing: from the public seed, so that a public model
        # (scripts/pretrain_public.py) rebuilds bit for bit in a fresh checkout.
        secret = int.from_bytes(hashlib.sha256(f"dpmuon non-private lots {int(public_seed)}".encode()).digest(), "big")
    randomness = MechanismRandomness(secret, secure=bool(settings.secure_noise))
    share_rank0_randomness(randomness, parallel)
    return randomness


def share_rank0_randomness(randomness: MechanismRandomness, parallel: DataParallel) -> None:
    """Every rank takes rank 0's generator states: all ranks must draw the same lots."""
    if parallel.world_size > 1:
        randomness.load_state_dict(parallel.broadcast_object(randomness.state_dict() if parallel.is_main else None))


def open_ledger(run_dir: Path, plan: PrivacyPlan, dataset_name: str, parallel: DataParallel = SINGLE, lengths: dict | None = None) -> PrivacyLedger | None:
    """The run's privacy ledger in `run_dir` (rank 0 of a private run), created or continued;
    a new one's header records the length histogram's release `lengths`, if made."""
    if not plan.private:
        return None
    header = {
        "dataset": dataset_name,
        "dataset_size": plan.dataset_size,
        "delta": plan.delta,
        "accountant": plan.accountant,
        "release_slack": asdict(plan.slack),  # what each release costs beyond the ideal: ε from the ledger alone
        **({"length_release": lengths} if lengths is not None else {}),
    }
    opened: list[PrivacyLedger] = []  # rank 0's; its refusal is raised on every rank (on_main)

    def open_on_main() -> None:
        try:
            opened.append(PrivacyLedger(Path(run_dir) / LEDGER_FILE, header))
        except (LedgerMismatchError, LedgerIntegrityError) as err:
            raise UserError(f"cannot continue this run directory: {err}") from None

    parallel.on_main(open_on_main)
    return opened[0] if opened else None


def build_release(
    model: nn.Module,
    named: Mapping[str, nn.Parameter],
    matrices: Mapping[str, str],
    plan: PrivacyPlan,
    settings: MechanismSettings,
    noise: GaussianNoise,
    parallel: DataParallel = SINGLE,
    ledger: PrivacyLedger | None = None,
    log: Log = print,
) -> tuple[BlockPartition | None, Privatizer | NonPrivateRelease]:
    """The release of the plan: (partition, privatizer), or (None, the non-private release)."""
    if not plan.private:
        return None, NonPrivateRelease(model, parallel)
    sizes = {n: p.numel() for n, p in named.items()}
    partition = build_partition(
        named,
        clip_mode=settings.clip_mode,
        clip_norm=float(settings.clip_norm),
        threshold_rule=settings.threshold_rule,
        other_blocks=settings.other_blocks,
        matrix_names=matrices,
        sizes=sizes,
    )
    log(f"clipping: {settings.clip_mode}, {partition_summary(partition, sizes)}")
    privatizer = build_privatizer(
        model,
        partition,
        plan,
        noise,
        engine=settings.engine,
        engine_fallback=settings.engine_fallback,
        noise_allocation=settings.noise_allocation,
        parallel=parallel,
        ledger=ledger,
    )
    if privatizer.engine_note is not None:
        log(privatizer.engine_note)
    return partition, privatizer


def build_privatizer(
    model: nn.Module,
    partition: BlockPartition,
    plan: PrivacyPlan,
    noise: GaussianNoise,
    *,
    engine: str = default("engine"),
    engine_fallback: str = default("engine_fallback"),
    noise_allocation: str = default("noise_allocation"),
    parallel: DataParallel = SINGLE,
    ledger: PrivacyLedger | None = None,
) -> Privatizer:
    """The privatizer of a private plan over `partition`. Its accountant starts from the ledger's
    charged releases: ε spent always comes from there."""
    accountant = PrivacyAccountant(plan.delta, plan.accountant, plan.slack)
    history = ledger.charged_history() if ledger is not None else list(plan.prior)
    accountant.history = parallel.broadcast_object(history) if parallel.world_size > 1 else history
    accountant.prior_releases = len(plan.prior)  # in every history of this plan: the ledger's header, or as given here
    return Privatizer(
        model,
        partition,
        noise_multiplier=plan.noise_multiplier,
        expected_lot_size=plan.expected_lot_size,
        sample_rate=plan.sample_rate,
        accountant=accountant,
        noise=noise,
        noise_allocation=noise_allocation,
        engine=engine,
        engine_fallback=engine_fallback,
        parallel=parallel,
        ledger=ledger,
        constant_time=plan.max_lot_size is not None,
    )
