"""The noise of one release of a model, parameter by parameter, with the chunks' threads kept or
started for every draw, timed in one process.

The privatizer noises each parameter's float64 sum as its own draw (`GaussianNoise.grid_release`),
so a model of many small matrices (LoRA adapters) pays a fixed cost per draw many times a step.
`kept` is what the source does: one pool of threads for its life, and the generator of a chunk's
tail redraw made only for a draw that needs one. `per-draw` is what it did before: a pool started
and joined for every parameter, and the tail's generator made for every chunk. Both draw the same
values (tests/privacy/test_secret_streams.py pins the format). The two take turns, one release a
round, the order reversed every other round; prints and records the median seconds of each.

    python scripts/bench_noise_draws.py --model tiny --rounds 15 --threads 2 --json …
    python scripts/bench_noise_draws.py --model smollm2 --lora-r 8 …   (needs `make models/smollm2`)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from bench_step import build_bench_model

from dpmuon.jsontext import to_json
from dpmuon.privacy import GaussianNoise, SecretStream, randomness
from dpmuon.training.run_files import code_version

KEPT, PER_DRAW = "kept", "per-draw"
STD = 0.37  # any noise std: the cost does not depend on it


def per_draw_pool(noise: GaussianNoise):
    """What `_each_chunk` did before: a pool started and joined for each draw."""

    def each_chunk(count, one):
        if count == 1 or noise.threads == 1:
            for chunk in range(count):
                one(chunk)
        else:
            with ThreadPoolExecutor(min(noise.threads, count)) as pool:
                list(pool.map(one, range(count)))

    return each_chunk


def eager_tail(redraw=randomness.redraw_tail):
    """What `normal_sources_at` did before: the tail's generator made for every chunk."""

    def made_first(z, words):
        made = words()
        return redraw(z, lambda: made)

    return made_first


def release_seconds(noise: GaussianNoise, sums: list[torch.Tensor]) -> float:
    """One release: each parameter's sum noised as its own draw, as `Privatizer._noised` does."""
    copies = [s.clone() for s in sums]  # outside the timing: the privatizer noises its own sums
    start = time.perf_counter()
    for total in copies:
        noise.grid_release(total, STD)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--lora-r", type=int, default=None, help="release the rank-r LoRA adapters only")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_bench_model(args.model, args.lora_r)
    sums = [torch.full(p.shape, 0.01, dtype=torch.float64) for p in model.parameters() if p.requires_grad]
    sources = {way: GaussianNoise(SecretStream(1), threads=args.threads) for way in (KEPT, PER_DRAW)}
    sources[PER_DRAW]._each_chunk = per_draw_pool(sources[PER_DRAW])
    redraw = randomness.redraw_tail

    def release(way: str) -> float:
        randomness.redraw_tail = redraw if way == KEPT else eager_tail(redraw)
        return release_seconds(sources[way], sums)

    for way in (KEPT, PER_DRAW):  # warm-up: the kept pool's threads, the allocator
        release(way)
    seconds: dict[str, list[float]] = {KEPT: [], PER_DRAW: []}
    for round_ in range(args.rounds):
        for way in (KEPT, PER_DRAW) if round_ % 2 == 0 else (PER_DRAW, KEPT):
            seconds[way].append(release(way))
    randomness.redraw_tail = redraw
    for noise in sources.values():
        noise.close()
    median = {way: statistics.median(s) for way, s in seconds.items()}
    coordinates = sum(s.numel() for s in sums)
    name = f"{args.model} + LoRA r = {args.lora_r}" if args.lora_r else args.model
    print(f"{name}: {len(sums)} parameters, {coordinates:,} coordinates, {args.threads} threads, {args.rounds} rounds")
    for way in (PER_DRAW, KEPT):
        print(f"  threads {way:8}: {median[way] * 1e3:8.1f} ms a release")
    print(f"  kept / per-draw: {median[KEPT] / median[PER_DRAW]:.3f}")
    if args.json:
        meta = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "torch": torch.__version__}
        meta |= {"git_commit": code_version(), "command": " ".join(["python", "scripts/bench_noise_draws.py", *sys.argv[1:]])}
        meta |= {"parameters": len(sums), "coordinates": coordinates}
        args.json.write_text(to_json({**meta, "seconds": seconds, "median_s": median}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
