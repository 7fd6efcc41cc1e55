"""Cost of adding a micro-batch's fp32 clipped sums into the lot's float64 totals, side by side:
whole tensors in one add each, against pieces of LOT_TOTAL_PIECE elements (what
`add_to_lot_total` does on the CPU). The shapes are GPT-2 small's (1.24e8 coordinates); the
values are checked equal. Prints the median seconds per micro-batch of each and their ratio.

    python scripts/bench_lot_total.py [--repeats 5] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from dpmuon.privacy.engines import base

# GPT-2 small's trainable matrices and vectors: 12 blocks of c_attn, c_proj, c_fc, mlp.c_proj,
# the tied 50,257 × 768 embedding and the 1024 × 768 positions (biases and norms are small).
SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12 + [(50257, 768), (1024, 768)]


def seconds(piece: int, totals: dict[str, torch.Tensor], part: dict[str, torch.Tensor]) -> float:
    base.LOT_TOTAL_PIECE = piece
    start = time.perf_counter()
    base.add_to_lot_total(totals, part)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    part = {f"w{i}": torch.randn(shape, generator=generator) for i, shape in enumerate(SHAPES)}
    ways = {"whole": 1 << 62, "pieces": base.LOT_TOTAL_PIECE}
    totals = {name: {key: value.double() for key, value in part.items()} for name in ways}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):  # interleaved: both see the same machine state
        for name, piece in ways.items():
            times[name].append(seconds(piece, totals[name], part))
    if not all(torch.equal(totals["whole"][key], totals["pieces"][key]) for key in part):
        raise SystemExit("the two ways of adding gave different totals")
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"threads: {args.threads}; {sum(p.numel() for p in part.values()):,} coordinates; pieces of {ways['pieces']:,}")
    print(f"whole s {median['whole']:.4f}   pieces s {median['pieces']:.4f}   pieces/whole {median['pieces'] / median['whole']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
