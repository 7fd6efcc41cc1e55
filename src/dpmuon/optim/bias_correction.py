"""DP-MuonBC: remove the heat-smoothing bias that Gaussian noise puts through Newton–Schulz.

The momentum buffer M = M₀ + S carries zero-mean Gaussian noise of public per-entry std s, so
E[M] = M₀, but F (Newton–Schulz) is nonlinear: E[F(M₀ + S)] = F(M₀) + (s²/2)·ΔF(M₀) + O(s⁴).
Antithetic probes with data-independent U_k ~ N(0, I) estimate the smoothed map at scale ρ,
A = (1/K) Σ_k ½[F(M + ρU_k) + F(M − ρU_k)] ≈ F(M) + (ρ²/2)·ΔF(M),
and Richardson extrapolation to zero smoothing, F_BC = F(M) − (s²/ρ²)(A − F(M)), cancels the
O(s²) term. The probes never touch data, so the correction is post-processing: no privacy cost.

At low SNR F_BC is also 1.4–1.5× longer than F(M) (Frobenius), so at a shared learning rate
DP-MuonBC takes longer steps as well as differently aimed ones; `match_norm` rescales each
corrected matrix to ‖F(M)‖_F so that the correction changes only the direction.
"""

from __future__ import annotations

import torch

from .newton_schulz import newton_schulz


def bias_corrected_newton_schulz(
    M: torch.Tensor,
    noise_std: float | torch.Tensor,
    probe_scale: float = 1.0,
    num_probes: int = 1,
    generator: torch.Generator | None = None,
    match_norm: bool = False,
    **ns_kwargs,
) -> torch.Tensor:
    """F(M) − (s²/ρ²)(A − F(M)) with s = noise_std and ρ = probe_scale·s (see corrected_and_plain)."""
    return corrected_and_plain(M, noise_std, probe_scale, num_probes, generator, match_norm, **ns_kwargs)[0]


def corrected_and_plain(
    M: torch.Tensor,
    noise_std: float | torch.Tensor,
    probe_scale: float = 1.0,
    num_probes: int = 1,
    generator: torch.Generator | None = None,
    match_norm: bool = False,
    probes: torch.Tensor | None = None,
    **ns_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F_BC(M), F(M)); with `match_norm`, F_BC scaled per matrix to ‖F(M)‖_F.

    noise_std may be a float or a tensor broadcastable to M's leading (batch) dimensions plus
    two trailing singleton dimensions. F(M) and all 2K probe evaluations run as one batched
    Newton–Schulz call. With s = 0 or K = 0 F_BC is plain F(M). `probes` (K, *M.shape) are the
    U_k when the caller drew them (`draw_probes`), else they are drawn here from `generator`.
    """
    if probe_scale <= 0:
        raise ValueError(f"probe_scale must be > 0, got {probe_scale}")
    if num_probes < 0:
        raise ValueError(f"num_probes must be >= 0, got {num_probes}")
    s = torch.as_tensor(noise_std, dtype=M.dtype, device=M.device)
    if num_probes == 0 or not bool((s > 0).any()):
        plain = newton_schulz(M, **ns_kwargs)
        return plain, plain
    rho = probe_scale * s
    if probes is None:
        probes = draw_probes(M.shape, num_probes, generator, M.dtype, M.device)
    stacked = torch.cat([M.unsqueeze(0), M + rho * probes, M - rho * probes])
    out = newton_schulz(stacked, **ns_kwargs)
    plain, smoothed = out[0], out[1:].mean(dim=0)
    corrected = plain - (1.0 / probe_scale**2) * (smoothed - plain)
    if match_norm:
        norm = torch.linalg.matrix_norm
        corrected = corrected * (norm(plain) / norm(corrected).clamp_min(torch.finfo(corrected.dtype).tiny))[..., None, None]
    return corrected, plain


def draw_probes(
    shape: torch.Size | tuple[int, ...], num_probes: int, generator: torch.Generator | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The K probes U_k ~ N(0, I) of a (batch of) matrices of `shape`, in one draw: the draw's
    values depend on its whole shape, so ranks that each orthogonalize part of a batch draw it
    whole, in step, and take their part (optim/muon.py)."""
    return torch.randn((num_probes, *shape), generator=generator, dtype=dtype, device=device)
