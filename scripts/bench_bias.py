"""Monte Carlo of the heat-smoothing bias of Newton–Schulz and of DP-MuonBC's correction.

For random signal matrices M₀ and Gaussian noise S of per-entry std s, estimates
‖E F(M₀+S) − F(M₀)‖ (plain DP-Muon) and ‖E F_BC(M₀+S) − F(M₀)‖ (DP-MuonBC) with antithetic
noise pairs, prints a table and writes results/bias/bias.csv and bias.png (log-log, with s²
and s⁴ guide lines). `mc_floor` is the Monte Carlo standard error of the corrected mean:
corrected biases near it are noise, not signal.

    python scripts/bench_bias.py            # full (a few minutes on 2 CPU cores)
    python scripts/bench_bias.py --quick    # smoke
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import sys
from pathlib import Path

import torch

from dpmuon.optim import bias_corrected_newton_schulz
from dpmuon.optim.newton_schulz import newton_schulz

FAMILIES = {"quintic": dict(steps=5, coefficients="quintic"), "series:2": dict(steps=8, coefficients="series:2")}


def signal_matrix(m: int, n: int, seed: int) -> torch.Tensor:
    """Random singular vectors, singular values spread over [1, 2]."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=g))
    k = min(m, n)
    return (U[:, :k] * torch.linspace(1.0, 2.0, k, dtype=torch.float64)) @ V[:k, :]


def measure(M0: torch.Tensor, s: float, samples: int, ns: dict, seed: int, chunk: int = 10_000) -> dict:
    g = torch.Generator().manual_seed(seed)
    probe_gen = torch.Generator().manual_seed(seed + 1)
    target = newton_schulz(M0, **ns)
    plain_sum = torch.zeros_like(M0)
    bc_sum = torch.zeros_like(M0)
    bc_sq = torch.zeros_like(M0)
    done = 0
    while done < samples:
        n = min(chunk, samples - done)
        S = s * torch.randn(n, *M0.shape, dtype=M0.dtype, generator=g)
        noisy = torch.cat([M0 + S, M0 - S])
        plain = newton_schulz(noisy, **ns)
        bc = bias_corrected_newton_schulz(noisy, s, generator=probe_gen, **ns)
        # Antithetic pairs are averaged first: they are the independent units.
        bc_pairs = 0.5 * (bc[:n] + bc[n:])
        plain_sum += plain.sum(0)
        bc_sum += bc_pairs.sum(0) * 2
        bc_sq += bc_pairs.pow(2).sum(0)
        done += n
    plain_mean = plain_sum / (2 * samples)
    bc_mean = bc_sum / (2 * samples)
    bc_var = bc_sq / samples - bc_mean.pow(2)
    return {
        "plain_bias": float((plain_mean - target).norm()),
        "bc_bias": float((bc_mean - target).norm()),
        "mc_floor": float(bc_var.clamp_min(0).sum().sqrt()) / math.sqrt(samples),
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    families = list(dict.fromkeys(r["family"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(len(families), len(shapes), figsize=(3.8 * len(shapes), 3.3 * len(families)), squeeze=False)
    for (i, family), (j, shape) in itertools.product(enumerate(families), enumerate(shapes)):
        ax = axes[i][j]
        sel = sorted((r for r in rows if r["family"] == family and r["shape"] == shape), key=lambda r: r["noise_std"])
        s = [r["noise_std"] for r in sel]
        ax.loglog(s, [r["plain_bias"] for r in sel], "o-", color="tab:red", label="DP-Muon: ‖E F(M₀+S) − F(M₀)‖")
        ax.loglog(s, [r["bc_bias"] for r in sel], "s-", color="tab:blue", label="DP-MuonBC: ‖E F_BC(M₀+S) − F(M₀)‖")
        ax.loglog(s, [r["mc_floor"] for r in sel], ":", color="grey", label="Monte Carlo floor (BC)")
        ref = sel[len(sel) // 2]
        for power, style, base in ((2, "--", ref["plain_bias"]), (4, "-.", ref["bc_bias"])):
            ax.loglog(s, [base * (x / ref["noise_std"]) ** power for x in s], style, color="black", lw=0.8, label=f"∝ s^{power}")
        ax.set_title(f"NS {family}, M₀ {shape}", fontsize=9)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(s)
        ax.grid(True, which="both", lw=0.3)
        if i == len(families) - 1:
            ax.set_xlabel("noise std s (σ(M₀) ∈ [1, 2])", fontsize=8)
    for i in range(len(families)):
        axes[i][0].set_ylabel("bias (Frobenius)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=50_000, help="antithetic noise pairs per point")
    parser.add_argument("--quick", action="store_true", help="few points and samples (smoke test)")
    parser.add_argument("--out", type=Path, default=Path("results/bias"))
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    shapes = [(4, 8), (8, 4), (16, 32)]
    stds = [0.4, 0.2, 0.1, 0.05, 0.025]
    samples = args.samples
    if args.quick:
        shapes, stds, samples = [(4, 8)], [0.2, 0.1], 2_000

    rows = []
    header = f"{'family':9} {'shape':8} {'s':>6} {'plain bias':>11} {'BC bias':>10} {'ratio':>7} {'MC floor':>9}"
    print(header)
    print("-" * len(header))
    for family, ns in FAMILIES.items():
        for shape in shapes:
            M0 = signal_matrix(*shape, seed=sum(shape))
            for i, s in enumerate(stds):
                r = measure(M0, s, samples, ns, seed=1000 * i + shape[0])
                row = {"family": family, "shape": f"{shape[0]}x{shape[1]}", "noise_std": s, "samples": samples, **r}
                row["ratio"] = r["plain_bias"] / r["bc_bias"]
                rows.append(row)
                print(f"{family:9} {row['shape']:8} {s:6.3f} {r['plain_bias']:11.3e} {r['bc_bias']:10.3e} {row['ratio']:7.1f} {r['mc_floor']:9.1e}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "bias.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    plot(rows, args.out / "bias.png")
    print(f"wrote {args.out / 'bias.csv'} and {args.out / 'bias.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
