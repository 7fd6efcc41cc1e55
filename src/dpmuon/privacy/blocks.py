"""The block partition of the trainable tensors and each block's clipping threshold.

Per-matrix clipping bounds every block W of every example's gradient in Frobenius norm by C_W;
the release's joint L2 sensitivity is then Δ = sqrt(Σ_W C_W²). `flat` is the one-block case.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .settings import CLIP_MODES, OTHER_BLOCKS, THRESHOLD_RULES, default

# The clip margin C_W·2⁻¹⁰ (clipping.py) absorbs relative rounding. A result that underflows fp32
# carries an absolute error instead: it loses up to 2⁻¹²⁶ ≈ 1.2e-38 under flush-to-zero
# (privacy/subnormals.py), 2⁻¹⁵⁰ with gradual underflow. Where the thresholds are small enough
# this breaks the bound, measurably (tests/privacy/test_sensitivity_fp.py): fp32 squares of
# gradient entries below ~1e-19 read as 0 in a norm (an example 2·C_W long is then not clipped at
# C_W ≈ 3e-20), and flushed products in a book-keeping sum (2·C_W at C_W ≈ 4e-37). From this floor
# up, the squares lose at most n_W·2⁻¹²⁶ of a norm², under 2⁻¹¹·C_W² (a norm 2⁻¹²·C_W low: a
# quarter of the margin) for blocks of up to 4·10¹⁰ coordinates; flushed products move neighbouring
# lots' sums by at most 2·√n_W·R·2⁻¹²⁶ for R token rows in a lot, under 2⁻¹³·C_W (an eighth) while
# √n_W·R ≤ 5·10²¹. With the fast engine's TRACE_BOUND (another quarter) and its fp32 Grams over
# a vocabulary (another quarter: kernels.GRAM_SLACK) that leaves 1/8 of the margin for relative
# rounding, measured at 1e-7·C_W.
MIN_THRESHOLD = 1e-12


@dataclass(frozen=True)
class Block:
    name: str
    params: tuple[str, ...]
    threshold: float


@dataclass(frozen=True)
class BlockPartition:
    blocks: tuple[Block, ...]

    def __post_init__(self):
        seen: set[str] = set()
        for block in self.blocks:
            if not block.params:
                raise ValueError(f"block {block.name!r} is empty")
            if not (block.threshold >= MIN_THRESHOLD and math.isfinite(block.threshold)):
                raise ValueError(
                    f"block {block.name!r} has threshold {block.threshold}; need a finite C_W ≥ {MIN_THRESHOLD:g} "
                    "(below it fp32 underflow, an absolute error, can exceed the clip margin: raise privacy.clip_norm)"
                )
            overlap = seen.intersection(block.params)
            if overlap:
                raise ValueError(f"parameters {sorted(overlap)} belong to more than one block")
            seen.update(block.params)

    @property
    def sensitivity(self) -> float:
        """Joint L2 sensitivity of the tuple of clipped sums: sqrt(Σ_W C_W²)."""
        return math.sqrt(sum(b.threshold**2 for b in self.blocks))

    @property
    def thresholds(self) -> list[float]:
        return [b.threshold for b in self.blocks]

    @property
    def param_names(self) -> list[str]:
        return [name for b in self.blocks for name in b.params]

    def block_index(self) -> dict[str, int]:
        """Parameter name → index of its block."""
        return {name: i for i, b in enumerate(self.blocks) for name in b.params}

    def __len__(self) -> int:
        return len(self.blocks)


def build_partition(
    param_names: Iterable[str],
    clip_mode: str = default("clip_mode"),
    clip_norm: float = default("clip_norm"),
    threshold_rule: str = default("threshold_rule"),
    other_blocks: str = default("other_blocks"),
    matrix_names: Iterable[str] = (),
    sizes: Mapping[str, int] | None = None,
) -> BlockPartition:
    """Partition the trainable tensors and assign thresholds.

    per_matrix: each hidden matrix (`matrix_names`) is a block; the other tensors are one block
    each (`per_tensor`) or one shared block (`group`). Thresholds: `split` gives every block
    C/sqrt(#blocks), so Δ = C; `scalar` gives every block C, so Δ = C·sqrt(#blocks);
    `by_size` (an extension) gives C_W = C·sqrt(n_W / n) for a block of n_W of the n entries
    (needs `sizes`), so Δ = C and larger blocks get larger thresholds.
    flat: one block holding everything, threshold C.
    """
    names = list(param_names)
    if not names:
        raise ValueError("no trainable parameters to privatize")
    if not (clip_norm > 0 and math.isfinite(clip_norm)):
        raise ValueError(f"clip norm must be a finite number > 0, got {clip_norm}")
    if clip_mode == "flat":
        return BlockPartition((Block("all", tuple(names), clip_norm),))
    if clip_mode != "per_matrix":
        raise ValueError(f"unknown clip mode {clip_mode!r}; valid: {', '.join(CLIP_MODES)}")
    if threshold_rule not in THRESHOLD_RULES:
        raise ValueError(f"unknown threshold rule {threshold_rule!r}; valid: {', '.join(THRESHOLD_RULES)}")
    if other_blocks not in OTHER_BLOCKS:
        raise ValueError(f"unknown grouping {other_blocks!r} for non-matrix tensors; valid: {', '.join(OTHER_BLOCKS)}")

    matrices = set(matrix_names)
    groups: list[tuple[str, tuple[str, ...]]] = []
    rest = []
    for name in names:
        if name in matrices or other_blocks == "per_tensor":
            groups.append((name, (name,)))
        else:
            rest.append(name)
    if rest:
        groups.append(("other", tuple(rest)))
    if threshold_rule == "by_size":
        if sizes is None:
            raise ValueError("threshold rule 'by_size' needs the parameter sizes")
        block_sizes = [sum(sizes[n] for n in params) for _, params in groups]
        total = sum(block_sizes)
        thresholds = [clip_norm * math.sqrt(n / total) for n in block_sizes]
    elif threshold_rule == "split":
        thresholds = [clip_norm / math.sqrt(len(groups))] * len(groups)
    else:
        thresholds = [clip_norm] * len(groups)
    return BlockPartition(tuple(Block(name, params, t) for (name, params), t in zip(groups, thresholds)))


def partition_summary(partition: BlockPartition, sizes: Mapping[str, int]) -> str:
    """One line for logs: blocks, thresholds and the joint sensitivity."""
    thresholds = sorted(set(round(t, 12) for t in partition.thresholds))
    shown = ", ".join(f"{t:.4g}" for t in thresholds[:3]) + (", …" if len(thresholds) > 3 else "")
    numel = sum(sizes.get(n, 0) for n in partition.param_names)
    return f"{len(partition)} blocks over {numel:,} parameters, C_W ∈ {{{shown}}}, Δ = {partition.sensitivity:.4g}"
