"""Empirical privacy auditing: a lower bound on ε from one training run with canaries. (Outside
the mechanism package, which it only uses.)

Method — "one run" auditing (Steinke, Nasr & Jagielski, "Privacy Auditing with One (1)
Training Run", NeurIPS 2023, arXiv:2305.08846): m canaries are each put into the training set
independently with probability 1/2; after training, an auditor guesses "in" for the canaries
with the highest scores (and, where that carries evidence, "out" for the lowest) and abstains
on the rest. If the training run is (ε, δ)-DP with respect to adding or removing one canary,
the number of correct guesses is (up to a δ term) stochastically dominated by the number of
correct guesses against ε-randomized response, Binomial(r, e^ε / (1 + e^ε)). Many correct
guesses therefore refute (ε, δ)-DP for every ε below some value: that value, at confidence
1 − β, is the empirical lower bound.

Setting — white-box canaries run through our mechanism end to end: the training loop's lot
sampler (`build_lot_sampler`, as the loop calls it) → Privatizer.release → SGD on p.grad.

- Dirac canaries (`model="dirac"`): K one-column embedding tables, each its own block; canary j
  owns row j of every table, so its gradient touches all K blocks and nothing else does.
  Cheap enough for 10⁵ canaries, which is what the power to catch a noise ÷ 2 break takes.
- GPT-2 canaries (`model="gpt2"`): a tiny GPT-2, every tensor its own block; canary j is a
  sequence of a token nobody else uses, so its token-embedding row is its alone. A sanity
  scenario for the fast engine on transformer layers; too few canaries for subtle breaks.

An excluded canary's slot stays in the data set as a blank (zero gradient): the release is
then exactly that of the data set without the canary, while the data-set size N — and with it
q = L/N, which the loop's sampler derives from N — stays public and the same in every run.

The auditor sees every released gradient (the object the DP guarantee covers) and the model,
so it knows each canary's clipped gradient c at each step. Its score is the log-likelihood
ratio "in" vs "out" of the releases along c: per step, the canary was sampled with probability
q if in, and the release along c is 1 + noise if sampled, noise otherwise — the Neyman–Pearson
test for one canary. Validity never depends on the score; only power does.

Layout: `bound` (the one-run bound and the auditor's score: statistics only), `canaries` (the
audited training runs, their scenarios and the deliberately broken mechanisms), `report`
(descriptions and tables).
"""

from .bound import (
    OneRunBound,
    audit_ceiling,
    count_correct,
    guess_counts,
    membership_guesses,
    one_run_audit,
    one_run_epsilon_lower_bound,
    one_run_p_value,
    per_test_confidence,
    randomized_response_accuracy,
    sampled_release_log_likelihood_ratio,
)
from .canaries import (
    BREAK_LABELS,
    BREAKS,
    METHOD,
    MODES,
    AuditResult,
    AuditSetup,
    DiracCanaries,
    GPT2Canaries,
    Seeds,
    audit_mechanism,
    break_settings,
    build_mechanism,
    draw_inclusion,
    expected_verdict,
    run_audits,
    train_and_score,
)
from .report import describe, format_markdown, format_table, table_rows

__all__ = [
    "BREAKS", "BREAK_LABELS", "METHOD", "MODES", "AuditResult", "AuditSetup", "DiracCanaries", "GPT2Canaries",
    "OneRunBound", "Seeds", "audit_ceiling", "audit_mechanism", "break_settings", "build_mechanism", "count_correct",
    "describe", "draw_inclusion", "expected_verdict", "format_markdown", "format_table", "guess_counts",
    "membership_guesses", "one_run_audit", "one_run_epsilon_lower_bound", "one_run_p_value", "per_test_confidence",
    "randomized_response_accuracy", "run_audits", "sampled_release_log_likelihood_ratio", "table_rows", "train_and_score",
]
