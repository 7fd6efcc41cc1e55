"""The length histogram's one release (constant-time lots bucketed by width): recorded in the
ledger's header before anything derived from it, charged before the steps in every ε the run or
a study reports, read back — never drawn again — on a resume, drawn from counters no step uses,
and refused against a ledger that did not record it."""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
from torch import nn

from dpmuon.errors import UserError
from dpmuon.eval.study import from_summary, read_run
from dpmuon.privacy.accountant import epsilon_after
from dpmuon.privacy.ledger import LEDGER_FILE
from dpmuon.privacy.lot_bound import allowed_log_tail
from dpmuon.privacy.mechanism import MechanismSettings, build_mechanism, privacy_plan
from dpmuon.privacy.randomness import LENGTHS_DOMAIN, MechanismRandomness, SecretStream

N, MAX_LENGTH = 3000, 100
LENGTHS = np.clip(np.random.default_rng(0).normal(53, 13, N).round(), 20, MAX_LENGTH).astype(int).tolist()
# σ given (a calibration takes seconds) and RDP (PRV's q = 1 is checked on its own below).
SETTINGS = MechanismSettings(
    delta=1e-5, expected_lot_size=64, steps=20, target_epsilon=8.0, noise_multiplier=1.0, length_noise_multiplier=2.0, accountant="rdp"
)


def mechanism(run_dir, settings=SETTINGS, secret=None, lengths=LENGTHS):
    model = nn.Sequential(nn.Linear(4, 3))
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    return build_mechanism(
        model, N, settings, hidden_matrices={"0.weight": "0.weight"}, user_secret=secret, run_dir=run_dir, dataset_name="lengths",
        log=lambda message: None, example_lengths=lengths, max_length=MAX_LENGTH,
    )  # fmt: skip


def header(run_dir) -> dict:
    return json.loads((run_dir / LEDGER_FILE).read_text().splitlines()[0])


def test_the_release_is_in_the_ledger_header_and_charged_before_the_steps(tmp_path):
    m = mechanism(tmp_path)
    plan, release = m.plan, header(tmp_path)["length_release"]
    assert release["noise_multiplier"] == 2.0 and len(release["counts"]) == MAX_LENGTH + 1
    assert plan.prior == ((2.0, 1.0, 1),) and m.ledger.charged_history() == [(2.0, 1.0, 1)]
    assert len(plan.widths) > 1 and sum(rows for _, rows in plan.widths) == plan.max_lot_size
    # The plan's ε charges the histogram: without it the same σ spends less.
    with_prior = epsilon_after(plan.noise_multiplier, plan.sample_rate, plan.steps, plan.delta, plan.accountant, plan.slack, plan.prior)
    without = epsilon_after(plan.noise_multiplier, plan.sample_rate, plan.steps, plan.delta, plan.accountant, plan.slack)
    assert plan.planned_epsilon == with_prior <= 8.0 and without < with_prior - 1e-3
    assert m.epsilon > 0  # before any step: the histogram alone


def test_a_resume_reads_the_release_back_and_never_draws_it_again(tmp_path):
    first = mechanism(tmp_path)
    again = mechanism(tmp_path)  # fresh OS entropy: a new draw would differ
    assert header(tmp_path)["length_release"] == json.loads(json.dumps(again.ledger.header["length_release"]))
    assert again.plan == first.plan and again.ledger.charged_history() == [(2.0, 1.0, 1)]
    elsewhere = mechanism(tmp_path / "other")
    assert header(tmp_path / "other")["length_release"]["counts"] != header(tmp_path)["length_release"]["counts"]
    assert elsewhere.plan.max_lot_size == first.plan.max_lot_size  # B_max needs only N


def test_a_ledger_without_the_release_is_not_continued_with_one_and_nothing_is_drawn_for_it(tmp_path, monkeypatch):
    one_width = MechanismSettings(**{**SETTINGS.__dict__, "width_buckets": 1})
    mechanism(tmp_path / "one", one_width)
    assert "length_release" not in header(tmp_path / "one")
    mechanism(tmp_path / "widths")
    # Refused before a histogram is drawn: a release made for a run that is then refused would be charged nowhere.
    monkeypatch.setattr(MechanismRandomness, "length_stream", lambda self: pytest.fail("a length release was drawn"))
    with pytest.raises(UserError, match=r"rows were one width \(it released no length histogram\); continue it with width_buckets=1"):
        mechanism(tmp_path / "one")
    # The other way round, the refusal names each side's release by its σ, never by its counts.
    with pytest.raises(UserError, match=r"records length_release=a length histogram release \(σ=2\), this run has no length histogram release$"):
        mechanism(tmp_path / "widths", one_width)


def test_a_release_for_other_widths_is_not_continued(tmp_path):
    mechanism(tmp_path)
    wider = lambda: build_mechanism(  # noqa: E731
        nn.Sequential(nn.Linear(4, 3)), N, SETTINGS, hidden_matrices={"0.weight": "0.weight"}, user_secret=None, run_dir=tmp_path,
        dataset_name="lengths", log=lambda message: None, example_lengths=LENGTHS, max_length=MAX_LENGTH + 8,
    )  # fmt: skip
    # Its bounds hold for examples up to MAX_LENGTH tokens: rows of another width would drop examples the charge never counted.
    with pytest.raises(UserError, match=rf"released the length histogram of examples up to {MAX_LENGTH} tokens, and this run's rows are {MAX_LENGTH + 8} wide"):
        wider()


def test_the_histogram_noise_shares_no_draw_with_the_steps():
    """Not even shifted: a domain in the counter's first word (the one Philox increments) gave the
    steps' draws again, four words later."""
    key = 12345
    steps = np.concatenate([SecretStream(key).normal_sources_at(draw, 2)[chunk](4096) for draw in range(3) for chunk in range(2)])
    lengths = SecretStream(key, domain=LENGTHS_DOMAIN).normal_sources_at(0)[0](MAX_LENGTH + 1)
    assert not np.isin(lengths, steps).any()


def test_no_release_without_lengths_or_constant_time(tmp_path):
    assert mechanism(tmp_path / "a", lengths=None).plan.prior == ()
    plan = mechanism(tmp_path / "b", MechanismSettings(**{**SETTINGS.__dict__, "constant_time": False})).plan
    assert plan.prior == () and plan.widths is None and "length_release" not in header(tmp_path / "b")


def test_prv_composes_the_release_of_every_example_as_google_dp_accounting_does():
    """q = 1 in Opacus' PRV (the histogram) next to the subsampled steps: within 1% of the PLD
    accountant of dp-accounting on the same composition."""
    history = ((2.0, 1.0, 1), (0.9, 0.02, 200))
    ours = epsilon_after(0.9, 0.02, 200, 1e-5, "prv", prior=history[:1])
    steps = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(0.9)), 200)
    event = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(2.0), steps])
    reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    reference.compose(event)
    assert ours == pytest.approx(reference.get_epsilon(1e-5), rel=1e-2)
    assert ours > epsilon_after(0.9, 0.02, 200, 1e-5, "prv") + 0.05


def test_a_study_charges_the_release_from_the_ledger_and_from_a_summary(tmp_path):
    m = mechanism(tmp_path / "run")
    assert read_run(tmp_path / "run").history == ((2.0, 1.0, 1),) and math.isfinite(m.epsilon)
    summary = {"dataset": "lengths", "dataset_size": N, "noise_multiplier": 0.9, "sample_rate": 0.02, "steps": 20, "delta": 1e-5}
    summary["length_noise_multiplier"] = 2.0
    assert from_summary(tmp_path, summary).history == ((2.0, 1.0, 1), (0.9, 0.02, 20))
    assert from_summary(tmp_path, {**summary, "length_noise_multiplier": None}).history == ((0.9, 0.02, 20),)


def test_a_calibrated_sigma_covers_the_release_too():
    """σ from the target: ε of the histogram and the steps together within the target and within
    the calibration's tolerance of it; the steps alone would have allowed a smaller σ."""
    plan = mechanism(None, MechanismSettings(**{**SETTINGS.__dict__, "noise_multiplier": None, "length_noise_multiplier": 1.0})).plan
    spent = epsilon_after(plan.noise_multiplier, plan.sample_rate, plan.steps, plan.delta, "rdp", plan.slack, plan.prior)
    assert 8.0 - 0.011 <= spent <= 8.0
    assert epsilon_after(plan.noise_multiplier * 0.97, plan.sample_rate, plan.steps, plan.delta, "rdp", plan.slack) <= 8.0


def test_what_the_plan_says_and_refuses_does_not_depend_on_the_counts_drawn():
    """The histogram is drawn before the ledger records it, so nothing the plan does between the
    two may depend on its counts: σ, ε and a refusal are the same for histograms far apart, since
    the widths' bad events always fit the share of δ set aside for them."""
    steep = [0.0] * MAX_LENGTH + [float(N)]  # every example as long as the rows
    flat = [N / (MAX_LENGTH + 1) + (-300.0 if i % 2 else 300.0) for i in range(MAX_LENGTH + 1)]  # and counts noise made negative
    plans = []
    for counts in (steep, flat, [0.0] * (MAX_LENGTH + 1)):
        lengths = {"noise_multiplier": 2.0, "counts": counts}
        plan = privacy_plan(SETTINGS, N, released_coordinates=15, lengths=lengths)
        assert plan.truncation_probability <= math.exp(allowed_log_tail(plan.steps, 8.0, 1e-5))
        plans.append((plan.noise_multiplier, plan.planned_epsilon))
        calibrated = privacy_plan(MechanismSettings(**{**SETTINGS.__dict__, "noise_multiplier": None}), N, 15, lengths)
        plans.append((calibrated.noise_multiplier, calibrated.planned_epsilon))
        with pytest.raises(UserError, match="this plan spends") as refused:  # a σ just below the calibrated one
            privacy_plan(MechanismSettings(**{**SETTINGS.__dict__, "noise_multiplier": calibrated.noise_multiplier * 0.98}), N, 15, lengths)
        plans.append(str(refused.value))
    assert plans[:3] == plans[3:6] == plans[6:]


def test_a_histogram_noise_that_spends_the_budget_alone_is_refused_by_its_key():
    with pytest.raises(UserError, match=r"privacy.length_noise_multiplier=0.2: .* spends ε=.* on its own"):
        mechanism(None, MechanismSettings(**{**SETTINGS.__dict__, "noise_multiplier": None, "length_noise_multiplier": 0.2}))


def test_the_default_release_costs_a_few_thousandths_of_epsilon_at_the_papers_scale():
    """σ = 20 (the default) before 1000 steps of E2E at lot 256 and σ = 0.5231 (PRV): the ε that
    docs/privacy.md quotes for the release, +0.0032 — more than nothing, less than 0.005."""
    steps = (0.5231, 256 / 42_057, 1000)
    added = epsilon_after(*steps, 8e-6, "prv", prior=((20.0, 1.0, 1),)) - epsilon_after(*steps, 8e-6, "prv")
    assert 0.002 < added < 0.005
