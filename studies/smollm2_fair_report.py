"""The SmolLM2 + LoRA study's report and its pre-registered decision rule (results/smollm2_fair/).

    python -m studies.smollm2_fair_report [results/smollm2_fair]

Writes `fair.md` (the tuning table; each arm's finals; the paired Δ with t(n−1) 95% intervals
and per-seed signs; H1 and H2 as the rule in preregistration.md reads them) and
`paired_delta.png` (paired Δ validation NLL against step). Every number is read from the
published runs; a cell that was not measured says so.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from scipy import stats  # noqa: E402

from dpmuon.eval import Run  # noqa: E402

from .bc_fair_report import NOT_RUN, load, published_seeds_note  # noqa: E402
from .smollm2_fair import ARMS, EXTRA_SEEDS, RESULTS, SEEDS, picks, tune_name  # noqa: E402

LABELS = {"dp_adam": "DP-Adam", "dp_muon": "DP-Muon", "dp_muonbc": "DP-MuonBC", "dp_muonbc_matched": "DP-MuonBC (match_norm)"}
COMPARISONS = (  # (a, b): Δ = a − b, paired by seed
    ("dp_muon", "dp_adam"),  # H1
    ("dp_muonbc", "dp_muon"),  # H2, own rates
    ("dp_muonbc_matched", "dp_muon"),  # H2, DP-Muon's step lengths: the correction's direction
    ("dp_muonbc", "dp_muonbc_matched"),
)
METRICS = (("test_nll", "test NLL"), ("bleu", "BLEU"), ("bleu_lowercase", "BLEU (lowercase)"), ("rouge_l", "ROUGE-L"))
_PNG_METADATA = {"Software": None}  # no matplotlib version stamp: reproducible files


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Interval | None:
        """Mean and t(n−1) 95% interval; None below two values."""
        if len(values) < 2:
            return None
        mean = statistics.mean(values)
        half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
        return cls(mean, mean - half, mean + half, len(values))

    def inside(self, bound: float) -> bool:
        return -bound < self.low and self.high < bound

    def __str__(self) -> str:
        return f"{self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}] (n = {self.n})"


def val_curve(run: Run) -> dict[int, float]:
    return {row["step"]: row["val_nll"] for row in run.load_metrics() if row.get("val_nll") is not None}


def read(run: Run, key: str) -> float | None:
    """A run's final number: a summary key, or `val_end` / `val_last2` (the endpoint and the mean
    of the last two validation evaluations: never a step picked by its value)."""
    if key in ("val_end", "val_last2"):
        curve = val_curve(run)
        last = [curve[step] for step in sorted(curve)[-2:]]
        return (last[-1] if key == "val_end" else statistics.mean(last)) if len(last) == 2 else None
    value = run.summary.get(key)
    return value if value is not None and math.isfinite(value) else None


def paired_by_seed(finals: dict[str, Run], a: str, b: str, key: str) -> dict[int, float]:
    """Seed → a − b of `key`, over the seeds where both runs measured it (one seed: the same lots and noise)."""
    out = {}
    for seed in (*SEEDS, *EXTRA_SEEDS):
        ra, rb = finals.get(f"{a}_seed{seed}"), finals.get(f"{b}_seed{seed}")
        if ra is not None and rb is not None and None not in (va := read(ra, key), vb := read(rb, key)):
            out[seed] = va - vb
    return out


def h1(finals: dict[str, Run]) -> tuple[str, Interval | None, Interval | None]:
    """H1 "DP-Muon ≫ DP-Adam" by the pre-registered rule: (verdict, Δ BLEU, Δ test NLL), Δ = Muon − Adam."""
    bleu = Interval.of(list(paired_by_seed(finals, "dp_muon", "dp_adam", "bleu").values()))
    nll = Interval.of(list(paired_by_seed(finals, "dp_muon", "dp_adam", "test_nll").values()))
    if bleu is None or nll is None or min(bleu.n, nll.n) < len(SEEDS):
        return "waiting for the finals", bleu, nll
    if bleu.low > 0 and bleu.mean >= 5 and nll.mean <= 0:
        return "supported", bleu, nll
    if bleu.high < 0 or nll.low > 0:
        return "reversed", bleu, nll
    if abs(nll.mean) < 0.02 and abs(bleu.mean) < 2 and nll.inside(0.05) and bleu.inside(5):
        return "level", bleu, nll
    return "inconclusive", bleu, nll


def h1_needs_more_seeds(results: Path) -> bool:
    """Seeds 4–5 of DP-Adam and DP-Muon run when H1 on seeds 1–3 is inconclusive."""
    finals = load(results, "finals")
    first = {name: run for name, run in finals.items() if int(name.rsplit("_seed", 1)[1]) in SEEDS}
    return h1(first)[0] == "inconclusive"


def h2(finals: dict[str, Run]) -> tuple[str, Interval | None, Interval | None]:
    """H2 "DP-MuonBC > DP-Muon" by the pre-registered rule: (verdict, Δ NLL own rates, Δ NLL match_norm), test NLL."""
    own = Interval.of(list(paired_by_seed(finals, "dp_muonbc", "dp_muon", "test_nll").values()))
    matched = Interval.of(list(paired_by_seed(finals, "dp_muonbc_matched", "dp_muon", "test_nll").values()))
    if own is None or matched is None or min(own.n, matched.n) < len(SEEDS):
        return "waiting for the finals", own, matched
    if own.high >= 0:
        return "not supported", own, matched
    if matched.high < 0:
        return "supported, by its direction", own, matched
    return "supported: step length, not bias correction", own, matched


def tuning_markdown(results: Path) -> str:
    tune = load(results, "tune")
    grids = picks(results)
    rates = sorted({lr for rates_, _ in grids.values() for lr in rates_})
    lines = ["## Tuning (seed 0, validation NLL at step 100; * = the pick)", "", "| rate | " + " | ".join(LABELS[a] for a in ARMS) + " |"]
    lines.append("|---|" + "---|" * len(ARMS))
    for lr in rates:
        cells = []
        for arm in ARMS:
            rates_, pick = grids.get(arm, ([], None))
            run = tune.get(tune_name(arm, lr))
            value = read(run, "val_nll") if run else None
            if value is not None:
                cells.append(f"{value:.4f}{'*' if pick is not None and f'{pick:.4g}' == f'{lr:.4g}' else ''}")
            else:
                cells.append(NOT_RUN if any(f"{r:.4g}" == f"{lr:.4g}" for r in rates_) else "not in the grid")
        lines.append(f"| {lr:.4g} | " + " | ".join(cells) + " |")
    waiting = [LABELS[arm] for arm in ARMS if grids.get(arm, ([], None))[1] is None]
    if waiting:
        lines += ["", f"No pick yet: {', '.join(waiting)} (a rate of its grid is unpublished, an edge won and the grid grew, or DP-Muon's pick is pending)."]
    return "\n".join(lines) + "\n"


def arms_markdown(finals: dict[str, Run]) -> str:
    keys = (*METRICS, ("val_end", "val NLL, step 100"), ("val_last2", "val NLL, mean of steps 75–100"), ("epsilon", "ε spent"))
    lines = ["## Each arm's finals (mean over seeds [min, max], n)", "", "| | " + " | ".join(LABELS[a] for a in ARMS) + " |", "|---|" + "---|" * len(ARMS)]
    for key, label in keys:
        cells = []
        for arm in ARMS:
            values = [v for seed in (*SEEDS, *EXTRA_SEEDS) if (run := finals.get(f"{arm}_seed{seed}")) and (v := read(run, key)) is not None]
            cells.append(f"{statistics.mean(values):.4f} [{min(values):.4f}, {max(values):.4f}] ({len(values)})" if values else NOT_RUN)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def deltas_markdown(finals: dict[str, Run]) -> str:
    keys = (*METRICS, ("val_end", "val NLL, step 100"), ("val_last2", "val NLL, steps 75–100"))
    lines = ["## Paired Δ (same mechanism seed: same lots and noise; mean [95% t(n−1) interval]; per-seed signs)", ""]
    lines += ["| comparison | " + " | ".join(label for _, label in keys) + " |", "|---|" + "---|" * len(keys)]
    for a, b in COMPARISONS:
        cells = []
        for key, _ in keys:
            by_seed = paired_by_seed(finals, a, b, key)
            interval = Interval.of(list(by_seed.values()))
            signs = "".join("+" if d > 0 else "−" if d < 0 else "0" for d in by_seed.values())
            cells.append(f"{interval} {signs}" if interval else (f"{next(iter(by_seed.values())):+.4f} (n = 1)" if by_seed else NOT_RUN))
        lines.append(f"| {LABELS[a]} − {LABELS[b]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def verdicts_markdown(finals: dict[str, Run]) -> str:
    verdict1, bleu, nll = h1(finals)
    verdict2, own, matched = h2(finals)
    return (
        "\n".join(
            [
                "## The pre-registered rule (preregistration.md), applied",
                "",
                f'- **H1 "DP-Muon ≫ DP-Adam": {verdict1}.** Δ BLEU (Muon − Adam) {bleu or NOT_RUN}; Δ test NLL {nll or NOT_RUN}.',
                f'- **H2 "DP-MuonBC > DP-Muon": {verdict2}.** Δ test NLL at own rates {own or NOT_RUN}; match_norm − DP-Muon {matched or NOT_RUN}.',
            ]
        )
        + "\n"
    )


def delta_figure(finals: dict[str, Run], path: Path) -> None:
    fig, axes = plt.subplots(1, len(COMPARISONS), figsize=(3.6 * len(COMPARISONS), 3.0), sharey=True)
    for ax, (a, b) in zip(axes, COMPARISONS):
        curves: dict[int, list[float]] = defaultdict(list)
        for seed in (*SEEDS, *EXTRA_SEEDS):
            ra, rb = finals.get(f"{a}_seed{seed}"), finals.get(f"{b}_seed{seed}")
            if ra is None or rb is None:
                continue
            ca, cb = val_curve(ra), val_curve(rb)
            steps = sorted(set(ca) & set(cb))
            ax.plot(steps, [ca[s] - cb[s] for s in steps], color="#1f77b4", alpha=0.35, linewidth=0.8)
            for s in steps:
                curves[s].append(ca[s] - cb[s])
        ax.axhline(0.0, color="black", linewidth=0.8)
        if curves:
            steps = sorted(curves)
            ax.plot(steps, [statistics.mean(curves[s]) for s in steps], color="#1f77b4", linewidth=2, label="mean over seeds")
        else:
            ax.text(0.5, 0.5, NOT_RUN, ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{LABELS[a]} − {LABELS[b]}", fontsize=8)
        ax.set_xlabel("step")
    axes[0].set_ylabel("paired Δ validation NLL")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=_PNG_METADATA)
    plt.close(fig)


def write_report(results: Path, out: Path | None = None) -> list[Path]:
    out = out or results
    out.mkdir(parents=True, exist_ok=True)
    table, figure = out / "fair.md", out / "paired_delta.png"
    finals = load(results, "finals")
    header = (
        "# DP-Adam vs DP-Muon vs DP-MuonBC on SmolLM2-135M + LoRA (E2E, lot 64, 100 steps, ε = 8)\n\n"
        "From `python -m studies.smollm2_fair_report`; runs from `python -m studies.smollm2_fair run`; "
        "the decision rule was committed in `preregistration.md` before the study's first run.\n\n"
        f"{published_seeds_note(results)}\n\n"
    )
    sections = (tuning_markdown(results), arms_markdown(finals), deltas_markdown(finals), verdicts_markdown(finals))
    table.write_text(header + "\n".join(sections))
    delta_figure(finals, figure)
    return [table, figure]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for path in write_report(Path(argv[0]) if argv else RESULTS):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
