"""The privacy plan of a run, fixed before step 1: q, steps, σ, and the ε they reach.

The budget guard lives here: a plan whose ε exceeds the target is refused (with the overshoot),
impossible settings are rejected with one clear message, and every step is checked before it
is taken (`within_budget`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..errors import ConfigError, UserError
from .accountant import History, NullAccountant, PrivacyAccountant, ReleaseSlack, calibrate_noise_multiplier, epsilon_after, plan_steps
from .grid import release_slack

# The largest target ε the PRV accountant is used for: it calibrated ε = 128 (lot 256, 100 steps
# on E2E) without trouble, and was killed for memory at ε = 1024. RDP has no such limit.
PRV_MAX_EPSILON = 128.0


@dataclass(frozen=True)
class PrivacyPlan:
    private: bool
    dataset_size: int
    expected_lot_size: int
    sample_rate: float
    steps: int
    noise_multiplier: float
    target_epsilon: float | None
    delta: float | None
    accountant: str | None
    planned_epsilon: float | None
    # Constant-time lots (privacy.constant_time): every step processes this many rows, and a
    # Poisson lot above it is truncated — with this probability per step, charged in δ.
    max_lot_size: int | None = None
    truncation_probability: float = 0.0
    # Coordinates of each release: what the float64 grid noise costs (privacy/grid.py).
    released_coordinates: int = 0
    # Constant-time lots bucketed by width (privacy/lot_bound.py): (width, rows) widest first, and
    # σ of the length histogram released once before step 1 to choose them (None: one width, no
    # such release).
    widths: tuple[tuple[int, int], ...] | None = None
    length_noise_multiplier: float | None = None

    @property
    def prior(self) -> History:
        """The releases charged before step 1: the length histogram (sensitivity 1, q = 1), if any."""
        return ((self.length_noise_multiplier, 1.0, 1),) if self.length_noise_multiplier else ()

    @property
    def slack(self) -> ReleaseSlack:
        return plan_slack(self.released_coordinates, self.truncation_probability)

    @property
    def delta_times_n(self) -> float | None:
        """δ·N: the expected number of examples a mechanism with this δ could expose outright
        (E2E's δ = 8e-6 at N = 42,057 is 0.34); well below 1 is what makes δ meaningful."""
        return None if self.delta is None else self.delta * self.dataset_size

    def as_dict(self) -> dict:
        return {**asdict(self), "delta_times_n": self.delta_times_n}


def make_plan(
    *,
    private: bool,
    dataset_size: int,
    expected_lot_size: int,
    epochs: float | None,
    steps: int | None,
    target_epsilon: float,
    delta: float,
    accountant: str,
    noise_multiplier: float | None,
    max_lot_size: int | None = None,
    truncation_probability: float = 0.0,
    released_coordinates: int = 0,
    widths: tuple[tuple[int, int], ...] | None = None,
    length_noise_multiplier: float | None = None,
) -> PrivacyPlan:
    q, steps = plan_length(dataset_size, expected_lot_size, epochs, steps)
    if not private:
        return PrivacyPlan(False, dataset_size, expected_lot_size, q, steps, 0.0, None, None, None, None)
    check_private_inputs(dataset_size, target_epsilon, delta, accountant)
    slack = plan_slack(released_coordinates, truncation_probability)
    prior = ((length_noise_multiplier, 1.0, 1),) if length_noise_multiplier else ()
    if prior and not (alone := epsilon_after(1.0, q, 0, delta, accountant, slack, prior)) < target_epsilon:
        raise UserError(
            f"privacy.length_noise_multiplier={length_noise_multiplier:g}: the length histogram's release spends ε={alone:.4g} "
            f"on its own, leaving nothing of target ε={target_epsilon:g} for training; valid: a larger σ (the default 20 costs "
            "≈ 0.003 at ε = 8), or privacy.width_buckets=1 (no release)"
        )
    if noise_multiplier is None:
        sigma = calibrate_noise_multiplier(target_epsilon, delta, q, steps, accountant, slack, prior)
    else:
        sigma = float(noise_multiplier)
        if sigma <= 0:
            raise UserError(f"privacy.noise_multiplier must be > 0 for a private run, got {sigma}")
    planned = epsilon_after(sigma, q, steps, delta, accountant, slack, prior)
    if not planned <= target_epsilon:  # also refuses a NaN ε
        raise UserError(
            f"this plan spends ε={planned:.4g} > target {target_epsilon:g} (over by {planned - target_epsilon:.3g}): "
            f"σ={sigma:g}, q={q:.4g}, {steps} steps, δ={delta:g}"
            + (f", after the length histogram's release (σ={length_noise_multiplier:g})" if prior else "")
            + ". Raise the noise multiplier (or leave it null to calibrate), or train fewer steps"
        )
    return PrivacyPlan(
        True, dataset_size, expected_lot_size, q, steps, sigma, target_epsilon, delta, accountant, planned,
        max_lot_size, truncation_probability, released_coordinates, widths, length_noise_multiplier,
    )  # fmt: skip


def plan_slack(released_coordinates: int, truncation_probability: float) -> ReleaseSlack:
    """What each release costs beyond the ideal subsampled Gaussian: its float64 grid noise and the
    chance that a constant-time lot was truncated."""
    return release_slack(released_coordinates) + ReleaseSlack(bad_event=truncation_probability)


def check_private_inputs(dataset_size: int, target_epsilon: float, delta: float, accountant: str) -> None:
    """The checks of a private plan that need only N: before any model is built or downloaded."""
    if not target_epsilon > 0:
        raise UserError(f"privacy.target_epsilon must be > 0, got {target_epsilon}")
    if not 0 < delta < 1 / dataset_size:
        raise UserError(
            f"privacy.delta={delta:g} must be in (0, 1/N) = (0, {1 / dataset_size:.3g}) for N={dataset_size}: "
            "a δ of 1/N or more allows releasing an example outright"
        )
    if accountant == "prv" and target_epsilon > PRV_MAX_EPSILON:
        raise UserError(
            f"privacy.target_epsilon={target_epsilon:g} is beyond what the PRV accountant can calibrate here "
            f"(its privacy-loss grid grows with ε: at ε = 1024 Opacus' PRV ran out of 24 GB); use "
            f"privacy.accountant=rdp above ε = {PRV_MAX_EPSILON:g}"
        )


def plan_length(dataset_size: int, expected_lot_size: int, epochs: float | None, steps: int | None) -> tuple[float, int]:
    """(q, steps) of a plan: the sample rate, and the steps given or ⌈epochs/q⌉."""
    if dataset_size <= 0:
        raise UserError("the training set is empty")
    if not 0 < expected_lot_size <= dataset_size:
        raise ConfigError(
            "privacy.expected_lot_size", expected_lot_size, f"not in [1, N={dataset_size}] (N: the training examples)", f"an integer in [1, {dataset_size}]"
        )
    q = expected_lot_size / dataset_size
    if steps is None:
        if epochs is None or epochs <= 0:
            raise UserError(f"trainer.epochs must be > 0 (got {epochs}) unless trainer.steps is set")
        steps = plan_steps(epochs, q)
    if steps < 1:
        raise UserError(f"trainer.steps must be >= 1, got {steps}")
    return q, steps


def check_resume_compatible(stored: dict, current: PrivacyPlan) -> None:
    """A resumed run must continue the same mechanism: same N, q, σ, δ, accountant."""
    keys = ("private", "dataset_size", "sample_rate", "noise_multiplier", "delta", "accountant", "steps", "max_lot_size", "widths", "length_noise_multiplier")
    for key in keys:
        old, new = _as_lists(stored.get(key)), _as_lists(getattr(current, key))
        same = old == new or (isinstance(old, float) and isinstance(new, float) and math.isclose(old, new, rel_tol=1e-12))
        if not same:
            raise UserError(f"cannot resume: the stored run has {key}={old!r}, this configuration gives {new!r}")


def _as_lists(value):
    """Tuples as lists, at any depth: a plan stored as JSON or by torch compares to the live one."""
    return [_as_lists(v) for v in value] if isinstance(value, (list, tuple)) else value


def within_budget(accountant: PrivacyAccountant | NullAccountant, plan: PrivacyPlan) -> bool:
    """Would one more release keep ε ≤ target?

    While the ledger is the plan's own — its prior releases, then (σ, q) — and stays within its
    steps, ε is bounded by the planned ε, which make_plan verified: no accountant call needed.
    Anything else (a ledger from elsewhere) is checked exactly.
    """
    if not plan.private:  # nothing is charged, so there is no budget to exceed
        return True
    history = accountant.history
    prior = list(plan.prior)
    steps = history[len(prior) :] if history[: len(prior)] == prior else None
    on_plan = steps is not None and all((s, q) == (plan.noise_multiplier, plan.sample_rate) for s, q, _ in steps)
    if on_plan and sum(n for _, _, n in steps) + 1 <= plan.steps:
        return True
    return accountant.epsilon_with(1, plan.noise_multiplier, plan.sample_rate) <= plan.target_epsilon
