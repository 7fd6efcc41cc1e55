"""Descriptions and tables of audit results (terminal text and markdown)."""

from __future__ import annotations

import math
from typing import Any

from .bound import guess_counts
from .canaries import AuditResult, AuditSetup


def describe(setup: AuditSetup) -> str:
    counts = guess_counts(setup.canaries, setup.guess_fractions)
    model = {
        "dirac": f"{setup.blocks} Dirac table(s)",
        "blocks": "Dirac coordinates in every block type (embedding, hidden Linear, LayerNorm weight and bias, RMSNorm weight, untied head)",
        "gpt2": "tiny GPT-2 (a block per tensor)",
    }[setup.model]
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


TABLE_HEADER = (
    "scenario",
    "seed",
    "mechanism",
    "engine",
    "claimed ε",
    "true ε",
    "σ",
    "ε lb (ε,δ)",
    "correct/guesses",
    "ceiling",
    "μ̂ (GDP lb)",
    "ε of μ̂",
    "μ claim",
    "claim p",
    "verdict",
    "noise std ratio (p)",
    "lot-rate p",
    "noise-reuse p",
    "lot-reuse p",
    "seconds",
)


def table_rows(results: list[AuditResult] | list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One row per audit, from AuditResults or from their `to_dict()` (a saved audit.json):
    the same text either way, so a committed table regenerates from its committed JSON."""
    rows = []
    for result in results:
        r = result.to_dict() if isinstance(result, AuditResult) else result
        bound, fdp = r["bound"], r["fdp"]
        rows.append(
            (
                r["scenario"],
                str(r["seed"]),
                r["mechanism"],
                r["engine"],
                f"{r['claimed_epsilon']:.3f}",
                "∞" if r["true_epsilon"] is None or math.isinf(r["true_epsilon"]) else f"{r['true_epsilon']:.2f}",
                f"{r['noise_multiplier']:.3f}",
                f"{bound['epsilon']:.3f}",
                f"{bound['correct']}/{bound['guesses']}",
                f"{r['ceiling']:.2f}",
                f"{fdp['mu']:.3f}",
                f"{fdp['epsilon']:.2f}",
                f"{fdp['mu_claim']:.3f}",
                f"{fdp['claim_p_value']:.2g}",
                r["verdict"],
                f"{r['noise_std_ratio']:.4f} ({r['noise_p_value']:.2g})" + (" FLAGGED" if r["noise_flagged"] else ""),
                f"{r['lot_rate_p_value']:.2g}" + (" FLAGGED" if r["sampler_flagged"] else ""),
                _check_cell(r, "noise_reuse"),
                _check_cell(r, "lot_reuse"),
                f"{r['seconds']:.0f}",
            )
        )
    return rows


def _check_cell(r: dict[str, Any], check: str) -> str:
    """A check's p-value and flag; "—" in a summary saved before the check existed."""
    if f"{check}_p_value" not in r:
        return "—"
    return f"{r[f'{check}_p_value']:.2g}" + (" FLAGGED" if r[f"{check}_flagged"] else "")


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Aligned plain text, for the terminal."""
    widths = [max(len(row[i]) for row in [TABLE_HEADER, *rows]) for i in range(len(TABLE_HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [TABLE_HEADER, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
