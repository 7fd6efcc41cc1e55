"""Cost of the release's noise: the float32 release of before vs the exact grid release.

For each size (GPT-2 small releases 1.24e8 coordinates per step) it times, side by side:
  float32   the old release: fp32 torch.randn from a seeded generator, added to the fp32 sum
            (not private as computed in floats: issue 23);
  grid      the release now: 128-bit-keyed Philox float64 normals, the float64 sum rounded
            onto the integer grid (privacy/grid.py), chunk by chunk in threads
            (GaussianNoise.grid_release);
  secure    the same grid release with Box–Muller on OS CSPRNG bits (privacy.secure_noise).
Prints the median seconds per release of each and the ratios to float32.

    python scripts/bench_noise.py [--sizes 1e6 1.24e8] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from dpmuon.privacy import GaussianNoise, SecretStream

STD = 0.37  # any noise std: the cost does not depend on it


def float32_release(total: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return total.add_(torch.randn(total.shape, generator=generator), alpha=STD)


def grid_release(total: torch.Tensor, noise: GaussianNoise) -> torch.Tensor:
    """The privatizer's path: on the CPU each chunk is drawn and noised in its own thread."""
    return noise.grid_release(total.double(), STD).float()


def seconds(release, total: torch.Tensor, source) -> float:
    start = time.perf_counter()
    release(total.clone(), source)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 1.24e8], help="coordinates per release")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads for torch and the Philox chunks")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sources = {
        "float32": (float32_release, torch.Generator().manual_seed(0)),
        "grid": (grid_release, GaussianNoise(SecretStream(1), threads=args.threads)),
        "secure": (grid_release, GaussianNoise(secure=True)),
    }
    print(f"threads: {args.threads}")
    print(f"{'coordinates':>12} " + " ".join(f"{name + ' s':>10}" for name in sources) + f" {'grid/f32':>9} {'secure/f32':>11}")
    for size in map(int, args.sizes):
        total = torch.randn(size) * 0.01
        times: dict[str, list[float]] = {name: [] for name in sources}
        for _ in range(args.repeats):  # interleaved: every source sees the same machine state
            for name, (release, source) in sources.items():
                times[name].append(seconds(release, total, source))
        median = {name: statistics.median(t) for name, t in times.items()}
        row = " ".join(f"{median[name]:10.4f}" for name in sources)
        print(f"{size:12.3g} {row} {median['grid'] / median['float32']:9.1f} {median['secure'] / median['float32']:11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
