"""How tightly constant-time lots fit a data set's lengths: the token positions a step computes
against the tokens its lot holds, for the driver's width buckets and for a packed layout.

No timing: shapes only, from the training set's length histogram (E2E by default, as the
driver encodes it), the default plan (ε, δ, epochs from conf/) and `privacy/lot_bound.py`.
For each expected lot size it prints

- B_max/(Nq): the rows' bound over the expected lot (what constant-time lots cost at least);
- the driver's widths (from a seeded stand-in for the histogram's private release) — their
  positions over the expected tokens, and that over B_max/(Nq) (the widths' slack);
- the same widths' slack with the exact counts (what the private release costs) and with 16
  widths on a 2-token grid (the floor of one tail bound per width);
- packing: one Chernoff bound on the lot's tokens (exact counts, the share of δ the rows and
  widths get) and first-fit into rows of W tokens (each row but the last is filled past W − L_max);
- the head's ghost-Gram work, Σ rows × width², over the lot's own Σ L² (what as drawn costs):
  a packed row's Gram spans the whole row, its segments' blocks are all the norms need.

    DPMUON_DATA_DIR=… DPMUON_TOKENIZER=… python scripts/lot_shapes.py --json results/bench/lot_shapes_e2e.json
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import minimize_scalar

from dpmuon.config import compose_config
from dpmuon.data import load_tokenizer
from dpmuon.jsontext import to_json
from dpmuon.privacy import lot_bound as lb
from dpmuon.training.data import prepare_data
from dpmuon.training.run_files import code_version

SEED = 0


def training_lengths(dataset: str) -> tuple[list[int], int]:
    cfg = compose_config(f"dataset={dataset}", "data.max_valid_examples=1", "data.max_test_sources=1")
    train = prepare_data(cfg.dataset, cfg.data, load_tokenizer(None), int(cfg.dataset.max_length), log=lambda message: None).train
    return [len(example.input_ids) for example in train], int(cfg.dataset.max_length)


def positions(buckets: lb.Buckets) -> tuple[int, int]:
    """(token positions, Σ rows × width²) of a step in these buckets."""
    return sum(w * r for w, r in buckets), sum(w * w * r for w, r in buckets)


def exact_bounds(counts: np.ndarray, dataset_size: int) -> list[int]:
    above = np.cumsum(counts[::-1])[::-1]
    return [dataset_size] + [int(above[w + 1]) for w in range(1, len(counts) - 1)] + [0]


def token_bound(counts: np.ndarray, extra_length: int, q: float, allowed: float) -> int:
    """The least τ with Chernoff's bound on log P(Σ_i X_i·L_i > τ) ≤ allowed, X_i ~ Bernoulli(q)
    over the examples counted plus one of `extra_length` tokens (the add/remove neighbour)."""
    lengths = np.arange(len(counts), dtype=np.float64)
    weights = counts.astype(np.float64).copy()
    weights[extra_length] += 1

    def log_bound(tau: float) -> float:
        cgf = lambda lam: float(np.sum(weights * np.log1p(q * np.expm1(lam * lengths))))  # noqa: E731
        best = minimize_scalar(lambda lam: cgf(lam) - lam * (tau + 1), bounds=(0.0, 50.0 / lengths[-1]), method="bounded")
        return best.fun

    low, high = int(q * float(weights @ lengths)), int(weights @ lengths)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if log_bound(middle) <= allowed else (middle + 1, high)
    return high


def shapes(lengths: list[int], max_length: int, lot: int, epochs: int, epsilon: float, delta: float, sigma: float) -> dict:
    counts = lb.length_histogram(lengths, max_length)
    n = len(lengths)
    q = lot / n
    steps = max(1, round(epochs * n / lot))
    allowed = lb.allowed_log_tail(steps, epsilon, delta)
    tokens = q * float(counts @ np.arange(len(counts)))
    square_tokens = q * float(counts @ np.arange(len(counts)) ** 2)
    b_max = lb.lot_bound(n, q, steps, epsilon, delta)[0]
    released = counts + np.random.default_rng(SEED).normal(0.0, sigma, len(counts))
    driver, _ = lb.bucketed_lot_bound(released, sigma, n, q, steps, epsilon, delta, 8)
    rows_allowed, widths_allowed = allowed + math.log(lb.ROWS_PART), allowed + math.log(lb.WIDTHS_PART)
    exact, _ = lb.width_buckets(exact_bounds(counts, n), q, rows_allowed, widths_allowed, 8)
    step, lb.WIDTH_STEP = lb.WIDTH_STEP, 2
    try:
        floor, _ = lb.width_buckets(exact_bounds(counts, n), q, rows_allowed, widths_allowed, 16)
    finally:
        lb.WIDTH_STEP = step

    def layout(spots: int, gram: int, **shape) -> dict:
        return {**shape, "positions_over_tokens": spots / tokens, "slack": spots / tokens / (b_max / lot), "gram_over_as_drawn": gram / square_tokens}

    row = {"lot": lot, "steps": steps, "b_max": b_max, "b_max_over_nq": b_max / lot, "tokens": tokens}
    for name, buckets in (("driver_widths", driver), ("exact_counts", exact), ("16_widths_exact", floor)):
        row[name] = layout(*positions(buckets), buckets=buckets)
    tau = token_bound(counts, max_length, q, allowed + math.log(lb.ROWS_PART + lb.WIDTHS_PART))
    row["packed_token_bound"] = tau
    for width in (256, 512, 1024):
        rows = tau // (width - max_length + 1) + 1
        row[f"packed_{width}"] = layout(rows * width, rows * width * width, rows=rows)
    return row


def print_table(rows: list[dict]) -> None:
    columns = ["driver_widths", "exact_counts", "16_widths_exact", "packed_256", "packed_512", "packed_1024"]
    print("positions / expected tokens, and that over B_max/(Nq) (slack); head Gram work over as drawn")
    print(f"{'lot':>5} {'B_max/(Nq)':>10}  " + "  ".join(f"{c:>22}" for c in columns))
    for row in rows:
        cells = [f"{row[c]['positions_over_tokens']:.2f} ({row[c]['slack']:.2f}) g{row[c]['gram_over_as_drawn']:.1f}" for c in columns]
        print(f"{row['lot']:>5} {row['b_max_over_nq']:>10.3f}  " + "  ".join(f"{c:>22}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="e2e")
    parser.add_argument("--lots", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cfg = compose_config(f"dataset={args.dataset}")
    lengths, max_length = training_lengths(args.dataset)
    settings = (int(cfg.trainer.epochs), float(cfg.privacy.target_epsilon), float(cfg.dataset.delta), float(cfg.privacy.length_noise_multiplier))
    rows = [shapes(lengths, max_length, lot, *settings) for lot in args.lots]
    print_table(rows)
    if args.json:
        command = " ".join(["python scripts/lot_shapes.py", *sys.argv[1:]])
        args.json.write_text(to_json({"command": command, "git_commit": code_version(), "dataset": args.dataset, "N": len(lengths), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
