"""The fair comparison's table and figure from its published runs (results/bc_regime/fair/).

    python -m studies.bc_fair_report [results/bc_regime/fair]

Writes `fair.md` next to the runs (every comparison paired by mechanism seed, with a t-based 95%
confidence interval over seeds, the paired Δ along the long horizon, and what the oracle saw in
the finals), `paired_delta.png`
(paired Δ validation NLL, DP-MuonBC − DP-Muon, against step: one panel per setting),
`alignment_vs_snr.png` (the correction's single-draw and probe-averaged alignment gain against
the true SNR, on the DP-Muon finals' trajectories) and `horizon_rates.png` (the add-on's arms
against DP-Muon at its best rate along the 3-epoch horizon). A cell that was not measured says so.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from scipy import stats  # noqa: E402

from dpmuon.eval import SUMMARY_FILE, Run, read_summary  # noqa: E402
from dpmuon.privacy import USER_SEED  # noqa: E402

from .bc_fair import CONTENDERS, HORIZON_EPOCHS, HORIZON_RATES_PREREGISTRATION, SEEDS, SEEDS_FILE, VARIANTS, slower_muon_rates, tune_name, tuning_grid  # noqa: E402
from .bc_regime_report import gain_figure  # noqa: E402
from .jobs import REPO  # noqa: E402

NOT_RUN = "not run yet"
NOT_IN_GRID = "not in the grid"  # a rate another contender's grid grew to
HORIZON_TABLE_EVERY = 100
# The horizon's pairs: what, the runs' names before _seed. The norm-matched arm has DP-Muon's step
# lengths and AdamW rate: against DP-Muon, the correction's direction; against DP-MuonBC, the rates.
HORIZON_COMPARISONS = (
    ("DP-MuonBC − DP-Muon", "dp_muonbc", "dp_muon"),
    ("DP-MuonBC (match_norm) − DP-Muon", "dp_muonbc_matched", "dp_muon"),
    ("DP-MuonBC − DP-MuonBC (match_norm)", "dp_muonbc", "dp_muonbc_matched"),
)
STEP_STD_AT_MUON_RATE = "s = one step's noise std, at DP-Muon's rate"
_PNG_METADATA = {"Software": None}  # no matplotlib version stamp: reproducible files


def load(root: Path, stage: str) -> dict[str, Run]:
    return {p.parent.name: Run(p.parent, read_summary(p)) for p in sorted((root / stage).glob(f"*/{SUMMARY_FILE}"))}


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t-interval of the mean, over at least two values."""
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    mean = statistics.mean(values)
    return mean, mean - half, mean + half


def mean_ci(values: list[float]) -> str:
    """mean [95% t-interval] (n); one value has no interval."""
    if not values:
        return NOT_RUN
    if len(values) == 1:
        return f"{values[0]:+.4f} (n = 1)"
    mean, low, high = t_interval(values)
    return f"{mean:+.4f} [{low:+.4f}, {high:+.4f}] (n = {len(values)})"


def paired_by_seed(runs: dict[str, Run], bc: str, muon: str, key: str = "test_nll") -> dict[int, float]:
    """Seed → BC − Muon of `key`, for the seeds where both runs have it (same seed: same lots and noise)."""
    deltas = {}
    for seed in SEEDS:
        a, b = runs.get(f"{bc}_seed{seed}"), runs.get(f"{muon}_seed{seed}")
        if a is not None and b is not None and None not in (a.summary.get(key), b.summary.get(key)):
            deltas[seed] = a.summary[key] - b.summary[key]
    return deltas


def paired(runs: dict[str, Run], bc: str, muon: str, key: str = "test_nll") -> list[float]:
    return list(paired_by_seed(runs, bc, muon, key).values())


def tuning_markdown(root: Path) -> str:
    """Mean validation NLL per contender and rate; the mark is the runner's own selection."""
    by_rate: dict[str, dict[float, list[float]]] = {c: defaultdict(list) for c in CONTENDERS}
    for name, run in load(root, "tune").items():
        contender = name.rsplit("_lr", 1)[0]
        if contender in by_rate and run.summary.get("val_nll") is not None:
            by_rate[contender][run.learning_rates["lr"]].append(run.summary["val_nll"])
    grids = {contender: tuning_grid(root, contender) for contender in CONTENDERS}
    selected = {contender: grid[1] for contender, grid in grids.items()}
    in_grid = {contender: {f"{lr:.4g}" for lr in grid[0]} for contender, grid in grids.items()}
    rates = sorted({lr for grid in by_rate.values() for lr in grid})
    lines = ["## Tuning at the final horizon (validation NLL, mean over seeds; * = selected)", "",
             "| rate | " + " | ".join(CONTENDERS) + " |", "|---|" + "---|" * len(CONTENDERS)]  # fmt: skip
    for lr in rates:
        cells = []
        for contender in CONTENDERS:
            values = by_rate[contender].get(lr)
            # Rates are compared as the run names spell them (config.yaml keeps 6 digits).
            mark = "*" if selected[contender] is not None and f"{selected[contender]:.4g}" == f"{lr:.4g}" else ""
            missing = NOT_RUN if f"{lr:.4g}" in in_grid[contender] else NOT_IN_GRID
            cells.append(f"{statistics.mean(values):.4f}{mark} ({len(values)})" if values else missing)
        lines.append(f"| {lr:.4g} | " + " | ".join(cells) + " |")
    waiting = [contender for contender, lr in selected.items() if lr is None]
    if waiting:
        lines += ["", f"Not selected yet ({', '.join(waiting)}): a rate of the grid lacks a seed, or an edge wins and the grid grows past it."]
    return "\n".join(lines) + "\n"


def comparisons_markdown(root: Path) -> str:
    finals, variants, horizon = load(root, "finals"), load(root, "variants"), load(root, "horizon")
    both = {**variants, **finals}
    rows = [  # setting, comparison, the runs, the two runs' names before _seed
        ("each at its best rate", "DP-MuonBC − DP-Muon", finals, "dp_muonbc", "dp_muon"),
        ("each at its best rate", "DP-MuonBC (match_norm) − DP-Muon", finals, "dp_muonbc_matched", "dp_muon"),
        ("each at its best rate", "DP-MuonBC − DP-MuonBC (match_norm)", finals, "dp_muonbc", "dp_muonbc_matched"),
        ("AdamW part at DP-Muon's rate", "DP-MuonBC (split rates) − DP-Muon", finals, "dp_muonbc_split", "dp_muon"),
        ("AdamW part at DP-Muon's rate", "DP-MuonBC − DP-MuonBC (split rates)", finals, "dp_muonbc", "dp_muonbc_split"),
        *((f"variant {v}", "DP-MuonBC − DP-Muon", variants, f"dp_muonbc_{v}", f"dp_muon_{v}") for v in VARIANTS),
        ("s = one step's noise std", "DP-MuonBC − DP-Muon (finals)", both, "dp_muonbc_stepstd", "dp_muon"),
        (STEP_STD_AT_MUON_RATE, "DP-MuonBC − DP-Muon (finals)", both, "dp_muonbc_stepstd_muonrate", "dp_muon"),
        *((f"horizon ({HORIZON_EPOCHS} epochs)", what, horizon, bc, muon) for what, bc, muon in HORIZON_COMPARISONS),
    ]
    lines = ["## Paired Δ on the test set (same mechanism seed; mean [95% t-interval over seeds])", "",
             "| setting | comparison | Δ NLL | Δ BLEU | Δ ROUGE-L |", "|---|---|---|---|---|"]  # fmt: skip
    for setting, what, runs, bc, muon in rows:
        cells = [mean_ci(paired(runs, bc, muon, key)) for key in ("test_nll", "bleu", "rouge_l")]
        lines.append(f"| {setting} | {what} | " + " | ".join(cells) + " |")
    lines += ["", "Step-length ratio ‖F_BC(M)‖/‖F(M)‖ of DP-MuonBC (per run: median over steps of the median over matrices; "
              "mean [95% t-interval] over seeds):", ""]  # fmt: skip
    arms = [("each at its best rate", finals, "dp_muonbc"), *((f"variant {v}", variants, f"dp_muonbc_{v}") for v in VARIANTS),
            ("s = one step's noise std", variants, "dp_muonbc_stepstd"), (STEP_STD_AT_MUON_RATE, variants, "dp_muonbc_stepstd_muonrate"),
            (f"horizon ({HORIZON_EPOCHS} epochs)", horizon, "dp_muonbc")]  # fmt: skip
    for setting, runs, bc in arms:
        lines.append(f"- {setting}: {mean_ci(step_length_ratios(runs, bc)).replace('+', '')}")
    return "\n".join(lines) + "\n"


def gap_changes_markdown(root: Path) -> str:
    """How far each variant run at DP-MuonBC's best rate moves the finals' paired gap: per seed,
    its Δ minus the default's Δ on that seed. What the variant and the default share (the rates,
    the AdamW part's among them) cancels."""
    finals, variants = load(root, "finals"), load(root, "variants")
    rows = [*((f"variant {v}", variants, f"dp_muonbc_{v}", f"dp_muon_{v}") for v in VARIANTS),
            ("s = one step's noise std", {**variants, **finals}, "dp_muonbc_stepstd", "dp_muon")]  # fmt: skip
    lines = ["## What each variant changes in the gap (its paired Δ − the default's, same seed; mean [95% t-interval])", "",
             "The variants run at the finals' rates (DP-MuonBC's best, DP-Muon's best), so against \"each at its best rate\" "
             "only the variant differs; a negative change in NLL means the variant narrows DP-MuonBC's gap.", "",
             "| setting | change in Δ NLL | change in Δ BLEU | change in Δ ROUGE-L |", "|---|---|---|---|"]  # fmt: skip
    for setting, runs, bc, muon in rows:
        cells = []
        for key in ("test_nll", "bleu", "rouge_l"):
            default, variant = paired_by_seed(finals, "dp_muonbc", "dp_muon", key), paired_by_seed(runs, bc, muon, key)
            cells.append(mean_ci([variant[seed] - default[seed] for seed in variant if seed in default]))
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def step_length_ratios(runs: dict[str, Run], bc: str) -> list[float]:
    """Per seed of `bc`: the median over steps of its logged median over matrices."""
    out = []
    for seed in SEEDS:
        run = runs.get(f"{bc}_seed{seed}")
        per_step = [r["update_norm_ratio_median"] for r in run.load_metrics() if r.get("update_norm_ratio_median") is not None] if run else []
        if per_step:
            out.append(statistics.median(per_step))
    return out


def oracle_rows(run: Run) -> list[dict]:
    return [row for row in run.load_metrics() if "oracle_snr" in row]


def per_matrix_medians(run: Run, value: Callable[[dict, str], float | None]) -> list[float]:
    """Per logged step, the median over matrices of value(row, matrix)."""
    out = []
    for row in oracle_rows(run):
        values = [v for k in row["oracle_snr"] if (v := value(row, k)) is not None and math.isfinite(v)]
        if values:
            out.append(statistics.median(values))
    return out


def single_gain(row: dict, k: str) -> float:
    return row["oracle_cos_bc"][k] - row["oracle_cos_plain"][k]


def averaged_gain(row: dict, k: str) -> float:
    return row["oracle_cos_bc_mean"][k] - row["oracle_cos_plain"][k]


def signal_ratio(row: dict, k: str) -> float | None:
    plain = row["oracle_signal_plain"][k]
    return row["oracle_signal_bc"][k] / plain if plain > 0 else None


ORACLE_COLUMNS = (
    ("true SNR", lambda row, k: row["oracle_snr"][k]),
    ("single-draw gain", single_gain),
    ("probe-averaged gain (16 pairs)", averaged_gain),
    ("signal ratio BC / plain", signal_ratio),
)


def oracle_markdown(finals: dict[str, Run]) -> str:
    """Per final's trajectory: each column's median over steps of its median over matrices, then
    mean [95% t-interval] over seeds."""
    lines = ["## What the oracle sees in the finals (median over steps of the median over matrices; mean [95% t-interval] over seeds)", "",
             "The oracle applies DP-MuonBC's correction (as configured for that run) to each run's own buffer M and compares with "
             "F(M₀) of the noise-free buffer. Gain: cos⟨F_BC(M), F(M₀)⟩ − cos⟨F(M), F(M₀)⟩, for one draw of the probes and for the "
             "map averaged over 16 probe pairs (which removes the probes' variance only: the average still holds the DP noise). Signal: the "
             "projection ⟨F_x, F(M₀)⟩/‖F(M₀)‖²; the ratio above 1 means the averaged corrected map carries more of the "
             "noise-free direction than F(M), whatever its length. Not private: functions of the noise-free signal.", "",
             "| trajectory | " + " | ".join(name for name, _ in ORACLE_COLUMNS) + " |", "|---|" + "---|" * len(ORACLE_COLUMNS)]  # fmt: skip
    for contender in CONTENDERS:
        cells = []
        for _, value in ORACLE_COLUMNS:
            per_seed = [statistics.median(m) for seed in SEEDS if (run := finals.get(f"{contender}_seed{seed}")) and (m := per_matrix_medians(run, value))]
            cells.append(mean_ci(per_seed).replace("+", ""))
        lines.append(f"| {contender} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def alignment_figure(finals: dict[str, Run], path: Path) -> None:
    """The DP-Muon finals' (true SNR, gain) of every matrix and step: one draw against 16 pairs."""
    rows = [row for seed in SEEDS if (name := f"dp_muon_seed{seed}") in finals for row in oracle_rows(finals[name])]
    curves = [
        (label, [(row["oracle_snr"][k], g) for row in rows for k in row["oracle_snr"] if row["oracle_snr"][k] > 0 and math.isfinite(g := value(row, k))])
        for label, value in (("single-draw cosine", single_gain), ("probe-averaged (16 pairs)", averaged_gain))
    ]
    gain_figure(curves, path, "Alignment gain of the correction vs true SNR\n(DP-Muon finals, ε = 8: one draw against the probe average)")


def delta_curves(runs: dict[str, Run], bc: str, muon: str) -> dict[int, list[float]]:
    """Paired Δ validation NLL per step, over the seeds with both curves."""
    curves: dict[int, list[float]] = defaultdict(list)
    for seed in SEEDS:
        a, b = runs.get(f"{bc}_seed{seed}"), runs.get(f"{muon}_seed{seed}")
        if a is None or b is None:
            continue
        va, vb = ({r["step"]: r["val_nll"] for r in run.load_metrics() if r.get("val_nll") is not None} for run in (a, b))
        for step in sorted(set(va) & set(vb)):
            curves[step].append(va[step] - vb[step])
    return curves


def horizon_markdown(root: Path) -> str:
    """Paired Δ validation NLL along the long runs, every HORIZON_TABLE_EVERY steps and at the
    last step a pair evaluated: whether DP-MuonBC's gains come late, and from what."""
    horizon = load(root, "horizon")
    curves = [delta_curves(horizon, bc, muon) for _, bc, muon in HORIZON_COMPARISONS]
    # Both runs of a pair start from one model: Δ is 0 at step 0 by construction.
    steps = sorted({step for c in curves for step in c if step > 0})
    lines = [f"## Along the horizon ({HORIZON_EPOCHS} epochs): paired Δ validation NLL", ""]
    if not steps:
        return "\n".join([*lines, NOT_RUN]) + "\n"
    lines += ["| step | " + " | ".join(what for what, _, _ in HORIZON_COMPARISONS) + " |", "|---|" + "---|" * len(curves)]
    for step in steps:
        if step % HORIZON_TABLE_EVERY == 0 or step == steps[-1]:
            lines.append(f"| {step} | " + " | ".join(mean_ci(c.get(step, [])) for c in curves) + " |")
    return "\n".join(lines) + "\n"


# horizon_rates' reading (horizon_rates_preregistration.md): Δ validation NLL at a pair's last
# evaluation, and averaged over its evaluations from LATE_FROM on.
LATE_FROM = 250


def validation_deltas(runs: dict[str, Run], a: str, b: str) -> tuple[list[float], list[float]]:
    """Per seed with both curves: (Δ at their last common evaluation, mean Δ over evaluations ≥ LATE_FROM)."""
    last, late = [], []
    for seed in SEEDS:
        pair = [runs.get(f"{name}_seed{seed}") for name in (a, b)]
        if None in pair:
            continue
        va, vb = ({r["step"]: r["val_nll"] for r in run.load_metrics() if r.get("val_nll") is not None} for run in pair)
        steps = sorted(set(va) & set(vb))
        if steps:
            last.append(va[steps[-1]] - vb[steps[-1]])
            late.append(statistics.mean(va[s] - vb[s] for s in steps if s >= LATE_FROM) if steps[-1] >= LATE_FROM else math.nan)
    return last, [v for v in late if math.isfinite(v)]


def slower_muon_arms(root: Path) -> tuple[float | None, list[tuple[str, str]]]:
    """DP-Muon's best rate and horizon_rates' slower DP-Muon arms (rate as written, the runs'
    name before _seed); no arms before the tuning has a best rate."""
    best = tuning_grid(root, "dp_muon")[1]
    if best is None:
        return None, []
    return best, [(f"{lr:.4g}", tune_name("dp_muon", lr, 0).rsplit("_seed", 1)[0]) for lr in slower_muon_rates(best)]


def horizon_rates_runs(root: Path) -> dict[str, Run]:
    """The horizon's and horizon_rates' runs together: the add-on's arms pair with the horizon's."""
    return {**load(root, "horizon"), **load(root, "horizon_rates")}


def horizon_rates_rows(root: Path) -> tuple[dict[str, Run], list[tuple[str, str, str]]]:
    """The add-on's runs (`horizon_rates_runs`) and its comparisons (what, a, b: a − b)."""
    best, slower = slower_muon_arms(root)
    runs = horizon_rates_runs(root)
    if best is None:
        return runs, []
    rows = [(f"DP-MuonBC (match_norm) − DP-Muon at {best:.4g}", "dp_muonbc_matched", "dp_muon")]
    rows += [(f"DP-MuonBC (match_norm) − DP-Muon at {rate}", "dp_muonbc_matched", name) for rate, name in slower]
    rows += [(f"DP-Muon at {rate} − DP-Muon at {best:.4g}", name, "dp_muon") for rate, name in slower]
    rows += [(f"DP-MuonBC − DP-Muon at {slower[-1][0]}", "dp_muonbc", slower[-1][1]),
             ("DP-MuonBC − DP-MuonBC (split rates)", "dp_muonbc", "dp_muonbc_split"),
             ("DP-MuonBC (split rates) − DP-Muon", "dp_muonbc_split", "dp_muon")]  # fmt: skip
    return runs, rows


def h3(root: Path) -> str:
    """H3, the norm-matched arm's late lead is the correction's direction, by the pre-registered rule
    (validation NLL at the last evaluation): the direction if it beats DP-Muon at every rate tried,
    a rate effect if DP-Muon at a slower rate does at least as well on average."""
    runs = horizon_rates_runs(root)
    best, slower = slower_muon_arms(root)
    against = [validation_deltas(runs, "dp_muonbc_matched", muon)[0] for muon in ["dp_muon", *(name for _, name in slower)]]
    if best is None or min(len(deltas) for deltas in against) < len(SEEDS):
        return "waiting for the runs"
    if any(statistics.mean(deltas) >= 0 for deltas in against[1:]):
        return "a rate effect: DP-Muon at a slower rate does at least as well as the norm-matched arm"
    if all(t_interval(deltas)[2] < 0 for deltas in against):
        return "the correction's direction: the norm-matched arm beats DP-Muon at every rate tried"
    return "unresolved"


def h4(root: Path) -> str:
    """H4, DP-MuonBC's slower AdamW part is part of its late lead: DP-MuonBC − its split-rate run at the last evaluation."""
    runs = horizon_rates_runs(root)
    deltas = validation_deltas(runs, "dp_muonbc", "dp_muonbc_split")[0]
    if len(deltas) < len(SEEDS):
        return "waiting for the runs"
    _, low, high = t_interval(deltas)
    return "supported: the slower AdamW part helps late" if high < 0 else "reversed: it hurts late" if low > 0 else "unresolved"


def horizon_rates_markdown(root: Path) -> str:
    runs, rows = horizon_rates_rows(root)
    lines = [f"## Slower rates over the horizon (issue 39's add-on; rule in `{HORIZON_RATES_PREREGISTRATION}`)", "",
             f"Paired Δ (a − b, same seed), mean [95% t-interval]: validation NLL at the pair's last evaluation and averaged over "
             f"its evaluations from step {LATE_FROM} on; test NLL and BLEU.", "",
             f"| comparison | Δ val NLL, last | Δ val NLL, steps ≥ {LATE_FROM} | Δ test NLL | Δ BLEU |", "|---|---|---|---|---|"]  # fmt: skip
    for what, a, b in rows:
        last, late = validation_deltas(runs, a, b)
        lines.append(f"| {what} | {mean_ci(last)} | {mean_ci(late)} | {mean_ci(paired(runs, a, b))} | {mean_ci(paired(runs, a, b, 'bleu'))} |")
    lines += ["", f"- H3, the norm-matched arm's late lead is the correction's direction: **{h3(root)}**",
              f"- H4, DP-MuonBC's slower AdamW part is part of its late lead: **{h4(root)}**"]  # fmt: skip
    return "\n".join(lines) + "\n"


def delta_figure(root: Path, path: Path) -> None:
    finals, variants, horizon = load(root, "finals"), load(root, "variants"), load(root, "horizon")
    panels = [("each at its best rate", finals, "dp_muonbc", "dp_muon"), ("match_norm", finals, "dp_muonbc_matched", "dp_muon"),
              ("AdamW part at DP-Muon's rate", finals, "dp_muonbc_split", "dp_muon"),
              *((v, variants, f"dp_muonbc_{v}", f"dp_muon_{v}") for v in VARIANTS),
              ("s = one step's noise std", {**variants, **finals}, "dp_muonbc_stepstd", "dp_muon"),
              (STEP_STD_AT_MUON_RATE, {**variants, **finals}, "dp_muonbc_stepstd_muonrate", "dp_muon"),
              ("horizon", horizon, "dp_muonbc", "dp_muon"), ("horizon, match_norm", horizon, "dp_muonbc_matched", "dp_muon")]  # fmt: skip
    columns = 5
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.4 * columns, 2.9 * rows), sharey=True, squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.remove()
    for ax, (title, runs, bc, muon) in zip(axes.flat, panels):
        curves = delta_curves(runs, bc, muon)
        ax.axhline(0.0, color="black", linewidth=0.8)
        if curves:
            steps = sorted(curves)
            for seed_index in range(max(len(v) for v in curves.values())):
                ax.plot([s for s in steps if len(curves[s]) > seed_index], [curves[s][seed_index] for s in steps if len(curves[s]) > seed_index],
                        color="#d62728", alpha=0.35, linewidth=0.8)  # fmt: skip
            ax.plot(steps, [statistics.mean(curves[s]) for s in steps], color="#d62728", linewidth=2, label="mean over seeds")
        else:
            ax.text(0.5, 0.5, NOT_RUN, ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    for row in axes:
        row[0].set_ylabel("Δ val NLL (BC − Muon, paired)")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=_PNG_METADATA)
    plt.close(fig)


def horizon_rates_figure(root: Path, path: Path) -> list[tuple[str, float]]:
    """The add-on's arms against DP-Muon at its best rate along the horizon: paired Δ validation
    NLL, mean over the seeds with both curves (H3 reads the slower DP-Muon arms against the
    norm-matched one at the last step). Returns each plotted curve's label and last mean."""
    runs = horizon_rates_runs(root)
    best, slower = slower_muon_arms(root)
    arms = [*((f"DP-Muon at {rate}", name) for rate, name in slower), ("DP-MuonBC (match_norm)", "dp_muonbc_matched"),
            ("DP-MuonBC", "dp_muonbc"), ("DP-MuonBC, split rates", "dp_muonbc_split")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.axhline(0.0, color="black", linewidth=0.8)
    plotted = []
    for label, name in arms:
        curves = delta_curves(runs, name, "dp_muon")
        if curves:
            steps = sorted(curves)
            means = [statistics.mean(curves[s]) for s in steps]
            plotted.append((f"{label} (n = {max(len(v) for v in curves.values())})", means[-1]))
            ax.plot(steps, means, linewidth=1.6, label=plotted[-1][0])
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, NOT_RUN, ha="center", va="center", transform=ax.transAxes)
    against = f"DP-Muon at {best:.4g}" if best is not None else "DP-Muon"
    ax.set_title(f"{HORIZON_EPOCHS} epochs: Δ validation NLL against {against} (paired, mean over seeds)", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("Δ val NLL")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=_PNG_METADATA)
    plt.close(fig)
    return plotted


def published_seeds_note(root: Path) -> str:
    """What the runs' ε is: their seeds are published, so it is no guarantee (and the summaries
    written before a run could say so claim otherwise)."""
    sources = [read_summary(p).get("mechanism_randomness") for p in sorted(root.glob(f"*/*/{SUMMARY_FILE}"))]
    private, older = sum(source is not None for source in sources), sources.count(USER_SEED)
    note = (
        f"**Published seeds — no guarantee.** The mechanism seeds of these runs are published (`{SEEDS_FILE}`): anyone can "
        "regenerate every lot and noise draw, so each run is a measurement of the optimizers, not a private release of E2E, "
        "and the ε in its `summary.json` (≈ 8) is the noise's calibration, not a privacy guarantee."
    )
    if older:
        note += (
            f" {older} of the {private} private runs' summaries, written before a run could declare its seed published, "
            f'still say "{USER_SEED}": here it is not secret.'
        )
    return note


def write_report(root: Path, out: Path | None = None) -> list[Path]:
    """fair.md and the figures of the runs under `root`, written to `out` (default: `root`)."""
    out = out or root
    out.mkdir(parents=True, exist_ok=True)
    table, figure, alignment, rates = out / "fair.md", out / "paired_delta.png", out / "alignment_vs_snr.png", out / "horizon_rates.png"
    header = (
        "# DP-MuonBC compared fairly (pretrained tiny model, E2E, lot 256, ε = 8)\n\n"
        "From `python -m studies.bc_fair_report`; runs from `python -m studies.bc_fair run`.\n\n"
        f"{published_seeds_note(root)}\n\n"
    )
    finals = load(root, "finals")
    sections = (
        tuning_markdown(root),
        comparisons_markdown(root),
        gap_changes_markdown(root),
        horizon_markdown(root),
        horizon_rates_markdown(root),
        oracle_markdown(finals),
    )
    table.write_text(header + "\n".join(sections))
    delta_figure(root, figure)
    alignment_figure(finals, alignment)
    horizon_rates_figure(root, rates)
    return [table, figure, alignment, rates]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for path in write_report(Path(argv[0]) if argv else REPO / "results" / "bc_regime" / "fair"):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
