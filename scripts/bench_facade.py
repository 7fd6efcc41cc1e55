"""`make_private`'s own loop, timed: what a library user's private step costs.

Each variant is a `dpmuon.make_private` over E2E's whole training set (encoded as the driver
encodes it, every row padded by the user's collate function to dataset.max_length with an
attention mask), stepped as the library's docs show: `release(lot)`, then a DP-Adam step.

- `widths`: the default, constant-time lots in the few widths cut from collate_fn's width
  (the length histogram released once first);
- `one-width`: constant-time lots with every row collate_fn's width (`width_buckets=1`);
- `as-drawn`: lots as drawn (`constant_time=False`);
- `non-private`: the same lots, sorted by length, each micro-batch padded to its own longest
  example, the mean loss's backward and torch's Adam (the driver's non-private batching).

All variants share one secret seed, so they draw the same lots (checked). They live in one process
and take turns, one round a step, in a rotated order; each row reports the median seconds a step
and its ratio to non-private and to one width. Timing only: the run folders are temporary.

    DPMUON_DATA_DIR=… DPMUON_TOKENIZER=… python scripts/bench_facade.py --lot 256 --steps 3 --threads 2 \
        --json results/bench/facade_tiny_lot256.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_step import build_bench_model, e2e_train
from torch.nn.functional import pad

import dpmuon
from dpmuon.data import collate
from dpmuon.jsontext import to_json
from dpmuon.models import per_example_lm_loss
from dpmuon.privacy.seed import MECHANISM_SEED_ENV
from dpmuon.privacy.subnormals import start_flushing_threads
from dpmuon.training.run_files import code_version

MODEL = "tiny"  # bench_step.py's: GPT-2's vocabulary, 4 layers of 128
# A public seed for timing only: every variant draws the same lots from it.
BENCH_SEED = 0xB3_4C_FA_CA_DE_00_11_22_33_44_55_66_77_88_99_AA
VARIANTS = {"widths": {}, "one-width": {"width_buckets": 1}, "as-drawn": {"constant_time": False}}
# The plan's length sets B_max (the truncation charge grows with the steps), as bench_step.py's PLAN_STEPS.
PLAN_STEPS = 1000


def fixed_width(pad_id: int, width: int):
    """A user's collate function: every row right-padded to `width`, padding masked and unsupervised."""
    fills = {"input_ids": pad_id, "attention_mask": 0, "labels": -100}

    def collate_fn(rows):
        batch = collate(rows, pad_id)
        return {k: pad(v, (0, width - v.shape[1]), value=fills[k]) for k, v in batch.items()}

    return collate_fn


def private_run(name: str, train: list, collate_fn, args, run_dir: Path):
    """(PrivateTraining, its DP-Adam, its lots) of one variant."""
    model = build_bench_model(MODEL).train()
    private = dpmuon.make_private(
        model, train, collate_fn, per_example_lm_loss, run_dir=run_dir / name, steps=PLAN_STEPS, micro_batch_size=args.micro_batch,
        target_epsilon=8.0, delta=1e-5, expected_lot_size=args.lot, **VARIANTS[name],
    )  # fmt: skip
    return private, dpmuon.optim.build("dp_adam", model, private, lr=1e-3), private.lots()


def private_step(private, optimizer, lots, lot: list[int]) -> float:
    """Seconds of one release and optimizer step, over `lot` (every variant's next lot)."""
    drawn = next(lots)
    if drawn.indices != lot:
        raise RuntimeError("the variants drew different lots from one seed: the comparison would not be fair")
    start = time.perf_counter()
    private.release(drawn)
    optimizer.step()
    return time.perf_counter() - start


def non_private_step(model, optimizer, train: list, lot: list[int], micro_batch: int, pad_id: int) -> float:
    """Seconds of one non-private step over the same lot (the mean loss of its examples)."""
    ordered = sorted(lot, key=lambda i: len(train[i].input_ids))
    start = time.perf_counter()
    for first in range(0, len(ordered), micro_batch):
        batch = collate([train[i] for i in ordered[first : first + micro_batch]], pad_id)
        (per_example_lm_loss(model, batch).sum() / max(1, len(lot))).backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lot", type=int, default=256, help="expected lot size")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (rounds), after one warm-up step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    start_flushing_threads(args.threads)
    os.environ[MECHANISM_SEED_ENV] = str(BENCH_SEED)
    train, pad_id, width = e2e_train(MODEL)
    collate_fn = fixed_width(pad_id, width)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: private_run(name, train, collate_fn, args, Path(tmp)) for name in VARIANTS}
        _, _, source = private_run("as-drawn", train, collate_fn, args, Path(tmp) / "lots")  # the lots every variant draws
        lots = [next(source).indices for _ in range(args.steps + 1)]
        plan = runs["widths"][0].plan
        print(
            f"E2E N={len(train):,}, expected lot {args.lot}, micro-batches of {args.micro_batch}, {args.threads} threads: B_max {plan.max_lot_size}"
            f" in widths {', '.join(f'{r}×{w}' for w, r in plan.widths)} (one width: {runs['one-width'][0].plan.max_lot_size}×{width})",
            file=sys.stderr,
            flush=True,
        )
        model = build_bench_model(MODEL).train()
        adam = torch.optim.Adam(model.parameters(), lr=1e-3)
        seconds: dict[str, list[float]] = {name: [] for name in [*VARIANTS, "non-private"]}
        names = list(seconds)
        for step, lot in enumerate(lots):  # step 0 warms up
            shift = step % len(names)
            for name in names[shift:] + names[:shift]:
                if name == "non-private":
                    took = non_private_step(model, adam, train, lot, args.micro_batch, pad_id)
                else:
                    took = private_step(*runs[name], lot)
                if step > 0:
                    seconds[name].append(took)
            print(f"  step {step} done{' (warm-up)' if step == 0 else ''}", file=sys.stderr, flush=True)
    report(seconds, runs, args, width)


def report(seconds, runs, args, width) -> None:
    medians = {name: statistics.median(t) for name, t in seconds.items()}
    rows = {
        name: {
            "seconds": seconds[name],
            "median_s": medians[name],
            "vs_non_private": medians["non-private"] / medians[name],
            "vs_one_width": medians["one-width"] / medians[name],
        }
        for name in seconds
    }
    print(f"seconds a step (median of {args.steps}), throughput × non-private, × one width")
    for name, row in rows.items():
        print(f"  {name:12} {row['median_s']:8.2f} s  {row['vs_non_private']:.3f}  {row['vs_one_width']:.3f}")
    if args.json:
        plan = runs["widths"][0].plan
        meta = {
            "settings": {"lot": args.lot, "micro_batch": args.micro_batch, "steps": args.steps, "threads": args.threads, "model": "tiny", "data": "e2e"},
            "torch": torch.__version__,
            "git_commit": code_version(),
            "command": " ".join(["python", "scripts/bench_facade.py", *sys.argv[1:]]),
            "max_lot_size": {name: run[0].plan.max_lot_size for name, run in runs.items()},
            "widths": [list(bucket) for bucket in plan.widths],
            "max_length": width,
        }
        args.json.write_text(to_json({**meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
