"""Corpus metrics for table-to-text generation: BLEU (sacrebleu) and ROUGE-L (rouge-score).

Every hypothesis comes with the references written for its source (E2E: 1 to 45 per meaning
representation; DART: 1 to 35 per tripleset). Blank references are ignored: they contain no
n-grams, so they can only distort BLEU's brevity penalty (sacrebleu would treat one as a
reference of length 0) and can never be ROUGE-L's best match. DART's test split has one.

Two BLEU conventions are reported. `bleu` is sacrebleu's default, case-sensitive. `bleu_lowercase`
lowercases hypotheses and references before the same 13a tokenization: the convention of the
E2E challenge's official scorer (NIST mteval-v13a, run without -c, i.e. case-insensitive, all
references per source), which the E2E numbers of prior (DP) work were computed with.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import version

import sacrebleu
from rouge_score import rouge_scorer

BLEU_TOKENIZER = "13a"
ROUGE_USE_STEMMER = False

_BLEU_BASE = f"sacrebleu {sacrebleu.__version__} corpus_bleu, tokenize={BLEU_TOKENIZER}, smooth=exp, case-sensitive"
_BLANKS_IGNORED = "blank references ignored"
_MULTI_REFERENCE = "multi-reference (all references per source)"
BLEU_IMPLEMENTATION = f"{_BLEU_BASE}, {_MULTI_REFERENCE}, {_BLANKS_IGNORED}"
BLEU_LOWERCASE_IMPLEMENTATION = (
    f"sacrebleu {sacrebleu.__version__} corpus_bleu, tokenize={BLEU_TOKENIZER}, smooth=exp, lowercase "
    f"(mteval-v13a's case-insensitive default, as the E2E challenge scored), {_MULTI_REFERENCE}, {_BLANKS_IGNORED}"
)
BLEU_SINGLE_REF_IMPLEMENTATION = f"{_BLEU_BASE}, single reference (first non-blank reference per source)"
ROUGE_L_IMPLEMENTATION = (
    f"rouge-score {version('rouge-score')} RougeScorer(['rougeL'], use_stemmer={ROUGE_USE_STEMMER}), "
    f"F-measure, max over references per source, mean over sources, x100, {_BLANKS_IGNORED}"
)


# Exactly the keys `score` returns: the run summary carries each of them (null when not scored).
SCORE_KEYS = ("bleu", "bleu_lowercase", "bleu_single_ref", "rouge_l", "metric_implementations")


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU (0-100) of `hypotheses[i]` against all of `references[i]`."""
    cleaned = _validated(hypotheses, references)
    return _sacrebleu_score(hypotheses, _reference_streams(cleaned))


def lowercase_bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU (0-100) against all references, case-insensitive (the E2E challenge's convention)."""
    cleaned = _validated(hypotheses, references)
    return _sacrebleu_score(hypotheses, _reference_streams(cleaned), lowercase=True)


def single_reference_bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU (0-100) against only the first (non-blank) reference of each item."""
    cleaned = _validated(hypotheses, references)
    return _sacrebleu_score(hypotheses, [[refs[0] for refs in cleaned]])


def rouge_l(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Mean over items of the best ROUGE-L F-measure against any of the item's references, x100."""
    cleaned = _validated(hypotheses, references)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=ROUGE_USE_STEMMER)
    best = [max(scorer.score(reference, hypothesis)["rougeL"].fmeasure for reference in refs) for hypothesis, refs in zip(hypotheses, cleaned)]
    return 100.0 * sum(best) / len(best)


def score(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict:
    """All generation metrics, plus the exact scorer behind each (tables must name it)."""
    return {
        "bleu": corpus_bleu(hypotheses, references),
        "bleu_lowercase": lowercase_bleu(hypotheses, references),
        "bleu_single_ref": single_reference_bleu(hypotheses, references),
        "rouge_l": rouge_l(hypotheses, references),
        "metric_implementations": {
            "bleu": BLEU_IMPLEMENTATION,
            "bleu_lowercase": BLEU_LOWERCASE_IMPLEMENTATION,
            "bleu_single_ref": BLEU_SINGLE_REF_IMPLEMENTATION,
            "rouge_l": ROUGE_L_IMPLEMENTATION,
        },
    }


def _sacrebleu_score(hypotheses: Sequence[str], reference_streams: list[list[str | None]], lowercase: bool = False) -> float:
    # force=True only silences sacrebleu's "forgot to detokenize?" warning: E2E's default
    # (Prefix-Tuning) format is tokenized on purpose, on both sides. Scores are unchanged.
    metric = sacrebleu.BLEU(tokenize=BLEU_TOKENIZER, lowercase=lowercase, force=True)
    return float(metric.corpus_score(list(hypotheses), reference_streams).score)


def _reference_streams(references: list[list[str]]) -> list[list[str | None]]:
    """Transpose per-item reference lists into the reference streams sacrebleu expects.

    Stream k holds every item's k-th reference. Items with fewer references are padded with
    None, which sacrebleu drops before matching; padding with "" would instead add a length-0
    reference and change the brevity penalty.
    """
    width = max(len(refs) for refs in references)
    return [[refs[k] if k < len(refs) else None for refs in references] for k in range(width)]


def _validated(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> list[list[str]]:
    """Check the inputs and return each item's references with blank ones removed."""
    if isinstance(hypotheses, str) or isinstance(references, str):
        raise ValueError("hypotheses and references must be sequences, not a single string")
    if len(hypotheses) != len(references):
        raise ValueError(f"got {len(hypotheses)} hypotheses but {len(references)} reference lists")
    if not hypotheses:
        raise ValueError("cannot score an empty corpus")
    cleaned = []
    for index, (hypothesis, refs) in enumerate(zip(hypotheses, references)):
        if not isinstance(hypothesis, str):
            raise ValueError(f"hypothesis {index} is {type(hypothesis).__name__}, expected str")
        # A bare string here would be read as a list of one-character references.
        if isinstance(refs, str) or not isinstance(refs, Sequence) or not all(isinstance(ref, str) for ref in refs):
            raise ValueError(f"references of item {index} must be a list of strings")
        non_blank = [ref for ref in refs if ref.strip()]
        if not non_blank:
            raise ValueError(f"item {index} has no (non-blank) reference")
        cleaned.append(non_blank)
    return cleaned
