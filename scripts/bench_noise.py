"""Cost of the privacy noise: seeded torch PRNG vs the OS CSPRNG (`privacy.secure_noise=true`).

Prints seconds per draw of N(0, 1) vectors of given sizes (median of repeats, both sources
measured side by side) and the ratio.

    python scripts/bench_noise.py [--sizes 1e6 1e7] [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from dpmuon.privacy import GaussianNoise


def time_draw(noise: GaussianNoise, size: int, device: torch.device) -> float:
    start = time.perf_counter()
    noise.standard_normal(torch.Size([size]), device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 1.24e8], help="coordinates per draw (GPT-2 small: 1.24e8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    seeded = GaussianNoise(torch.Generator(device=device).manual_seed(0))
    secure = GaussianNoise(secure=True)

    print(f"{'coordinates':>12} {'seeded s':>10} {'secure s':>10} {'secure/seeded':>14}")
    for size in map(int, args.sizes):
        a, b = [], []
        for _ in range(args.repeats):  # alternate so both see the same machine state
            a.append(time_draw(seeded, size, device))
            b.append(time_draw(secure, size, device))
        ta, tb = statistics.median(a), statistics.median(b)
        print(f"{size:12.3g} {ta:10.4f} {tb:10.4f} {tb / ta:14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
