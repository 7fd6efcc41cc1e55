"""The budget guard: a plan over budget never starts; a ledger never steps past the target."""

from __future__ import annotations

import pytest

from dpmuon.errors import UserError
from dpmuon.privacy import NullAccountant, PrivacyAccountant, epsilon_after
from dpmuon.privacy.plan import make_plan, within_budget

BASE = dict(private=True, dataset_size=10_000, expected_lot_size=100, epochs=None, steps=300, target_epsilon=3.0, delta=1e-5, accountant="prv")


def test_calibrated_plan_meets_the_target():
    plan = make_plan(**BASE, noise_multiplier=None)
    assert plan.planned_epsilon <= 3.0
    assert epsilon_after(plan.noise_multiplier, plan.sample_rate, plan.steps, 1e-5) == pytest.approx(plan.planned_epsilon)


def test_plan_over_budget_is_refused_with_the_overshoot():
    sigma = 0.6
    spent = epsilon_after(sigma, 0.01, 300, 1e-5)
    assert spent > 3.0
    with pytest.raises(UserError, match=rf"spends ε={spent:.4g} > target 3 \(over by {spent - 3:.3g}\)"):
        make_plan(**BASE, noise_multiplier=sigma)


def test_guard_allows_the_plan_and_nothing_beyond_it():
    plan = make_plan(**BASE, noise_multiplier=None)
    ledger = PrivacyAccountant(plan.delta, plan.accountant)
    for _ in range(plan.steps):
        assert within_budget(ledger, plan)
        ledger.step(plan.noise_multiplier, plan.sample_rate)
    assert ledger.epsilon() <= plan.target_epsilon
    # Past the plan every step is checked exactly: the ledger stops at the last step that
    # keeps ε ≤ target (calibration leaves at most its 0.01 tolerance unspent).
    extra = 0
    while within_budget(ledger, plan):
        ledger.step(plan.noise_multiplier, plan.sample_rate)
        extra += 1
    assert extra < 10
    assert ledger.epsilon() <= plan.target_epsilon < ledger.epsilon_with(1, plan.noise_multiplier, plan.sample_rate)


def test_guard_checks_a_foreign_ledger_exactly():
    plan = make_plan(**BASE, noise_multiplier=None)
    ledger = PrivacyAccountant(plan.delta, plan.accountant)
    for _ in range(50):
        ledger.step(0.5 * plan.noise_multiplier, plan.sample_rate)  # spent elsewhere, with less noise
    assert ledger.epsilon() > plan.target_epsilon
    assert not within_budget(ledger, plan)


def test_prv_beyond_its_largest_epsilon_is_refused_with_the_fix_instead_of_running_out_of_memory():
    from dpmuon.errors import UserError
    from dpmuon.privacy.plan import PRV_MAX_EPSILON

    kwargs = dict(private=True, dataset_size=42061, expected_lot_size=256, epochs=None, steps=100, delta=8e-6, noise_multiplier=None)
    with pytest.raises(UserError, match="privacy.accountant=rdp"):
        make_plan(target_epsilon=1024.0, accountant="prv", **kwargs)
    plan = make_plan(target_epsilon=1024.0, accountant="rdp", **kwargs)
    assert plan.planned_epsilon <= 1024.0 and plan.noise_multiplier > 0
    assert PRV_MAX_EPSILON >= 128  # the map's ε = 128 runs used PRV


def test_a_non_private_run_has_no_budget_to_exceed_and_reports_no_epsilon():
    plan = make_plan(**{**BASE, "private": False}, noise_multiplier=None)
    accountant = NullAccountant()
    assert within_budget(accountant, plan)
    assert accountant.epsilon() is None and accountant.steps is None  # "no guarantee", never ε = 0
