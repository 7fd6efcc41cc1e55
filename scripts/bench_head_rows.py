"""The LM head's active rows in the fast engine, copied or moved in place, timed in one process.

`moved` is what the engine does where a trace holds its own output gradients: the book-keeping
moves the active rows to the front of the head's output gradients (`kernels.compact_rows_`), and
an example's rows in its Gram are a view where they are one run. `copied` forces the fallback,
fresh copies by `index_select`, which is what the engine did before. A private DP-Adam step with
lots as drawn (constant-time lots keep every row, so neither way applies there) and its
non-private twin take turns on the same E2E lot, one round a step and the order reversed every
other round, so that the machine's drift between processes, which is as large as the effect
between two runs of `bench_step.py`, hits all three alike. Prints and records the median seconds
of each and × non-private.

    DPMUON_DATA_DIR=… DPMUON_TOKENIZER=… python scripts/bench_head_rows.py --lot 256 --steps 8 --threads 2 \
        --json results/bench/head_rows_tiny_lot256.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from bench_step import Config, Runner, batch_lot, compose_config, e2e_lot

from dpmuon.jsontext import to_json
from dpmuon.privacy.engines.fast import kernels
from dpmuon.privacy.subnormals import start_flushing_threads
from dpmuon.training.run_files import code_version

MOVED, COPIED, NON_PRIVATE = "moved", "copied", "non-private"


def rows_moved(moved: bool, compact=kernels.compact_rows_, select=kernels._select_rows) -> None:
    """The engine's own row handling, or its copying fallback for both the book-keeping and the Gram."""
    kernels.compact_rows_ = compact if moved else (lambda x, keep: None)
    kernels._select_rows = select if moved else (lambda x, rows: x.index_select(0, rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--lot", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="rounds; each runs the three steps once")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    start_flushing_threads(args.threads)  # as the driver and bench_step.py
    examples, pad_id, lengths = e2e_lot(args.lot, args.seed, args.model)
    width = int(compose_config().dataset.max_length)
    lots = batch_lot(examples, pad_id, args.micro_batch, width, lengths)
    private, twin = Config("fast", "per_matrix", "dp_adam", "as-drawn"), Config("non-private", "-", "adam")
    device = torch.device("cpu")
    runners = {c: Runner(compose_config(*c.overrides), args.model, args.lot, device, variant=c.variant) for c in (private, twin)}

    def step(way: str) -> float:
        if way == NON_PRIVATE:
            return runners[twin].step(lots.of(twin))[0]
        rows_moved(way == MOVED)
        return runners[private].step(lots.of(private))[0]

    for way in (NON_PRIVATE, COPIED, MOVED):  # warm-up: optimizer state, allocator
        step(way)
    seconds: dict[str, list[float]] = {NON_PRIVATE: [], COPIED: [], MOVED: []}
    for round_ in range(args.steps):
        order = [COPIED, MOVED, NON_PRIVATE] if round_ % 2 == 0 else [NON_PRIVATE, MOVED, COPIED]
        for way in order:
            seconds[way].append(step(way))
        print(f"  round {round_ + 1}/{args.steps}: " + ", ".join(f"{w} {seconds[w][-1]:.2f} s" for w in seconds), file=sys.stderr, flush=True)
    rows_moved(True)
    median = {way: statistics.median(s) for way, s in seconds.items()}
    ratio = {way: median[NON_PRIVATE] / median[way] for way in (COPIED, MOVED)}
    print(f"{args.model}, E2E lot {args.lot} in micro-batches of {args.micro_batch}, {torch.get_num_threads()} threads, {args.steps} rounds")
    print(f"non-private Adam {median[NON_PRIVATE]:.3f} s")
    for way in (COPIED, MOVED):
        print(f"DP-Adam as drawn, head rows {way}: {median[way]:.3f} s, {ratio[way]:.3f}× non-private")
    if args.json:
        meta = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "torch": torch.__version__}
        meta |= {"git_commit": code_version(), "command": " ".join(["python", "scripts/bench_head_rows.py", *sys.argv[1:]])}
        args.json.write_text(to_json({**meta, "seconds": seconds, "median_s": median, "vs_non_private": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
