"""Empirical privacy auditing: a lower bound on ε from one training run with canaries.

Method — "one run" auditing (Steinke, Nasr & Jagielski, "Privacy Auditing with One (1)
Training Run", NeurIPS 2023, arXiv:2305.08846): m canaries are each put into the training set
independently with probability 1/2; after training, an auditor who sees only the trained model
guesses "in" for the canaries with the highest scores, "out" for those with the lowest, and
abstains on the rest. If the training run is (ε, δ)-DP with respect to adding or removing one
canary, the number of correct guesses is (up to a δ term) stochastically dominated by the
number of correct guesses against ε-randomized response, Binomial(r, e^ε / (1 + e^ε)). Many
correct guesses therefore refute (ε, δ)-DP for every ε below some value: that value, at
confidence 1 − β, is the empirical lower bound.

Setting — the white-box linear model of the auditing literature, run through our mechanism
end to end (PoissonLotSampler → Privatizer.release → SGD on p.grad): a bias-free linear model
whose input has one coordinate per canary ("Dirac canaries"). Canary j's gradient lives only
in its own coordinate and is far larger than the clip norm C, so every time it is sampled the
release adds exactly C there; ordinary training points live in the other coordinates and never
touch a canary's.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from scipy import stats
from scipy.special import expit
from torch import nn

from .accountant import PrivacyAccountant, calibrate_noise_multiplier
from .blocks import build_partition
from .noise import GaussianNoise
from .privatizer import Privatizer
from .sampling import PoissonLotSampler

BREAKS = ("none", "noise", "clip")
METHOD = "one-run audit (Steinke, Nasr & Jagielski 2023, (ε, δ) bound), white-box Dirac canaries"
# Release noise divided by this factor in the `noise` break (the accountant is still told σ).
NOISE_BREAK_FACTOR = 10.0
# The `clip` break's threshold, as a multiple of the canary gradient norm: never reached.
UNCLIPPED_HEADROOM = 1e3


# --- the bound -------------------------------------------------------------------------------


def randomized_response_accuracy(epsilon: float) -> float:
    """e^ε / (1 + e^ε): the highest probability that a membership guess against an ε-DP
    mechanism is right — the accuracy of ε-randomized response."""
    return float(expit(epsilon))


def one_run_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[≥ `correct` of `guesses` guesses are right] for an (ε, δ)-DP run.

    Steinke et al.'s theorem for (ε, δ)-DP, in the form the paper evaluates it:
    P[Binomial(r, p_ε) ≥ v] + 2mδ · max_{1≤i≤v} P[v − i ≤ Binomial(r, p_ε) < v] / i,
    with p_ε = e^ε/(1 + e^ε), m canaries, r guesses, v correct. δ = 0 leaves the pure-DP
    statement: the correct count is stochastically dominated by Binomial(r, p_ε).
    """
    _check_counts(canaries, guesses, correct)
    if not (epsilon >= 0 and 0 <= delta <= 1):
        raise ValueError(f"need ε ≥ 0 and δ ∈ [0, 1], got ε={epsilon}, δ={delta}")
    accuracy = randomized_response_accuracy(epsilon)
    tail = float(stats.binom.sf(correct - 1, guesses, accuracy))
    if delta == 0 or correct == 0:
        return min(1.0, tail)
    below = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, accuracy)  # P[v−1], P[v−2], …, P[0]
    alpha = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
    return min(1.0, tail + 2 * canaries * delta * alpha)


def _check_counts(canaries: int, guesses: int, correct: int) -> None:
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 ≤ correct ≤ guesses ≤ canaries, got {correct}, {guesses}, {canaries}")


def one_run_epsilon_lower_bound(
    canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95, tolerance: float = 1e-6
) -> float:
    """An ε the observation refutes at level 1 − confidence: the run is not (ε, δ)-DP.

    Bisection keeps p(lo) < β ≤ p(hi) and returns lo. Reporting any ℓ with p(ℓ) < β is valid
    whether or not p is monotone in ε: if the run is (ε*, δ)-DP it is (ε', δ)-DP for every
    ε' ≥ ε*, so ℓ > ε* can only happen when the observed count is one that the (ε*, δ) bound
    already declares less likely than β.
    """
    _check_counts(canaries, guesses, correct)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    beta = 1 - confidence

    def refuted(epsilon: float) -> bool:
        return one_run_p_value(canaries, guesses, correct, epsilon, delta) < beta

    if not refuted(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while refuted(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if refuted(mid) else (lo, mid)
    return lo


def membership_guesses(scores: np.ndarray, guesses: int) -> np.ndarray:
    """+1 ("in") for the ⌈r/2⌉ highest scores, −1 ("out") for the ⌊r/2⌋ lowest, 0 elsewhere.

    Both tails carry evidence: a high score that of the canary's clipped gradient, a low one
    that of its absence (pure noise); guessing on both sides makes more sure guesses than
    guessing deep into one tail.
    """
    if not 0 <= guesses <= len(scores):
        raise ValueError(f"cannot make {guesses} guesses about {len(scores)} canaries")
    order = np.argsort(scores, kind="stable")
    n_in = (guesses + 1) // 2
    n_out = guesses - n_in
    verdicts = np.zeros(len(scores), dtype=np.int8)
    verdicts[order[len(scores) - n_in :]] = 1
    verdicts[order[:n_out]] = -1
    return verdicts


def count_correct(verdicts: np.ndarray, included: np.ndarray) -> tuple[int, int]:
    """(correct guesses, guesses made); abstentions count as neither."""
    truth = np.where(included, 1, -1)
    made = verdicts != 0
    return int((verdicts[made] == truth[made]).sum()), int(made.sum())


@dataclass(frozen=True)
class OneRunBound:
    """The audit's verdict: the best of several pre-declared guess counts, Bonferroni-corrected."""

    epsilon: float  # the empirical lower bound
    confidence: float  # overall, after the correction
    canaries: int
    guesses: int  # of the guess count that gave the bound
    correct: int
    tests: int  # guess counts tried; each was tested at level (1 − confidence) / tests


def guess_counts(canaries: int, fractions: tuple[float, ...]) -> list[int]:
    """The pre-declared guess counts r = fraction · m (distinct, at least one guess each)."""
    return sorted({max(1, min(canaries, round(f * canaries))) for f in fractions})


def per_test_confidence(confidence: float, tests: int) -> float:
    """Bonferroni: K tests at level β/K each hold jointly at level β."""
    return 1 - (1 - confidence) / tests


def one_run_audit(
    scores: np.ndarray, included: np.ndarray, delta: float, confidence: float, fractions: tuple[float, ...]
) -> OneRunBound:
    """Guess at every pre-declared count, bound each at level β/K, report the largest.

    The maximum over K bounds is valid at level β by the union bound; a plain maximum over
    guess counts chosen after looking would not be.
    """
    canaries = len(scores)
    counts = guess_counts(canaries, fractions)
    level = per_test_confidence(confidence, len(counts))
    bounds = []
    for r in counts:
        correct, made = count_correct(membership_guesses(scores, r), included)
        epsilon = one_run_epsilon_lower_bound(canaries, made, correct, delta, level)
        bounds.append(OneRunBound(epsilon, confidence, canaries, made, correct, len(counts)))
    return max(bounds, key=lambda bound: bound.epsilon)


def audit_ceiling(canaries: int, delta: float, confidence: float, fractions: tuple[float, ...]) -> float:
    """The largest lower bound this design can ever report (every guess right): no claimed ε
    above it can be refuted, however broken the mechanism."""
    counts = guess_counts(canaries, fractions)
    level = per_test_confidence(confidence, len(counts))
    return max(one_run_epsilon_lower_bound(canaries, r, r, delta, level) for r in counts)


# --- the audited training run ----------------------------------------------------------------


@dataclass(frozen=True)
class AuditSetup:
    """Everything that fixes one audit; all of it is public (none depends on which canaries are in)."""

    canaries: int
    ordinary: int  # non-canary training points
    ordinary_dim: int  # input coordinates they live in
    expected_lot_size: float
    steps: int
    epsilon: float  # the claim: σ is calibrated to (ε, δ) for q and steps
    delta: float
    clip_norm: float = 0.1
    canary_norm: float = 10.0  # ‖canary gradient‖, ≫ clip_norm
    lr: float = 1.0
    accountant: str = "prv"
    engine: str = "opacus"
    confidence: float = 0.95
    guess_fractions: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.5, 0.9)
    micro_batch_size: int = 512
    seed: int = 0

    def __post_init__(self):
        if self.canary_norm <= self.clip_norm:
            raise ValueError(f"canary norm {self.canary_norm} must exceed the clip norm {self.clip_norm}")

    @property
    def nominal_size(self) -> float:
        """Expected training-set size (every canary in with probability 1/2). The sample rate is
        fixed from it, not from the realized size, which depends on the canaries."""
        return self.ordinary + self.canaries / 2

    @property
    def sample_rate(self) -> float:
        return self.expected_lot_size / self.nominal_size

    @property
    def input_dim(self) -> int:
        return self.ordinary_dim + self.canaries


# Each mode is a list of scenarios; every scenario audits the correct mechanism and both breaks.
# A one-run audit can refute a claim only up to its ceiling (roughly log of the number of
# guesses, lowered by the 2mδ term): ~1000 canaries reach ε ≈ 5, so the demonstration claims
# ε = 2. Refuting ε = 8 at δ = 1e-5 needs ~20000 canaries, a single pre-declared guess count
# (a Bonferroni split would cost more than the margin) and every one of 18000 guesses right —
# the ceiling there is 8.09; the 2mδ term keeps it below ~8.15 however many canaries are used.
MODES: dict[str, tuple[AuditSetup, ...]] = {
    "fast": (
        AuditSetup(canaries=1000, ordinary=500, ordinary_dim=16, expected_lot_size=100.0, steps=100, epsilon=2.0, delta=1e-5),
    ),
    "full": (
        AuditSetup(canaries=5000, ordinary=1000, ordinary_dim=32, expected_lot_size=350.0, steps=200, epsilon=2.0, delta=1e-5),
        AuditSetup(
            canaries=20000,
            ordinary=500,
            ordinary_dim=32,
            expected_lot_size=5250.0,  # q = 0.5: 30 steps put nearly every included canary in ≥ 5 lots
            steps=30,
            epsilon=8.0,
            delta=1e-5,
            guess_fractions=(0.9,),
            micro_batch_size=1024,
        ),
    ),
}


class ScaledGaussianNoise(GaussianNoise):
    """N(0, scale²) draws in place of N(0, 1): how a broken mechanism adds noise other than
    the block stds the privatizer computed (and the accountant was told about)."""

    def __init__(self, scale: float, generator: torch.Generator):
        super().__init__(generator)
        self.scale = scale

    def standard_normal(self, shape: torch.Size, device: torch.device, dtype=torch.float32) -> torch.Tensor:
        return self.scale * super().standard_normal(shape, device, dtype)


class CanaryData:
    """Ordinary points in the first `ordinary_dim` input coordinates; canary j, when included,
    is the input canary_norm · e_(ordinary_dim + j), alone in its coordinate."""

    def __init__(self, setup: AuditSetup, included: np.ndarray, generator: torch.Generator):
        # ‖x‖ ≈ 1 ≫ C: ordinary points are clipped too, like most examples in DP fine-tuning.
        self.ordinary = torch.randn(setup.ordinary, setup.ordinary_dim, generator=generator) / math.sqrt(setup.ordinary_dim)
        self.members = torch.from_numpy(np.flatnonzero(included))
        self.setup = setup

    def __len__(self) -> int:
        return len(self.ordinary) + len(self.members)

    def batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inputs for dataset positions `indices` (ordinary points first, then included canaries)."""
        setup = self.setup
        x = torch.zeros(len(indices), setup.input_dim)
        is_ordinary = indices < len(self.ordinary)
        x[is_ordinary, : setup.ordinary_dim] = self.ordinary[indices[is_ordinary]]
        canary_rows = torch.nonzero(~is_ordinary).squeeze(1)
        canary_ids = self.members[indices[~is_ordinary] - len(self.ordinary)]
        x[canary_rows, setup.ordinary_dim + canary_ids] = setup.canary_norm
        return {"x": x}


def linear_loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Per-example loss −⟨w, x⟩.

    Linear on purpose: its gradient −x does not depend on w, so a canary's gradient is the same
    at every step and, being longer than C, is clipped to exactly C in its own coordinate each
    time it is sampled. A curved loss (logistic, squared) would shrink the canary gradient once
    the model fits it — below C at some step the trajectory decides — and weaken the audit.
    """
    return -model(batch["x"]).squeeze(-1)


def build_mechanism(model: nn.Module, setup: AuditSetup, noise_multiplier: float, breakage: str, generator: torch.Generator) -> Privatizer:
    """The privatizer under audit; `breakage` picks a deliberately broken variant.

    noise: the release draws noise 10× smaller than the block stds say, while the accountant
    is still told σ — it claims the calibrated ε.
    clip: the threshold sits far above the canary norm (no clipping), while the noise stays
    σ·C, calibrated to the claimed sensitivity C: the noise source is scaled down by exactly
    the factor the privatizer scaled the std up by.
    """
    if breakage not in BREAKS:
        raise ValueError(f"unknown break {breakage!r}; valid: {', '.join(BREAKS)}")
    threshold, noise_scale = setup.clip_norm, 1.0
    if breakage == "noise":
        noise_scale = 1 / NOISE_BREAK_FACTOR
    elif breakage == "clip":
        threshold = setup.canary_norm * UNCLIPPED_HEADROOM
        noise_scale = setup.clip_norm / threshold
    names = [name for name, _ in model.named_parameters()]
    return Privatizer(
        model=model,
        partition=build_partition(names, clip_mode="flat", clip_norm=threshold),
        noise_multiplier=noise_multiplier,
        expected_lot_size=setup.expected_lot_size,
        sample_rate=setup.sample_rate,
        accountant=PrivacyAccountant(setup.delta, setup.accountant),
        noise=ScaledGaussianNoise(noise_scale, generator),
        engine=setup.engine,
    )


@dataclass(frozen=True)
class Seeds:
    """Independent streams: canary inclusion, data, lot sampling, release noise."""

    inclusion: int
    data: int
    sampling: int
    noise: int

    @classmethod
    def spawn(cls, seed: int) -> "Seeds":
        return cls(*(int(s) for s in np.random.SeedSequence(seed).generate_state(4)))


def draw_inclusion(canaries: int, seed: int) -> np.ndarray:
    """Each canary in with probability 1/2, independently: the S of the one-run theorem."""
    return np.random.default_rng(seed).random(canaries) < 0.5


def _micro_batches(data: CanaryData, lot: list[int], size: int) -> Iterator[dict[str, torch.Tensor]]:
    indices = torch.as_tensor(lot, dtype=torch.long)
    for start in range(0, len(indices), size):
        yield data.batch(indices[start : start + size])


def train_and_score(setup: AuditSetup, included: np.ndarray, noise_multiplier: float, breakage: str, seeds: Seeds) -> tuple[np.ndarray, float]:
    """Train with the mechanism under audit; return (canary scores, the accountant's ε).

    Score: canary j's final weight coordinate. Starting from w = 0 with plain SGD, it equals
    −lr · Σ_t g̃_t[j]: the white-box statistic of Steinke et al.'s DP-SGD audit (the released
    gradients summed along the canary direction over all steps), read off the final model.
    """
    data = CanaryData(setup, included, torch.Generator().manual_seed(seeds.data))
    model = nn.Linear(setup.input_dim, 1, bias=False)
    nn.init.zeros_(model.weight)
    privatizer = build_mechanism(model, setup, noise_multiplier, breakage, torch.Generator().manual_seed(seeds.noise))
    sampler = PoissonLotSampler(len(data), setup.sample_rate, torch.Generator().manual_seed(seeds.sampling))
    optimizer = torch.optim.SGD(model.parameters(), lr=setup.lr)  # post-processing of g̃
    try:
        for _ in range(setup.steps):
            privatizer.release(_micro_batches(data, sampler.next_lot(), setup.micro_batch_size), linear_loss)
            optimizer.step()
    finally:
        privatizer.close()
    scores = model.weight.detach()[0, setup.ordinary_dim :].double().numpy()
    return scores, privatizer.epsilon()


@dataclass(frozen=True)
class AuditResult:
    mechanism: str  # "correct" or the break
    engine: str
    claimed_epsilon: float  # the accountant's ε after the run
    delta: float
    noise_multiplier: float  # the calibrated σ the accountant was told
    bound: OneRunBound
    ceiling: float  # the largest bound this design could report
    seconds: float
    method: str = METHOD

    @property
    def detected(self) -> bool:
        return self.bound.epsilon > self.claimed_epsilon

    @property
    def verdict(self) -> str:
        return "DETECTED: lb > ε" if self.detected else "PASS: lb ≤ ε"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "detected": self.detected, "verdict": self.verdict}


def calibrated_noise_multiplier(setup: AuditSetup) -> float:
    return calibrate_noise_multiplier(setup.epsilon, setup.delta, setup.sample_rate, setup.steps, setup.accountant)


def audit_mechanism(setup: AuditSetup, breakage: str, noise_multiplier: float | None = None) -> AuditResult:
    """One audited training run of the correct (`none`) or a broken mechanism."""
    start = time.perf_counter()
    sigma = calibrated_noise_multiplier(setup) if noise_multiplier is None else noise_multiplier
    seeds = Seeds.spawn(setup.seed)
    included = draw_inclusion(setup.canaries, seeds.inclusion)
    scores, claimed = train_and_score(setup, included, sigma, breakage, seeds)
    bound = one_run_audit(scores, included, setup.delta, setup.confidence, setup.guess_fractions)
    return AuditResult(
        mechanism="correct" if breakage == "none" else f"broken: {breakage}",
        engine=setup.engine,
        claimed_epsilon=claimed,
        delta=setup.delta,
        noise_multiplier=sigma,
        bound=bound,
        ceiling=audit_ceiling(setup.canaries, setup.delta, setup.confidence, setup.guess_fractions),
        seconds=time.perf_counter() - start,
    )


def run_audits(setup: AuditSetup, breakages: tuple[str, ...] = BREAKS) -> list[AuditResult]:
    """Audit each mechanism on the same canaries, seeds and calibrated σ (calibrated once)."""
    sigma = calibrated_noise_multiplier(setup)
    return [audit_mechanism(setup, breakage, sigma) for breakage in breakages]


def expected_verdict(result: AuditResult) -> bool:
    """The correct mechanism must pass; a broken one must be caught wherever the design can."""
    if result.mechanism == "correct":
        return not result.detected
    return result.detected or result.ceiling <= result.claimed_epsilon


def describe(setup: AuditSetup) -> str:
    counts = guess_counts(setup.canaries, setup.guess_fractions)
    return (
        f"{setup.canaries} Dirac canaries (each in with prob. 1/2), {setup.ordinary} ordinary points, "
        f"q = {setup.sample_rate:.3g}, {setup.steps} steps, C = {setup.clip_norm:g}, canary norm {setup.canary_norm:g}, "
        f"engine {setup.engine}, seed {setup.seed}; claim ε = {setup.epsilon:g}, δ = {setup.delta:g}; "
        + (f"guess counts {counts}, each tested at level β/{len(counts)} (Bonferroni)" if len(counts) > 1 else f"one pre-declared guess count {counts}")
    )


def format_table(results: list[AuditResult]) -> str:
    header = ("mechanism", "engine", "claimed ε", "δ", "σ", "ε lower bound", "confidence", "correct/guesses", "ceiling", "verdict")
    rows = [
        (
            r.mechanism,
            r.engine,
            f"{r.claimed_epsilon:.3f}",
            f"{r.delta:.0e}",
            f"{r.noise_multiplier:.3f}",
            f"{r.bound.epsilon:.3f}",
            f"{r.bound.confidence:.0%}",
            f"{r.bound.correct}/{r.bound.guesses}",
            f"{r.ceiling:.2f}",
            r.verdict,
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
