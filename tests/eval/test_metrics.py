"""Generation metrics against hand-computed values, and how references are grouped."""

from __future__ import annotations

import math
import re
from importlib.metadata import version

import pytest
import sacrebleu

from dpmuon.eval.metrics import SCORE_KEYS, corpus_bleu, lowercase_bleu, rouge_l, score, single_reference_bleu

# Two items whose BLEU statistics are counted by hand below (13a leaves these tokens alone).
HYP_CAT = "the cat sat on the mat"  # 6 tokens
REF_CAT = "the cat is on the mat"  # 6 tokens
HYP_ABC = "a b c d e"  # 5 tokens
REF_ABC_LONG = "a b c d e f g"  # 7 tokens
# Clipped n-gram matches / hypothesis n-grams, summed over both items:
#   1-grams: cat item 5/6 ("sat" unmatched), abc item 5/5  -> 10/11
#   2-grams: 3/5 ("the cat", "on the", "the mat") + 4/4      -> 7/9
#   3-grams: 1/4 ("on the mat") + 3/3                          -> 4/7
#   4-grams: 0/3 + 2/2                                         -> 2/5
GEOMETRIC_MEAN = (10 / 11 * 7 / 9 * 4 / 7 * 2 / 5) ** 0.25


def test_bleu_matches_hand_computed_precisions_and_brevity_penalty():
    # Hypothesis length 11 against reference length 6 + 7 = 13: BP = exp(1 - 13/11).
    expected = 100 * math.exp(1 - 13 / 11) * GEOMETRIC_MEAN
    assert corpus_bleu([HYP_CAT, HYP_ABC], [[REF_CAT], [REF_ABC_LONG]]) == pytest.approx(expected, abs=1e-9)


def test_variable_reference_counts_use_each_items_own_references():
    # The extra 5-token reference is closest in length to "a b c d e", so the effective
    # reference length becomes 6 + 5 = 11 = hypothesis length: BP = 1, precisions unchanged.
    references = [[REF_CAT], [REF_ABC_LONG, HYP_ABC]]
    assert corpus_bleu([HYP_CAT, HYP_ABC], references) == pytest.approx(100 * GEOMETRIC_MEAN, abs=1e-9)


def test_padding_does_not_change_bleu():
    # Repeating an item's own reference adds no n-grams and no new length, so it is the
    # equal-count reference set the None-padded streams must agree with.
    hypotheses = [HYP_CAT, HYP_ABC]
    padded = corpus_bleu(hypotheses, [[REF_CAT], [REF_ABC_LONG, HYP_ABC]])
    equal_counts = corpus_bleu(hypotheses, [[REF_CAT, REF_CAT], [REF_ABC_LONG, HYP_ABC]])
    assert padded == equal_counts


def test_empty_string_padding_would_have_changed_bleu():
    """Why the streams are padded with None: sacrebleu keeps "" as a length-0 reference."""
    # For a 3-token hypothesis a length-0 reference is closer than the 7-token real one.
    hypotheses = ["the cat sat", HYP_ABC]
    long_reference = "the cat sat on the mat today"
    with_none = sacrebleu.BLEU().corpus_score(hypotheses, [[long_reference, REF_ABC_LONG], [None, REF_ABC_LONG]])
    with_empty = sacrebleu.BLEU().corpus_score(hypotheses, [[long_reference, REF_ABC_LONG], ["", REF_ABC_LONG]])
    assert with_none.score == pytest.approx(corpus_bleu(hypotheses, [[long_reference], [REF_ABC_LONG]]))
    assert (with_none.ref_len, with_empty.ref_len) == (7 + 7, 0 + 7)
    assert with_empty.score > with_none.score


def test_blank_references_are_ignored():
    hypotheses = [HYP_CAT, HYP_ABC]
    clean = [[REF_CAT], [REF_ABC_LONG]]
    with_blanks = [["  ", REF_CAT], [REF_ABC_LONG, ""]]
    assert corpus_bleu(hypotheses, with_blanks) == corpus_bleu(hypotheses, clean)
    assert single_reference_bleu(hypotheses, with_blanks) == single_reference_bleu(hypotheses, clean)
    assert rouge_l(hypotheses, with_blanks) == rouge_l(hypotheses, clean)


def test_exact_match_scores_100():
    hypotheses = ["there is a pub called the eagle near the river ."]
    references = [["the eagle is a cheap pub .", hypotheses[0]]]
    assert corpus_bleu(hypotheses, references) == pytest.approx(100.0)
    assert rouge_l(hypotheses, references) == pytest.approx(100.0)


def test_multi_reference_grouping_matters():
    # Each hypothesis reproduces the 2nd reference of its own item only.
    hypotheses = ["the golden palace is a cheap coffee shop", "blue spice serves french food in the city centre"]
    references = [
        ["golden palace sells pricey food", hypotheses[0]],
        ["in riverside there is blue spice", hypotheses[1], "blue spice is family friendly"],
    ]
    assert corpus_bleu(hypotheses, references) == pytest.approx(100.0)
    assert single_reference_bleu(hypotheses, references) < 50.0
    # The same references attached to the wrong items do not give a perfect score.
    assert corpus_bleu(hypotheses, references[::-1]) < 50.0


def test_single_reference_bleu_uses_only_the_first_reference():
    hypotheses = [HYP_CAT, HYP_ABC]
    multi = [[REF_CAT], [REF_ABC_LONG, HYP_ABC]]
    assert single_reference_bleu(hypotheses, multi) == corpus_bleu(hypotheses, [[REF_CAT], [REF_ABC_LONG]])


def test_rouge_l_takes_best_reference_per_item_and_averages_items():
    hypotheses = [HYP_CAT, "x y z"]
    references = [["a dog sat on a rug", REF_CAT], ["x q z w"]]
    # Item 1: LCS with the 2nd reference is "the cat on the mat" (5 of 6 tokens each way): F = 5/6;
    #         the 1st reference only shares "sat on" (F = 1/3), so the max is 5/6.
    # Item 2: LCS "x z": P = 2/3, R = 2/4, F = 2PR / (P + R) = 4/7.
    expected = 100 * (5 / 6 + 4 / 7) / 2
    assert rouge_l(hypotheses, references) == pytest.approx(expected, abs=1e-9)


def test_score_reports_every_metric_and_its_implementation():
    result = score([HYP_CAT], [[REF_CAT]])
    assert tuple(result) == SCORE_KEYS  # the run summary writes exactly these keys
    assert set(SCORE_KEYS) == {"bleu", "bleu_lowercase", "bleu_single_ref", "rouge_l", "metric_implementations"}
    implementations = result["metric_implementations"]
    assert set(implementations) == set(SCORE_KEYS) - {"metric_implementations"}
    assert f"sacrebleu {sacrebleu.__version__}" in implementations["bleu"]
    assert "tokenize=13a" in implementations["bleu"] and "multi-reference" in implementations["bleu"]
    assert "case-sensitive" in implementations["bleu"]
    assert "lowercase" in implementations["bleu_lowercase"] and "multi-reference" in implementations["bleu_lowercase"]
    assert "tokenize=13a" in implementations["bleu_lowercase"] and "case-sensitive" not in implementations["bleu_lowercase"]
    assert "single reference" in implementations["bleu_single_ref"]
    assert implementations["rouge_l"].startswith(f"rouge-score {version('rouge-score')} RougeScorer(['rougeL']")
    assert "F-measure" in implementations["rouge_l"] and "max over references" in implementations["rouge_l"]


def test_lowercase_bleu_is_the_hand_computed_score_whatever_the_case():
    # The variable-reference-count case above (1 and 2 references, BP = 1), with the casing of a
    # hypothesis and of one reference changed: only the case-insensitive score is unaffected.
    hypotheses = [HYP_CAT.upper(), HYP_ABC]
    references = [[REF_CAT], [REF_ABC_LONG.title(), HYP_ABC.upper()]]
    assert lowercase_bleu(hypotheses, references) == pytest.approx(100 * GEOMETRIC_MEAN, abs=1e-9)
    assert corpus_bleu(hypotheses, references) < 100 * GEOMETRIC_MEAN - 10


def test_lowercase_bleu_uses_each_sources_own_references_in_any_number():
    # Sources with 1, 3 and 2 references; each hypothesis equals one of its own references up
    # to case, so only the case-insensitive score is perfect.
    hypotheses = ["The Eagle is a pub .", "Blue Spice serves French food .", "a b c d e"]
    references = [
        ["the eagle is a pub ."],
        ["blue spice is in riverside .", "BLUE SPICE SERVES FRENCH FOOD .", "blue spice is cheap"],
        ["A B C D E F G", "A B C D E"],
    ]
    assert lowercase_bleu(hypotheses, references) == pytest.approx(100.0)
    assert corpus_bleu(hypotheses, references) < 50.0
    # The same reference lists attached to the wrong sources match much less.
    assert lowercase_bleu(hypotheses, references[::-1]) < 50.0
    # Lowercasing is the only difference from the case-sensitive scorer.
    lowered = [[ref.lower() for ref in refs] for refs in references]
    assert lowercase_bleu(hypotheses, references) == corpus_bleu([h.lower() for h in hypotheses], lowered)


def test_lowercase_bleu_ignores_blank_references_like_bleu():
    hypotheses = [HYP_CAT, HYP_ABC]
    clean = [[REF_CAT], [REF_ABC_LONG]]
    with_blanks = [["  ", REF_CAT], [REF_ABC_LONG, ""]]
    assert lowercase_bleu(hypotheses, with_blanks) == lowercase_bleu(hypotheses, clean) == corpus_bleu(hypotheses, clean)


@pytest.mark.parametrize(
    ("hypotheses", "references", "message"),
    [
        (["a", "b"], [["a"]], "2 hypotheses but 1 reference lists"),
        (["a", "b"], [["a"], []], "item 1 has no (non-blank) reference"),
        (["a"], [["", "  "]], "item 0 has no (non-blank) reference"),
        (["a"], ["a"], "references of item 0 must be a list of strings"),
        ([], [], "empty corpus"),
        ([None], [["a"]], "hypothesis 0 is NoneType"),
    ],
)
def test_invalid_inputs_are_rejected(hypotheses, references, message):
    for metric in (corpus_bleu, lowercase_bleu, single_reference_bleu, rouge_l):
        with pytest.raises(ValueError, match=re.escape(message)):
            metric(hypotheses, references)
