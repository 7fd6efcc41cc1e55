"""`python -m dpmuon.privacy` checks every number before the accountant runs: one line naming the
flag and its valid range, exit 2, nothing on stdout — never a hang, a huge allocation or `null`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dpmuon.privacy.__main__ import PRV_GRID_LIMIT, main, prv_grid_points

BASE = {"--delta": "1e-5", "--sample-rate": "0.01", "--steps": "100"}


def refusal(capsys, **flags) -> str:
    argv = [part for key, value in (BASE | flags).items() for part in (key, value)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    return line


@pytest.mark.parametrize(
    ("flag", "value", "valid"),
    [
        ("--noise-multiplier", "nan", "a finite σ > 0"),
        ("--noise-multiplier", "inf", "a finite σ > 0"),
        ("--noise-multiplier", "-1", "a finite σ > 0"),
        ("--epsilon", "nan", "a finite ε > 0"),
        ("--epsilon", "inf", "a finite ε > 0"),
        ("--epsilon", "0", "a finite ε > 0"),
        ("--delta", "nan", "0 < δ < 1"),
        ("--delta", "1", "0 < δ < 1"),
        ("--delta", "0", "0 < δ < 1"),
        ("--sample-rate", "nan", "0 < q ≤ 1"),
        ("--sample-rate", "inf", "0 < q ≤ 1"),
        ("--sample-rate", "1.5", "0 < q ≤ 1"),
        ("--steps", "0", "an integer ≥ 1"),
    ],
)
def test_every_number_out_of_range_is_refused_in_one_line_naming_the_flag(capsys, flag, value, valid):
    flags = {flag: value} if flag in ("--noise-multiplier", "--epsilon") else {"--epsilon": "8", flag: value}
    line = refusal(capsys, **flags)
    assert line.startswith(f"error: {flag} ") and f"valid: {valid}" in line


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-2"])
def test_epochs_out_of_range_are_refused(capsys, value):
    argv = ["--epsilon", "8", "--delta", "1e-5", "--sample-rate", "0.01", "--epochs", value]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --epochs ") and "valid: a finite number > 0" in line


def test_no_noise_is_refused_as_no_guarantee_not_printed_as_null(capsys):
    line = refusal(capsys, **{"--noise-multiplier": "0"})
    assert "ε = ∞" in line and "valid: a finite σ > 0" in line


@pytest.mark.parametrize(("sigma", "steps"), [("1e-3", "100"), ("0.05", "100"), ("1", "1000000000")])
def test_a_grid_prv_cannot_build_is_refused_before_it_is_built(capsys, sigma, steps):
    """σ = 1e-3 asked Opacus for 84 GiB; 10⁹ steps for terabytes. The grid's size is known in
    milliseconds: refused with the way out (a larger σ, or RDP)."""
    assert prv_grid_points(float(sigma), 0.01, int(steps), 1e-5) > PRV_GRID_LIMIT
    line = refusal(capsys, **{"--noise-multiplier": sigma, "--steps": steps})
    assert line.startswith(f"error: --noise-multiplier {float(sigma):g}: too small for the PRV accountant") and "--accountant rdp" in line


def test_rdp_takes_a_tiny_sigma_and_prv_the_usual_ones(capsys):
    assert main([*sum(([k, v] for k, v in BASE.items()), []), "--noise-multiplier", "1e-3", "--accountant", "rdp"]) == 0
    assert '"epsilon": ' in capsys.readouterr().out
    assert prv_grid_points(0.6, 0.0243, 411, 8e-6) < PRV_GRID_LIMIT  # the E2E recipe
    assert prv_grid_points(1.0, 0.01, 100_000, 1e-5) < PRV_GRID_LIMIT


def test_prv_above_its_calibration_limit_is_refused(capsys):
    line = refusal(capsys, **{"--epsilon": "200"})
    assert line.startswith("error: --epsilon 200") and "--accountant rdp" in line


def test_nan_sigma_does_not_hang_the_command():
    done = subprocess.run(
        [sys.executable, "-m", "dpmuon.privacy", "--noise-multiplier", "nan", "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "10"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "error: --noise-multiplier nan: not a finite number > 0; valid: a finite σ > 0"
