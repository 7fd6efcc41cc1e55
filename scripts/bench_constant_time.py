"""Step time of constant-time lots for very different lot sizes, and what the padding costs.

Runs the real driver (`dpmuon.training.loop.run`) with the lot sampler replaced by a fixed cycle
of lot sizes — the expected size, 1 example, the expected size again, and more than the bound
(which the driver truncates to B_max) — and reads each step's time from the run's owner-only
diagnostics.jsonl. The sizes alternate step by step within one process, so load from other
processes and drift hit them alike. With privacy.constant_time=true every size should take the
same time per step (the claim: within 5%); a second run without constant time, on lots of the
expected size, gives the unpadded cost the padding is compared with. Medians over steps 2….

    DPMUON_DATA_DIR=… DPMUON_TOKENIZER=… python scripts/bench_constant_time.py --threads 1
    … python scripts/bench_constant_time.py --device cuda --model gpt2 --lot 256 --micro-batch 32 --steps 41
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from dpmuon.config import compose_config
from dpmuon.eval.runs import DIAGNOSTICS_FILE
from dpmuon.privacy import mechanism
from dpmuon.training import loop


class PatternLots:
    """Lots of the given sizes in turn, truncated to the constant-time bound as the real sampler does."""

    def __init__(self, sizes: list[int], max_lot_size: int | None):
        self.sizes, self.max_lot_size, self.step = sizes, max_lot_size, 0

    def next_lot(self) -> list[int]:
        size = self.sizes[self.step % len(self.sizes)]
        self.step += 1
        return list(range(size if self.max_lot_size is None else min(size, self.max_lot_size)))

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def step_times(overrides: list[str], sizes: list[int], run_dir: Path) -> tuple[dict[int, list[float]], int | None]:
    """Seconds of steps 2… of one run whose lots have `sizes` in turn, by the lot size asked
    for; and the run's B_max."""
    mechanism.build_lot_sampler = lambda *a, max_lot_size=None, **k: PatternLots(sizes, max_lot_size)  # where the mechanism is built
    summary = loop.run(compose_config(*overrides), run_dir)
    rows = [json.loads(line) for line in (run_dir / DIAGNOSTICS_FILE).read_text().splitlines()]
    by_size: dict[int, list[float]] = {}
    for row in rows:
        if row["step"] > 1:
            by_size.setdefault(sizes[(row["step"] - 1) % len(sizes)], []).append(row["step_seconds"])
    return by_size, summary["max_lot_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="conf/model option (random init: tiny; pretrained: e.g. gpt2)")
    parser.add_argument("--optimizer", default="dp_adam")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--lot", type=int, default=16, help="expected lot size")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=13, help="1 warm-up step, then the sizes in turn (4 per cycle)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--train-examples", type=int, default=600)
    args = parser.parse_args()

    base = [
        "experiment=smoke", f"model={args.model}", f"optimizer={args.optimizer}", f"trainer.device={args.device}",
        f"privacy.expected_lot_size={args.lot}", f"trainer.micro_batch_size={args.micro_batch}", f"trainer.steps={args.steps}",
        f"data.max_train_examples={args.train_examples}", "privacy.noise_multiplier=1.0", "eval.test=false", "eval.validation=false",
        "trainer.checkpoint_every=0", "trainer.keep_checkpoint=false", "logging.progress=false", "logger=none",
        "logging.epsilon_every=100000",  # ε at the last step only: the accountant's time is not the step's
        *([f"trainer.num_threads={args.threads}"] if args.threads else []),
    ]  # fmt: skip
    if args.model == "tiny":
        base += ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.n_positions=160"]
    huge = 100 * args.lot  # truncated to B_max
    with tempfile.TemporaryDirectory() as work:
        padded, bound = step_times(base, [args.lot, 1, args.lot, huge], Path(work) / "constant")
        unpadded, _ = step_times([*base, "privacy.constant_time=false"], [args.lot], Path(work) / "as-drawn")
    median = {size: statistics.median(seconds) for size, seconds in padded.items()}
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"{args.model}, {args.optimizer}, lot {args.lot} → B_max {bound}, micro-batch {args.micro_batch}, {device}; medians of steps 2…{args.steps}")
    for size, label in ((args.lot, f"lots of {args.lot}"), (1, "lots of 1"), (huge, f"lots of {bound} (truncated)")):
        print(f"  constant time, {label:28s} {median[size] * 1000:9.1f} ms/step  (n={len(padded[size])})")
    print(f"  lots as drawn, lots of {args.lot:<14d}          {statistics.median(unpadded[args.lot]) * 1000:9.1f} ms/step")
    spread = max(median.values()) / min(median.values())
    print(f"  slowest / fastest lot size under constant time: {spread:.3f}   (claim: within 5%)")
    print(f"  padding cost (constant time / as drawn, lots of {args.lot}): {median[args.lot] / statistics.median(unpadded[args.lot]):.2f}×"
          f"   (rows {bound}/{args.lot} = {bound / args.lot:.2f}, and fixed-width micro-batches)")  # fmt: skip


if __name__ == "__main__":
    main()
