"""Accounting: calibrated σ checked against an independent accountant (Google's dp-accounting)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import dp_accounting
import pytest

from dpmuon.privacy import PrivacyAccountant, calibrate_noise_multiplier, epsilon_after, plan_steps

E2E_Q = 1024 / 42061
DART_Q = 1024 / 62659


def independent_epsilon(sigma: float, q: float, steps: int, delta: float, accountant: str) -> float:
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    if accountant == "prv":  # PRV and PLD are both numerically tight: they must agree
        ledger = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    else:
        ledger = dp_accounting.rdp.RdpAccountant(orders=[1 + x / 10.0 for x in range(1, 100)] + list(range(12, 256)))
    ledger.compose(event)
    return ledger.get_epsilon(delta)


SETTINGS = [
    pytest.param(E2E_Q, plan_steps(10, E2E_Q), 8e-6, id="e2e-recipe"),
    pytest.param(DART_Q, plan_steps(15, DART_Q), 1e-5, id="dart-recipe"),
    pytest.param(0.01, 500, 1e-5, id="q0.01-T500"),
    pytest.param(0.25, 40, 1e-5, id="q0.25-T40"),
]


@pytest.mark.parametrize("q,steps,delta", SETTINGS)
@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_calibrated_sigma_meets_target_per_independent_accountant(q, steps, delta, accountant):
    sigma = calibrate_noise_multiplier(8.0, delta, q, steps, accountant)
    ours = epsilon_after(sigma, q, steps, delta, accountant)
    theirs = independent_epsilon(sigma, q, steps, delta, accountant)
    assert ours <= 8.0
    assert ours == pytest.approx(8.0, rel=0.01)  # calibration is tight, not merely safe
    assert ours == pytest.approx(theirs, rel=0.01)


def test_e2e_recipe_plan():
    assert plan_steps(10, E2E_Q) == 411
    assert plan_steps(2, 0.5) == 4


def test_smaller_sigma_would_overspend():
    """The calibrated σ is (nearly) the smallest that meets the target: a 3% smaller σ fails."""
    steps = plan_steps(10, E2E_Q)
    sigma = calibrate_noise_multiplier(8.0, 8e-6, E2E_Q, steps)
    assert independent_epsilon(0.97 * sigma, E2E_Q, steps, 8e-6, "prv") > 8.0


def test_accountant_matches_closed_form_and_merges_steps():
    acc = PrivacyAccountant(delta=1e-5)
    assert acc.epsilon() == 0.0
    for _ in range(100):
        acc.step(1.1, 0.02)
    assert acc.history == [(1.1, 0.02, 100)]
    assert acc.epsilon() == pytest.approx(epsilon_after(1.1, 0.02, 100, 1e-5))
    assert acc.epsilon_with(50, 1.1, 0.02) == pytest.approx(epsilon_after(1.1, 0.02, 150, 1e-5))
    acc.step(2.0, 0.02)  # a changed σ starts a new segment: heterogeneous composition
    assert len(acc.history) == 2
    assert acc.epsilon() > epsilon_after(1.1, 0.02, 100, 1e-5)


def test_epsilon_grows_with_steps_and_shrinks_with_noise():
    assert epsilon_after(1.0, 0.02, 200, 1e-5) > epsilon_after(1.0, 0.02, 100, 1e-5)
    assert epsilon_after(2.0, 0.02, 100, 1e-5) < epsilon_after(1.0, 0.02, 100, 1e-5)
    assert epsilon_after(0.0, 0.02, 100, 1e-5) == math.inf


@pytest.mark.parametrize("kwargs,message", [({"target_epsilon": 0}, "epsilon"), ({"delta": 1.0}, "delta"), ({"sample_rate": 1.5}, "sample rate")])
def test_impossible_settings_are_rejected(kwargs, message):
    args = {"target_epsilon": 8.0, "delta": 1e-5, "sample_rate": 0.01, "steps": 100} | kwargs
    with pytest.raises(ValueError, match=message):
        calibrate_noise_multiplier(**args)


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_cli_prints_calibrated_sigma_as_json(accountant):
    out = subprocess.run(
        [sys.executable, "-m", "dpmuon.privacy", "--epsilon", "8", "--delta", "8e-6", "--sample-rate", "0.0243", "--steps", "411", "--accountant", accountant],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["accountant"] == accountant and result["steps"] == 411
    assert result["epsilon"] <= 8.0
    assert result["epsilon"] == pytest.approx(independent_epsilon(result["noise_multiplier"], 0.0243, 411, 8e-6, accountant), rel=0.01)


def test_cli_rejects_bad_input_with_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "dpmuon.privacy", "--epsilon", "-1", "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "10"], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error:") and "Traceback" not in out.stderr
