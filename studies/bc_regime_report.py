"""The regime map's report, from the published runs of results/bc_regime/ only.

    python -m studies.bc_regime_report [results/bc_regime]

Writes regime.md (the map per ε, the learning-rate check, the ablations), regime.csv (one row
per ε), delta_vs_snr.png (paired ΔNLL against the buffers' median true SNR) and
gain_vs_snr.png (alignment gain cos⟨F_BC(M), F(M₀)⟩ − cos⟨F(M), F(M₀)⟩ against the true SNR,
per matrix and step, binned). A cell whose runs are not published yet says so.

The true SNR and the alignment come from the oracle diagnostics of the DP-Muon run of each
pair (both runs log them; DP-Muon's buffers are the ones DP-MuonBC would correct).
"""

from __future__ import annotations

import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from dpmuon.eval import SUMMARY_FILE, Run, read_json_object, read_run_rows
from dpmuon.privacy import USER_SEED

from .bc_regime import ABLATIONS, EPSILONS, OPTIMIZERS, RULE, SEEDS
from .jobs import REPO

NOT_RUN = "not run yet"
_PNG_METADATA = {"Software": None}  # no matplotlib version stamp: reproducible files
_NAME = re.compile(r"(?P<opt>dp_muonbc|dp_muon)(?:_(?P<variant>[a-z0-9.]+?))?_eps(?P<eps>\d+)(?:_lr[0-9.e-]+)?_seed(?P<seed>\d+)$")


@dataclass
class RegimeRun:
    name: str
    stage: str
    optimizer: str
    variant: str | None  # an ablation's name
    epsilon: int
    lr: float  # the run's optimizer.lr
    seed: int
    test_nll: float | None
    val_nll: float | None
    epsilon_spent: float | None
    snr: list[float] = field(default_factory=list)  # per step: median true SNR over matrices
    estimated_snr: list[float] = field(default_factory=list)  # per step: the public estimate's median
    estimated_by_matrix: list[float] = field(default_factory=list)  # per matrix and step: the public estimate
    gain: list[float] = field(default_factory=list)  # per step: median over matrices of cos_bc − cos_plain
    pairs: list[tuple[float, float]] = field(default_factory=list)  # (true SNR, gain) per matrix and step


def load_runs(root: Path) -> list[RegimeRun]:
    runs = []
    for summary_path in sorted(root.glob(f"*/*/{SUMMARY_FILE}")):
        run_dir = summary_path.parent
        match = _NAME.match(run_dir.name)
        if match is None:
            continue
        record = Run(run_dir, read_json_object(summary_path))
        summary = record.summary
        if summary.get("mechanism_randomness") != USER_SEED:  # its Δ against the seed's other runs would not be paired
            raise ValueError(
                f"{run_dir}: mechanism_randomness is {summary.get('mechanism_randomness')!r}, not the sweep's shared seed "
                f"({USER_SEED!r}): it drew other lots and noise than the runs of seed {match['seed']}; remove it and run it again"
            )
        run = RegimeRun(
            run_dir.name,
            run_dir.parent.name,
            match["opt"],
            match["variant"],
            int(match["eps"]),
            record.learning_rates["lr"],
            int(match["seed"]),
            summary.get("test_nll"),
            summary.get("val_nll"),
            summary.get("epsilon"),
        )
        for row in record.load_metrics(diagnostics=True):  # the oracle's fields: diagnostics.jsonl since it exists
            if "oracle_snr" not in row:
                continue
            gains = {k: row["oracle_cos_bc"][k] - row["oracle_cos_plain"][k] for k in row["oracle_snr"]}
            run.snr.append(row["oracle_snr_median"])
            run.gain.append(statistics.median(gains.values()))
            if row.get("snr_median") is not None:
                run.estimated_snr.append(row["snr_median"])
            run.estimated_by_matrix.extend(v for v in (row.get("snr") or {}).values() if v is not None)
            run.pairs.extend((row["oracle_snr"][k], g) for k, g in gains.items() if math.isfinite(g))
        runs.append(run)
    return runs


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return NOT_RUN if value is None else format(value, spec)


def _mean_sd(values: list[float]) -> str:
    if not values:
        return NOT_RUN
    if len(values) == 1:
        return f"{values[0]:.4f} (1 seed)"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def _paired_delta(bc: RegimeRun | None, muon: RegimeRun | None) -> float | None:
    """DP-MuonBC − DP-Muon test NLL of one seed's pair; None unless both runs have one."""
    if bc is None or muon is None or None in (bc.test_nll, muon.test_nll):
        return None
    return bc.test_nll - muon.test_nll


def _find(runs: list[RegimeRun], stage: str, optimizer: str, epsilon: int, seed: int, variant: str | None = None):
    for run in runs:
        if (run.stage, run.optimizer, run.epsilon, run.seed, run.variant) == (stage, optimizer, epsilon, seed, variant):
            return run
    return None


@dataclass
class MapRow:
    epsilon: int
    muon: list[float]
    bc: list[float]
    deltas: list[float]  # paired, per seed with both runs
    snr: float | None  # median over the DP-Muon runs' steps
    estimated_snr: float | None
    gain: float | None


def map_rows(runs: list[RegimeRun]) -> list[MapRow]:
    rows = []
    for epsilon in EPSILONS:
        muon, bc, deltas, snr, estimated, gain = [], [], [], [], [], []
        for seed in SEEDS:
            a, b = (_find(runs, "runs", opt, epsilon, seed) for opt in OPTIMIZERS)
            if a is not None and a.test_nll is not None:
                muon.append(a.test_nll)
                snr += a.snr
                estimated += a.estimated_snr
                gain += a.gain
            if b is not None and b.test_nll is not None:
                bc.append(b.test_nll)
            if (delta := _paired_delta(b, a)) is not None:
                deltas.append(delta)
        rows.append(MapRow(epsilon, muon, bc, deltas, _median(snr), _median(estimated), _median(gain)))
    return rows


def _delta_cell(deltas: list[float]) -> str:
    if not deltas:
        return NOT_RUN
    values = ", ".join(f"{d:+.4f}" for d in deltas)
    if len(deltas) == 1:
        return f"{deltas[0]:+.4f} (1 pair)"
    return f"{statistics.mean(deltas):+.4f} ± {statistics.stdev(deltas):.4f} ({values})"


# The min_snr gates of the ablations: name → threshold (from their overrides).
GATES = {name: float(o.split("=")[1]) for name, overrides in ABLATIONS.items() for o in overrides if ".min_snr=" in o}


def gate_markdown(runs: list[RegimeRun]) -> str:
    """How often each gate lets the correction through, per ε (the share of the DP-Muon map runs'
    (matrix, step) pairs whose public SNR estimate exceeds it), and what the candidate rule's
    gate does to test NLL there (paired Δ against DP-Muon)."""
    lines = [
        "",
        "## Where the min_snr gates open, and the candidate rule across the map",
        "",
        "Share of the DP-Muon map runs' (matrix, step) pairs whose public SNR estimate exceeds the gate; "
        f"Δ: DP-MuonBC with `{' '.join(ABLATIONS[RULE])}` ({RULE}) − DP-Muon, paired by seed.",
        "",
        "| target ε | " + " | ".join(f"opens at min_snr = {g:g}" for g in GATES.values()) + f" | {RULE}: paired Δ NLL |",
        "|---|" + "---|" * (len(GATES) + 1),
    ]
    for epsilon in EPSILONS:
        found = [_find(runs, "runs", "dp_muon", epsilon, seed) for seed in SEEDS]
        estimates = [v for run in found if run is not None for v in run.estimated_by_matrix]
        cells = [_fmt(sum(v > g for v in estimates) / len(estimates) if estimates else None, ".2f") for g in GATES.values()]
        stage = "ablations" if epsilon == 8 else "rule_check"
        deltas = []
        for seed, base in zip(SEEDS, found):
            if (delta := _paired_delta(_find(runs, stage, "dp_muonbc", epsilon, seed, RULE), base)) is not None:
                deltas.append(delta)
        lines.append(f"| {epsilon} | " + " | ".join(cells) + f" | {_delta_cell(deltas)} |")
    return "\n".join(lines) + "\n"


def regime_markdown(runs: list[RegimeRun]) -> str:
    lines = [
        "# DP-MuonBC against DP-Muon across the SNR regime (E2E, tiny public model, lot 256, 100 steps)",
        "",
        "Test NLL: mean ± sd over seeds. Δ = DP-MuonBC − DP-Muon, paired by seed index (shared lots and "
        "noise); negative means the correction helped. SNR: median over the DP-Muon runs' steps of the "
        "median over matrices; true = ‖M₀‖²/(s²mn) of the noise-free buffer, estimated = the public "
        "estimate the optimizer sees. Gain: median of cos⟨F_BC(M), F(M₀)⟩ − cos⟨F(M), F(M₀)⟩.",
        "",
        "| target ε | DP-Muon test NLL | DP-MuonBC test NLL | paired Δ NLL (per seed) | median true SNR | median estimated SNR | median alignment gain |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in map_rows(runs):
        lines.append(
            f"| {row.epsilon} | {_mean_sd(row.muon)} | {_mean_sd(row.bc)} | {_delta_cell(row.deltas)} | "
            f"{_fmt(row.snr, '.3g')} | {_fmt(row.estimated_snr, '.3g')} | {_fmt(row.gain, '+.4f')} |"
        )
    top = max(EPSILONS)
    lines += [
        "",
        f"## Learning-rate check at ε = {top} (seed 0, validation and test NLL)",
        "",
        "| optimizer | learning rate | validation NLL | test NLL |",
        "|---|---|---|---|",
    ]
    for opt in OPTIMIZERS:
        base = _find(runs, "runs", opt, top, 0)
        entries = [r for r in runs if r.stage == "lr_check" and r.optimizer == opt] + ([base] if base else [])
        for run in sorted(entries, key=lambda r: r.lr):
            shown = f"{run.lr:g}" + (" (committed)" if run is base else "")
            lines.append(f"| {opt} | {shown} | {_fmt(run.val_nll)} | {_fmt(run.test_nll)} |")
        if not entries:
            lines.append(f"| {opt} | – | {NOT_RUN} | {NOT_RUN} |")
    lines += [
        "",
        "## Ablations of DP-MuonBC at ε = 8 (paired Δ against DP-Muon of the same seed)",
        "",
        "| variant | overrides | DP-MuonBC test NLL | paired Δ NLL (per seed) | median alignment gain |",
        "|---|---|---|---|---|",
    ]
    for name, overrides in {"paper (ρ/s = 1, K = 1, no gate)": (), **ABLATIONS}.items():
        variant = None if not overrides else name
        nll, deltas, gains = [], [], []
        for seed in SEEDS:
            stage = "runs" if variant is None else "ablations"
            run, base = _find(runs, stage, "dp_muonbc", 8, seed, variant), _find(runs, "runs", "dp_muon", 8, seed)
            if run is None or run.test_nll is None:
                continue
            nll.append(run.test_nll)
            gains += run.gain
            if (delta := _paired_delta(run, base)) is not None:
                deltas.append(delta)
        shown = " ".join(f"`{o}`" for o in overrides) or "–"
        lines.append(f"| {name} | {shown} | {_mean_sd(nll)} | {_delta_cell(deltas)} | {_fmt(_median(gains), '+.4f')} |")
    return "\n".join(lines) + "\n"


def regime_csv(runs: list[RegimeRun]) -> str:
    lines = ["target_epsilon,seeds_paired,muon_test_nll_mean,bc_test_nll_mean,delta_mean,delta_sd,median_true_snr,median_estimated_snr,median_gain"]

    def cell(v):
        return "" if v is None else repr(float(v))

    def mean(xs):
        return statistics.mean(xs) if xs else None

    for row in map_rows(runs):
        sd = statistics.stdev(row.deltas) if len(row.deltas) > 1 else None
        values = (mean(row.muon), mean(row.bc), mean(row.deltas), sd, row.snr, row.estimated_snr, row.gain)
        lines.append(",".join([str(row.epsilon), str(len(row.deltas)), *map(cell, values)]))
    return "\n".join(lines) + "\n"


# ---- the pretrained regime ---------------------------------------------------------------------

PAPER_LOT = 1024
_PRETRAINED = re.compile(r"(?P<model>[a-z0-9]+)_lot(?P<lot>\d+)$")


@dataclass
class PretrainedRun:
    model: str
    lot: int  # expected lot size
    true_snr: list[float]  # per step, median over matrices
    estimated_snr: list[float]
    gain: list[float]


def load_pretrained(root: Path) -> list[PretrainedRun]:
    out = []
    for summary in sorted((root / "pretrained").glob(f"*/{SUMMARY_FILE}")):
        match = _PRETRAINED.match(summary.parent.name)
        if match is None:
            continue
        rows = [r for r in read_run_rows(summary.parent, diagnostics=True) if "oracle_snr" in r]
        out.append(
            PretrainedRun(
                match["model"],
                int(match["lot"]),
                [r["oracle_snr_median"] for r in rows],
                [r.get("snr_median") for r in rows],
                [statistics.median(r["oracle_cos_bc"][k] - r["oracle_cos_plain"][k] for k in r["oracle_snr"]) for r in rows],
            )
        )
    return out


def extrapolate_snr(snr_by_lot: dict[int, float], lot: int = PAPER_LOT) -> tuple[float, float | None]:
    """The true SNR at `lot`, from the SNRs measured at the same σ and step at smaller lots.

    The noise std of the released mean is σΔ/B, so SNR = E_B·B²/(σΔ)² up to a constant, where
    E_B is the noise-free buffer's energy. (1) Constant signal: E_lot = E_b, so SNR scales with
    (lot/b)² from the largest measured lot b — an upper bound when part of E_b is sampling
    variance. (2) With two lots, E_B = μ² + V/B separates the mean's energy μ² from the
    variance V (momentum and the changing trajectory ignored), and E_lot = μ² + V/lot; None
    when the fit gives μ² < 0 (the signal is not resolved). Returns ((1), (2)).
    """
    lots = sorted(snr_by_lot)
    b = lots[-1]
    constant = snr_by_lot[b] * (lot / b) ** 2
    if len(lots) < 2:
        return constant, None
    b1, b2 = lots[0], lots[-1]
    e1, e2 = snr_by_lot[b1] / b1**2, snr_by_lot[b2] / b2**2
    variance = (e1 - e2) / (1 / b1 - 1 / b2)
    mean_energy = e2 - variance / b2
    if mean_energy < 0:
        return constant, None
    return constant, (mean_energy + variance / lot) * lot**2


def pretrained_markdown(pretrained: list[PretrainedRun], runs: list[RegimeRun]) -> str:
    step = min((len(r.true_snr) for r in pretrained), default=0)  # the last step every run reached
    lines = [
        "",
        f"## The pretrained regime: DP-Muon at the paper's σ, step {step or '–'} (median over matrices)",
        "",
        f"Extrapolated to lot {PAPER_LOT}: (1) the noise-free signal's energy held at the largest lot's; "
        "(2) the two lots' fit of the energy as mean + variance / lot (see `extrapolate_snr`).",
        "",
        "| model | lot | true SNR | estimated SNR | alignment gain | true SNR at lot 1024 (1) | (2) |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in sorted({r.model for r in pretrained}):
        mine = sorted((r for r in pretrained if r.model == model), key=lambda r: r.lot)
        at_step = {r.lot: r.true_snr[step - 1] for r in mine if step}
        constant, fitted = extrapolate_snr(at_step) if at_step else (None, None)
        for i, r in enumerate(mine):
            last = i == len(mine) - 1
            estimated = r.estimated_snr[step - 1] if step else None
            lines.append(
                f"| {model} | {r.lot} | {_fmt(r.true_snr[step - 1] if step else None, '.3g')} | {_fmt(estimated, '.3g')} | "
                f"{_fmt(r.gain[step - 1] if step else None, '+.4f')} | {_fmt(constant, '.3g') if last else ''} | "
                f"{(_fmt(fitted, '.3g') if fitted is not None else 'not resolved') if last and len(mine) > 1 else ''} |"
            )
    if not pretrained:
        lines.append(f"| – | – | {NOT_RUN} | {NOT_RUN} | {NOT_RUN} | {NOT_RUN} | {NOT_RUN} |")
    map_run = _find(runs, "runs", "dp_muon", 8, 0)
    if map_run is not None and step and len(map_run.snr) >= step:
        lines += ["", f"The map's DP-Muon run at ε = 8 (tiny model, lot 256, seed 0) at step {step}: true SNR {map_run.snr[step - 1]:.3g}."]
    return "\n".join(lines) + "\n"


def _decade_axis(ax, values: list[float]) -> None:
    """A log x axis over whole decades (labelled at each power of ten only)."""
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    positive = [v for v in values if v > 0]
    if positive:
        ax.set_xlim(10.0 ** math.floor(math.log10(min(positive))), 10.0 ** math.ceil(math.log10(max(positive))))


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120, metadata=_PNG_METADATA)


def delta_figure(runs: list[RegimeRun], path: Path) -> None:
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for epsilon in EPSILONS:
        points = []
        for seed in SEEDS:
            a, b = _find(runs, "runs", "dp_muon", epsilon, seed), _find(runs, "runs", "dp_muonbc", epsilon, seed)
            if (delta := _paired_delta(b, a)) is not None and a.snr:
                points.append((statistics.median(a.snr), delta))
        if points:
            ax.scatter(*zip(*points), label=f"ε = {epsilon}", s=28)
    for name in ABLATIONS:
        points = []
        for seed in SEEDS:
            a, b = _find(runs, "runs", "dp_muon", 8, seed), _find(runs, "ablations", "dp_muonbc", 8, seed, name)
            if (delta := _paired_delta(b, a)) is not None and a.snr:
                points.append((statistics.median(a.snr), delta))
        if points:
            ax.scatter(*zip(*points), label=f"ε = 8, {name}", marker="x", s=28)
    ax.axhline(0.0, color="black", linewidth=0.8)
    _decade_axis(ax, [x for c in ax.collections for x, _ in c.get_offsets()])
    ax.set_xlabel("median true SNR of DP-Muon's buffers")
    ax.set_ylabel("test NLL: DP-MuonBC − DP-Muon (paired)")
    ax.set_title("Does the bias correction pay off? (below 0: it helps)", fontsize=10)
    if ax.collections:
        ax.legend(fontsize=8)
    _save(fig, path)


def map_gain_pairs(runs: list[RegimeRun]) -> list[tuple[float, float]]:
    """(true SNR, alignment gain) of every matrix and step of the DP-Muon map runs."""
    return [(s, g) for r in runs if r.stage == "runs" and r.optimizer == "dp_muon" for s, g in r.pairs if s > 0 and math.isfinite(s)]


def gain_bins(pairs: list[tuple[float, float]], bins_per_decade: int = 2) -> list[tuple[float, float, np.ndarray]]:
    """The gains binned by true SNR on a log scale: (low edge, high edge, gains inside), non-empty bins."""
    if not pairs:
        return []
    snr, gain = np.array(pairs).T
    width = 1 / bins_per_decade
    edges = 10.0 ** np.arange(math.floor(np.log10(snr.min()) / width) * width, np.log10(snr.max()) + width, width)
    bins = [(lo, hi, gain[(snr >= lo) & (snr < hi)]) for lo, hi in zip(edges[:-1], edges[1:])]
    return [b for b in bins if len(b[2])]


def gain_markdown(runs: list[RegimeRun]) -> str:
    pairs = map_gain_pairs(runs)
    lines = [
        "",
        "## Alignment gain against the true SNR (every matrix and step of the DP-Muon map runs)",
        "",
        "Gain: cos⟨F_BC(M), F(M₀)⟩ − cos⟨F(M), F(M₀)⟩ for one draw of the probes; positive means that draw points closer to "
        "the noise-free direction. A single draw mixes the correction's bias with its probes' variance, so this gain cannot show "
        "bias; the probe-averaged gain, which can, is measured on the fair comparison's finals (`fair/alignment_vs_snr.png`).",
        "",
        "| true SNR bin | matrix-steps | median gain | interquartile range | share with gain > 0 |",
        "|---|---|---|---|---|",
    ]
    for lo, hi, gains in gain_bins(pairs):
        q1, q3 = np.quantile(gains, [0.25, 0.75])
        lines.append(f"| {lo:.3g}–{hi:.3g} | {len(gains)} | {np.median(gains):+.4f} | {q1:+.4f} to {q3:+.4f} | {np.mean(gains > 0):.3f} |")
    if pairs:
        positive = [s for s, g in pairs if g > 0]
        where = f"; the largest true SNR among them: {max(positive):.3g}" if positive else ""
        lines += ["", f"Matrix-steps with a positive gain: {len(positive)} of {len(pairs)}{where}. Largest true SNR seen: {max(s for s, _ in pairs):.3g}."]
    return "\n".join(lines) + "\n"


def gain_figure(curves: list[tuple[str, list[tuple[float, float]]]], path: Path, title: str) -> None:
    """Each (label, [(true SNR, gain)]) curve binned by SNR: the median over the bin's matrix-steps
    and its interquartile band."""
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for (label, points), color, marker in zip(curves, ("#d62728", "#1f77b4"), ("o", "s")):
        bins = gain_bins(points)
        if not bins:
            continue
        centers = [math.sqrt(lo * hi) for lo, hi, _ in bins]
        ax.plot(centers, [np.median(g) for _, _, g in bins], marker=marker, color=color, label=f"{label}: median over matrices × steps")
        low, high = ([np.quantile(g, q) for _, _, g in bins] for q in (0.25, 0.75))
        ax.fill_between(centers, low, high, color=color, alpha=0.2, label=f"{label}: interquartile range")
    every = [s for _, points in curves for s, _ in points]
    if every:
        ax.legend(fontsize=8)
    ax.axhline(0.0, color="black", linewidth=0.8)
    _decade_axis(ax, every)
    ax.set_xlabel("true SNR ‖M₀‖²/(s²mn) (per matrix and step)")
    ax.set_ylabel("cos⟨F_BC(M), F(M₀)⟩ − cos⟨F(M), F(M₀)⟩")
    ax.set_title(title, fontsize=9)
    _save(fig, path)


def write_report(root: Path, out: Path | None = None) -> list[Path]:
    """The tables and figures of the runs under `root`, written to `out` (default: `root`)."""
    runs = load_runs(root)
    out = out or root
    written = [out / "regime.md", out / "regime.csv", out / "delta_vs_snr.png", out / "gain_vs_snr.png"]
    out.mkdir(parents=True, exist_ok=True)
    written[0].write_text(regime_markdown(runs) + gate_markdown(runs) + gain_markdown(runs) + pretrained_markdown(load_pretrained(root), runs))
    written[1].write_text(regime_csv(runs))
    delta_figure(runs, written[2])
    title = "Alignment gain of the correction vs true SNR\n(DP-Muon map runs; single draw: not a bias measure)"
    gain_figure([("single-draw cosine", map_gain_pairs(runs))], written[3], title)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else REPO / "results" / "bc_regime"
    for path in write_report(root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
