"""Random-stopping tuning: the Papernot–Steinke bound, and the tuning driver (studies/tune_private.py) end to end."""

from __future__ import annotations

import itertools
import json
import math
import shlex
import sys
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import dp_event

from dpmuon.privacy import epsilon_after
from dpmuon.privacy.accountant import RDP_ORDERS
from dpmuon.privacy.tuning import TruncatedNegativeBinomial, base_rdp, tuned_rdp, tuning_bound
from dpmuon.privacy.tuning import main as tuning_main
from dpmuon.training.secret import MECHANISM_SEED_ENV
from studies import tune_private

torch.set_num_threads(1)

# The committed E2E recipe (results/e2e/runs): σ, q and steps of one final run at ε = 8.
E2E = (0.430145263671875, 0.006086398326240461, 100)
E2E_DELTA = 8e-6


# --- the distribution of K --------------------------------------------------------------------


@pytest.mark.parametrize("eta", [-0.5, 0.0, 1.0, 3.0])
@pytest.mark.parametrize("mean", [1.5, 5.0, 20.0])
def test_the_distribution_with_a_given_mean_has_that_mean(eta, mean):
    distribution = TruncatedNegativeBinomial.with_mean(mean, eta)
    assert distribution.mean == pytest.approx(mean, rel=1e-9)
    probabilities = list(itertools.islice(distribution.probabilities(), 100_000))
    assert sum(probabilities) == pytest.approx(1.0, abs=1e-9)
    assert sum(k * p for k, p in enumerate(probabilities, start=1)) == pytest.approx(mean, rel=1e-6)


def test_eta_one_is_the_geometric_distribution():
    distribution = TruncatedNegativeBinomial(1.0, 0.2)
    head = list(itertools.islice(distribution.probabilities(), 10))
    assert head == pytest.approx([0.2 * 0.8 ** (k - 1) for k in range(1, 11)], rel=1e-12)


def test_sampled_trials_follow_the_distribution():
    distribution = TruncatedNegativeBinomial.with_mean(5.0, 1.0)
    draws = [distribution.sample() for _ in range(20_000)]
    assert min(draws) >= 1
    assert np.mean(draws) == pytest.approx(5.0, abs=0.25)  # standard error ≈ 0.03


# --- the bound --------------------------------------------------------------------------------


def test_theorem_2_by_hand_for_the_gaussian_mechanism():
    """Gaussian mechanism (q = 1, one step): RDP λ/(2σ²). With geometric K (η = 1, γ), the λ̂
    term (λ̂ − 1)/(2σ²) + log(1/γ)/λ̂ is minimal at λ̂* = √(2σ² log(1/γ)), where it equals
    2√(log(1/γ)/(2σ²)) − 1/(2σ²); so ε′(λ) = λ/(2σ²) + 2·that + log(1/γ)/(λ − 1)."""
    sigma, gamma, lam = 2.0, 0.1, 5.0
    a, b = 2 * sigma**2, math.log(1 / gamma)
    assert math.sqrt(a * b) > 1  # λ̂* is an admissible order
    by_hand = lam / a + 2 * (2 * math.sqrt(b / a) - 1 / a) + math.log(1 / gamma) / (lam - 1)
    assert by_hand == pytest.approx(3.0966, abs=1e-4)

    orders = [1 + k / 1000 for k in range(1, 20_001)]  # fine enough to find λ̂* to 1e-3
    rdp = base_rdp([(sigma, 1.0, 1)], orders)
    assert rdp == pytest.approx([order / a for order in orders], rel=1e-9)
    tuned = tuned_rdp(orders, rdp, TruncatedNegativeBinomial(1.0, gamma))
    assert tuned[orders.index(lam)] == pytest.approx(by_hand, abs=1e-5)


@pytest.mark.parametrize("eta", [-0.5, 0.0, 1.0, 3.0])
def test_pure_dp_inputs_give_the_corollary_2_plus_eta_times_epsilon(eta):
    """ε-DP base (RDP ε at every order): as λ, λ̂ → ∞ the tuned procedure is (2 + η)ε-DP."""
    epsilon = 0.7
    orders = [2.0, 10.0, 1e3, 1e5, 1e7]
    tuned = tuned_rdp(orders, [epsilon] * len(orders), TruncatedNegativeBinomial.with_mean(10.0, eta))
    assert tuned[-1] == pytest.approx((2 + eta) * epsilon, abs=1e-4)
    assert np.all(np.diff(tuned) < 0)  # lower orders only pay more for log E[K]/(λ − 1)


def test_tuning_costs_more_than_one_run():
    bound = tuning_bound([[E2E]], E2E_DELTA, TruncatedNegativeBinomial.with_mean(5.0, 1.0))
    assert bound.base_epsilon == pytest.approx(epsilon_after(*E2E, E2E_DELTA))
    assert bound.epsilon > bound.base_epsilon_rdp > bound.base_epsilon


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_the_bound_grows_with_the_expected_number_of_trials(eta):
    bounds = [tuning_bound([[E2E]], E2E_DELTA, TruncatedNegativeBinomial.with_mean(m, eta)).epsilon for m in (1.5, 2, 5, 10, 20)]
    assert np.all(np.diff(bounds) > 0)


def test_the_bound_uses_the_worst_trial():
    short, full = [(E2E[0], E2E[1], 50)], [E2E]
    distribution = TruncatedNegativeBinomial.with_mean(5.0, 0.0)
    assert tuning_bound([short, full], E2E_DELTA, distribution).epsilon == tuning_bound([full], E2E_DELTA, distribution).epsilon


@pytest.mark.parametrize("eta", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("mean", [2.0, 10.0])
def test_the_bound_agrees_with_google_dp_accounting(eta, mean):
    """dp-accounting's RepeatAndSelect event implements the same theorem independently; its
    subsampled-Gaussian RDP differs from Opacus' in the third decimal, hence the tolerance."""
    sigma, q, steps = E2E
    event = dp_event.RepeatAndSelectDpEvent(
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps), mean, eta
    )
    reference = dp_accounting.rdp.RdpAccountant(orders=list(RDP_ORDERS))
    reference.compose(event)
    ours = tuning_bound([[E2E]], E2E_DELTA, TruncatedNegativeBinomial.with_mean(mean, eta)).epsilon
    assert ours == pytest.approx(reference.get_epsilon(E2E_DELTA), rel=2e-3)


def test_the_bound_from_the_command_line(capsys):
    args = ["--noise-multiplier", str(E2E[0]), "--sample-rate", str(E2E[1]), "--steps", str(E2E[2]), "--delta", str(E2E_DELTA)]
    assert tuning_main([*args, "--mean-trials", "5", "--eta", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["epsilon"] == pytest.approx(tuning_bound([[E2E]], E2E_DELTA, TruncatedNegativeBinomial.with_mean(5, 1)).epsilon)
    assert out["mean_trials"] == pytest.approx(5) and out["base_epsilon"] < out["epsilon"]
    assert tuning_main([*args, "--mean-trials", "1"]) == 2
    assert "must be > 1" in capsys.readouterr().err


# --- studies/tune_private.py with a fake trainer ----------------------------------------------

FAKE_SIGMA, FAKE_Q, FAKE_STEPS, FAKE_DELTA = 1.0, 0.01, 20, 1e-5
FAKE_TRAINER = f"""
import json, math, sys
from pathlib import Path
args = dict(arg.split("=", 1) for arg in sys.argv[1:])
run = Path(args["hydra.run.dir"])
lr = float(args["optimizer.lr"])
private = args.get("optimizer") != "adam"
sigma = {FAKE_SIGMA} if private else 0.0
header = {{"kind": "header", "format": 1, "dataset": "e2e", "dataset_size": 1000,
           "data_fingerprint": "f" * 64, "delta": {FAKE_DELTA}, "accountant": "prv"}}
lines = [header] + [{{"kind": "release", "step": s, "noise_multiplier": sigma, "sample_rate": {FAKE_Q},
                      "release_sha256": str(s), "charged": True}} for s in range({FAKE_STEPS})]
(run / "privacy_ledger.jsonl").write_text("".join(json.dumps(line) + "\\n" for line in lines))
val_nll = None if args.get("fake.diverge") == "yes" else 1 + (math.log10(lr) + 2) ** 2
(run / "summary.json").write_text(json.dumps({{"val_nll": val_nll, "argv": sys.argv[1:]}}))
"""


@pytest.fixture
def fake_trainer(tmp_path: Path) -> str:
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAINER)
    return shlex.join([sys.executable, str(script)])


def tune(out: Path, trainer: str, *args: str) -> int:
    return tune_private.main(["--out", str(out), "--train-command", trainer, "--lr-grid", "0.001,0.01,0.1", *args])


def test_random_stopping_end_to_end(tmp_path: Path, fake_trainer: str, capsys):
    out = tmp_path / "tune"
    assert tune(out, fake_trainer, "--mean-trials", "3", "--eta", "1", "experiment=pretrained_tiny_e2e", "optimizer=dp_adam") == 0
    summary = json.loads((out / "tuning_summary.json").read_text())
    secret = summary["secret"]
    candidates = secret["candidates"]
    assert secret["trials"] == len(candidates) == len(list(out.glob("trial_*"))) >= 1
    assert "keep this object private" in secret["note"]

    best = min(candidates, key=lambda c: (c["val_nll"], c["index"]))
    assert summary["chosen"]["run_dir"] == best["run_dir"] and "index" not in summary["chosen"]
    assert summary["chosen"]["val_nll"] == best["val_nll"]
    for candidate in candidates:
        argv = json.loads((Path(candidate["run_dir"]) / "summary.json").read_text())["argv"]
        assert candidate["hyperparameters"]["optimizer.lr"] in ("0.001", "0.01", "0.1")
        assert {"experiment=pretrained_tiny_e2e", "optimizer=dp_adam", "eval.test=false", f"seed={candidate['seed']}"} <= set(argv)
    assert len({c["seed"] for c in candidates}) == len(candidates) or len(candidates) > 20  # fresh seeds

    expected = tuning_bound([[(FAKE_SIGMA, FAKE_Q, FAKE_STEPS)]], FAKE_DELTA, TruncatedNegativeBinomial.with_mean(3, 1))
    assert summary["private_selection"] is True and summary["delta"] == FAKE_DELTA
    assert summary["epsilon"] == pytest.approx(expected.epsilon)
    assert summary["base_epsilon"] == pytest.approx(epsilon_after(FAKE_SIGMA, FAKE_Q, FAKE_STEPS, FAKE_DELTA))
    assert summary["epsilon"] > summary["base_epsilon"]
    assert "ε =" in capsys.readouterr().out


def test_fixed_trials_are_composed_and_marked_not_private_selection(tmp_path: Path, fake_trainer: str):
    out = tmp_path / "tune"
    assert tune(out, fake_trainer, "--fixed-trials", "3") == 0
    summary = json.loads((out / "tuning_summary.json").read_text())
    assert summary["trials"] == 3 and len(summary["candidates"]) == 3 and "secret" not in summary
    assert summary["private_selection"] is False and "NOT private selection" in summary["procedure"]
    assert summary["epsilon"] == pytest.approx(epsilon_after(FAKE_SIGMA, FAKE_Q, 3 * FAKE_STEPS, FAKE_DELTA))


def test_a_diverged_trial_is_never_chosen_and_none_scored_fails(tmp_path: Path, fake_trainer: str, capsys):
    out = tmp_path / "tune"
    assert tune(out, fake_trainer, "--fixed-trials", "2", "--param", "fake.diverge=yes") == 1
    assert json.loads((out / "tuning_summary.json").read_text())["chosen"] is None
    assert "no trial produced a finite val_nll" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--param", "privacy.noise_multiplier=1,2"], "cannot search over 'privacy.noise_multiplier'"),
        (["--lr-key", "trainer.steps"], "cannot search over 'trainer.steps'"),
        (["seed=3"], "the tuner sets 'seed'"),
        (["privacy.mechanism_seed=1"], "same noise"),
        (["--param", "broken"], "expected KEY=V1,V2"),
        (["--mean-trials", "0.5"], "must be > 1"),
    ],
    ids=["mechanism-param", "steps-key", "seed", "mechanism-seed", "bad-param", "mean"],
)
def test_refuses_what_would_break_the_guarantee(tmp_path: Path, fake_trainer: str, capsys, args, message):
    trials = [] if "--mean-trials" in args else ["--fixed-trials", "1"]
    assert tune(tmp_path / "tune", fake_trainer, *trials, *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "tune").exists()  # refused before any training


def test_refuses_a_mechanism_seed_in_its_environment_that_every_trial_would_inherit(tmp_path: Path, fake_trainer: str, capsys, monkeypatch):
    monkeypatch.setenv(MECHANISM_SEED_ENV, str(1 << 100))
    assert tune(tmp_path / "tune", fake_trainer, "--fixed-trials", "1") == 2
    assert f"{MECHANISM_SEED_ENV} is set" in capsys.readouterr().err and not (tmp_path / "tune").exists()


def test_refuses_a_used_folder_and_non_private_trials(tmp_path: Path, fake_trainer: str, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "old").write_text("")
    assert tune(used, fake_trainer, "--fixed-trials", "1") == 2
    assert "not empty" in capsys.readouterr().err
    assert tune(tmp_path / "np", fake_trainer, "--fixed-trials", "1", "optimizer=adam") == 2
    assert "without noise" in capsys.readouterr().err
