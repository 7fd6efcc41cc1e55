"""The paper's reported test-set numbers, quoted (not reproduced) for comparison tables.

Source: the paper's tables (Kim & Fan, arXiv 2605.12994). None marks a cell whose number was
not available to us.
"""

from __future__ import annotations

PAPER_CITATION = "Kim & Fan 2026 (arXiv 2605.12994), GPT-2, ε≈8"
PAPER_MODEL = "pretrained GPT-2 (124M)"
PAPER_TARGET_EPSILON = 8.0

# Keyed by (dataset, optimizer) with this package's lower-case names.
PAPER_RESULTS: dict[tuple[str, str], dict[str, float | None]] = {
    ("e2e", "dp_adam"): {"nll": 0.4961, "bleu": 18.49, "rouge_l": None},
    ("e2e", "dp_muon"): {"nll": 0.4553, "bleu": 32.91, "rouge_l": None},
    ("e2e", "dp_muonbc"): {"nll": 0.4490, "bleu": 34.92, "rouge_l": None},
    ("dart", "dp_muonbc"): {"nll": 0.4460, "bleu": 7.50, "rouge_l": 34.42},
}


def paper_result(dataset: str, optimizer: str, target_epsilon: float | None) -> dict[str, float | None] | None:
    """The paper's numbers for this setting, or None when the paper has no comparable row."""
    if target_epsilon is None or abs(target_epsilon - PAPER_TARGET_EPSILON) > 1e-9:
        return None
    return PAPER_RESULTS.get((dataset.lower(), optimizer.lower()))
