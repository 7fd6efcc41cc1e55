"""Paired comparison of two optimizers from same-seed differences."""

from __future__ import annotations

from helpers_runs import write_run


def test_paired_comparison_uses_same_seed_differences(tmp_path):
    from dpmuon.eval.cli import compare_main

    for seed, (nll_a, nll_b) in enumerate(((1.0, 1.5), (2.0, 2.25), (3.0, 2.9))):
        write_run(tmp_path / "runs", f"a{seed}", optimizer="dp_muon", seed=seed, test_nll=nll_a, bleu=10.0 + seed)
        write_run(tmp_path / "runs", f"b{seed}", optimizer="dp_adam", seed=seed, test_nll=nll_b, bleu=10.0)
    assert compare_main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "e2e" / "comparison.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| dp_adam | dp_muon"))
    # A = dp_adam (table order), differences +0.5, +0.25, -0.1: mean +0.2167, A better (lower NLL) on 1 of 3.
    assert "+0.2167 ± 0.3014 (A better on 1/3)" in row
    assert "-1.00 ± 1.00 (A better on 0/3)" in row  # BLEU: 0, -1, -2
    assert "not measured" in row  # rouge_l is null in the fixture


def test_the_caption_does_not_claim_shared_lots_and_noise(runs_root):
    """By default each run draws its lots and noise from its own secret randomness, whatever its seed."""
    from dpmuon.eval.compare import comparison_markdown
    from dpmuon.eval.runs import find_runs

    text = comparison_markdown("e2e", [run for run in find_runs([runs_root]) if run.dataset == "e2e"])
    assert "same seed = same lots and noise" not in text and "not by default" in text
