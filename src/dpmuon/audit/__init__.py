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
1 − β, is the empirical lower bound. The f-DP version (Mahloujifar, Melis & Chaudhuri, ICML
2025; `fdp`) tests a whole trade-off curve instead of one (ε, δ) point: the accountant's own
privacy profile (the audit's verdict), and μ-Gaussian DP (a lower bound μ̂ with no ceiling).

Setting — white-box canaries run through our mechanism end to end: the training loop's lot
sampler (`build_lot_sampler`, as privacy/mechanism.py calls it) → Privatizer.release → SGD on p.grad.

- Dirac canaries (`model="dirac"`): K one-column embedding tables, each its own block; canary j
  owns row j of every table, so its gradient touches all K blocks and nothing else does.
  Cheap enough for 10⁵ canaries, which is what the power to catch a noise ÷ 2 break takes.
- Block canaries (`model="blocks"`): canary j owns one coordinate in every block type — an
  embedding row, a hidden Linear entry, a LayerNorm weight and bias entry, an RMSNorm weight
  entry, an untied head entry — so every layer rule of the engine is audited (a Linear norm
  kernel 10× low is invisible to embedding canaries). The mutation audit's world.
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

Four white-box conformance checks ride along (not privacy bounds): the released noise std on
the coordinates of canaries not drawn in a step (pure noise under the claim); the lots' total
size against Binomial(N·T, q); and independence across steps — the noise of every pair of
steps uncorrelated on their common pure-noise coordinates (an exact Student-t test), and no two
lots sharing more examples than Binomial(N, q²) allows. They catch what one run cannot: noise
a few percent low, lots drawn at the wrong rate, a noise draw or a lot reused (ε = ∞, or far
above the claim, though every single release looks right; results/audit/README.md).

Layout: `bound` (the (ε, δ) one-run bound and the auditor's score: statistics only), `fdp` (the
f-DP and Gaussian-DP tests: statistics only), `canaries` (the audited training runs, their
scenarios, the mutations and their seams, the checks), `report` (descriptions and tables),
`cli` (`python -m dpmuon.audit.cli`).
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
    MUTATIONS,
    ONE_RUN_BLIND,
    AuditResult,
    AuditSetup,
    BlockCanaries,
    DiracCanaries,
    GPT2Canaries,
    Mutation,
    Seeds,
    audit_mechanism,
    build_mechanism,
    build_sampler,
    draw_inclusion,
    engine_mutation,
    expected_verdict,
    lot_rate_p_value,
    lot_reuse_p_value,
    noise_reuse_p_value,
    run_audits,
    train_and_score,
)
from .fdp import (
    FdpBound,
    PrivacyProfile,
    fdp_p_value,
    fdp_refutes,
    gdp_blow_up_inverse,
    gdp_covering_mu,
    gdp_delta,
    gdp_epsilon,
    gdp_mu_lower_bound,
    gdp_profile,
    one_run_fdp_audit,
    profile_blow_up_inverse,
    subsampled_gaussian_profile,
)
from .report import describe, format_markdown, format_table, table_rows

__all__ = [
    "BREAKS",
    "BREAK_LABELS",
    "METHOD",
    "MODES",
    "MUTATIONS",
    "ONE_RUN_BLIND",
    "AuditResult",
    "AuditSetup",
    "BlockCanaries",
    "DiracCanaries",
    "FdpBound",
    "GPT2Canaries",
    "Mutation",
    "OneRunBound",
    "PrivacyProfile",
    "Seeds",
    "audit_ceiling",
    "audit_mechanism",
    "build_mechanism",
    "build_sampler",
    "count_correct",
    "describe",
    "draw_inclusion",
    "engine_mutation",
    "expected_verdict",
    "fdp_p_value",
    "fdp_refutes",
    "format_markdown",
    "format_table",
    "gdp_blow_up_inverse",
    "gdp_covering_mu",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu_lower_bound",
    "gdp_profile",
    "guess_counts",
    "lot_rate_p_value",
    "lot_reuse_p_value",
    "membership_guesses",
    "noise_reuse_p_value",
    "one_run_audit",
    "one_run_epsilon_lower_bound",
    "one_run_fdp_audit",
    "one_run_p_value",
    "per_test_confidence",
    "profile_blow_up_inverse",
    "randomized_response_accuracy",
    "run_audits",
    "sampled_release_log_likelihood_ratio",
    "subsampled_gaussian_profile",
    "table_rows",
    "train_and_score",
]
