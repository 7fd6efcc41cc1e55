"""Per-example, per-block clip factors from per-example gradient norms."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .blocks import BlockPartition


def per_example_block_norms(partition: BlockPartition, squared_norms: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[B, K] float64 Frobenius norms of each example's gradient restricted to each block.

    squared_norms: parameter name → [B] per-example squared gradient norms (fp32 or fp64).
    Summed in float64: a norm that comes out low lets the clipped contribution exceed C_W,
    and the factors below keep that precision until they scale the fp32 sums.
    """
    columns = []
    for block in partition.blocks:
        columns.append(torch.stack([squared_norms[name].double() for name in block.params]).sum(0))
    return torch.stack(columns, dim=1).clamp_min(0).sqrt()


def mark_nonfinite_losses(block_norms: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """Block norms with the rows of examples whose *loss* is NaN/inf set to NaN.

    Such an example can still have a finite gradient (e.g. a NaN added to the loss), but it is
    broken all the same: with NaN norms, `clip_factors` drops it and `ClipStats` counts it.
    """
    return block_norms.masked_fill(~torch.isfinite(losses).unsqueeze(1), float("nan"))


# Clip to C_W·(1 − 2⁻¹⁰), not C_W: the norms and the clipped sums are fp32 computations, so an
# example's computed contribution — and how its presence moves the rounding of the others' — can
# exceed the exact value by a relative error. The margin is ~10⁴ times the worst measured (crafted
# inputs on GPT-2 and Llama: 1e-7; the lot's total is float64), so the computed sums of neighbouring
# lots stay within the sensitivity Δ the noise is calibrated to.
# bf16 forwards with variable batch shapes move others' contributions by up to 0.5%: not covered
# (the driver warns; fixed shapes remove it).
CLIP_MARGIN = 1.0 - 2.0**-10


def clip_factors(block_norms: torch.Tensor, thresholds: Sequence[float]) -> torch.Tensor:
    """[B, K] factors min(1, C_W·CLIP_MARGIN/‖g_i,W‖) so that ‖c·g_i,W‖ ≤ C_W as computed.

    An example whose gradient is not finite in any block gets factor 0 in every block: it
    contributes nothing to the release (the caller must also zero its non-finite entries,
    since 0·NaN is NaN). A factor below fp32's smallest normal number is 0 in its block: the
    engines scale in fp32, where it would lose its relative precision (0.6·2⁻¹⁴⁹ rounds to
    2⁻¹⁴⁹, a contribution of 1.67·C_W) — such a gradient is at least C_W·2¹²⁶ long, and a
    contribution of 0 is within any bound.
    """
    C = torch.as_tensor(thresholds, dtype=block_norms.dtype, device=block_norms.device) * CLIP_MARGIN
    factors = (C / block_norms.clamp_min(torch.finfo(block_norms.dtype).tiny)).clamp(max=1.0)
    finite = torch.isfinite(block_norms).all(dim=1, keepdim=True)
    return torch.where(finite & (factors >= torch.finfo(torch.float32).tiny), factors, torch.zeros_like(factors))


@dataclass
class ClipStats:
    """Non-private diagnostics of one micro-batch (computed from raw per-example gradients)."""

    examples: int
    clipped: torch.Tensor  # [K] examples whose block norm exceeded C_W
    norm_sum: float  # Σ_i ‖g_i‖ over finite examples (all blocks jointly)
    nonfinite: int  # examples dropped: NaN/inf gradients, or traces beyond the fast engine's TRACE_BOUND

    @classmethod
    def from_norms(cls, block_norms: torch.Tensor, thresholds: Sequence[float], examples: torch.Tensor | None = None) -> ClipStats:
        """From the [B, K] block norms of the rows that `examples` marks (all rows when None).
        Masks, not selections: the same shapes whatever the lot holds (constant-time lots)."""
        C = torch.as_tensor(thresholds, dtype=block_norms.dtype, device=block_norms.device)
        rows = torch.ones(block_norms.shape[0], dtype=torch.bool, device=block_norms.device) if examples is None else examples
        finite = torch.isfinite(block_norms).all(dim=1)
        counted = (finite & rows).unsqueeze(1)
        total = block_norms.masked_fill(~counted, 0).pow(2).sum(1).sqrt()
        return cls(
            examples=int(rows.sum()),
            clipped=((block_norms > C) & counted).sum(0).cpu(),
            norm_sum=float(total.sum()),
            nonfinite=int((~finite & rows).sum()),
        )
