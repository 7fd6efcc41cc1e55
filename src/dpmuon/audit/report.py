"""Descriptions and tables of audit results (terminal text and markdown)."""

from __future__ import annotations

from .bound import guess_counts
from .canaries import AuditResult, AuditSetup


def describe(setup: AuditSetup) -> str:
    counts = guess_counts(setup.canaries, setup.guess_fractions)
    model = f"{setup.blocks} Dirac table(s)" if setup.model == "dirac" else "tiny GPT-2 (a block per tensor)"
    guesses = (
        f"guess counts {counts}, each tested at level β/{len(counts)} (Bonferroni)"
        if len(counts) > 1
        else f"one pre-declared guess count {counts[0]} ({setup.tails} tail{'s' if setup.tails == 'both' else ''})"
    )
    return (
        f"{setup.name}: {setup.canaries} canaries (each in with prob. 1/2) + {setup.ordinary} ordinary points, {model}, "
        f"engine {setup.engine}, N = {setup.dataset_size}, L = {setup.expected_lot_size} (q = {setup.sample_rate:.3g}), "
        f"{setup.steps} steps, C = {setup.clip_norm:g}, seed {setup.seed}; claim ε = {setup.epsilon:g}, δ = {setup.delta:g}; "
        f"score assumes noise σ/{setup.score_noise_divisor:g}; {guesses}"
    )


TABLE_HEADER = ("scenario", "seed", "mechanism", "engine", "claimed ε", "σ", "ε lower bound", "correct/guesses", "ceiling", "verdict", "seconds")


def table_rows(results: list[AuditResult]) -> list[tuple[str, ...]]:
    return [
        (
            r.scenario,
            str(r.seed),
            r.mechanism,
            r.engine,
            f"{r.claimed_epsilon:.3f}",
            f"{r.noise_multiplier:.3f}",
            f"{r.bound.epsilon:.3f}",
            f"{r.bound.correct}/{r.bound.guesses}",
            f"{r.ceiling:.2f}",
            r.verdict,
            f"{r.seconds:.0f}",
        )
        for r in results
    ]


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Aligned plain text, for the terminal."""
    widths = [max(len(row[i]) for row in [TABLE_HEADER, *rows]) for i in range(len(TABLE_HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [TABLE_HEADER, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
