"""The fast engine's tensor kernels: per-example weight norms (ghost / direct), the tied-weight
cross term, and the book-keeping product — all chunked over examples to bound memory.

Precision (see the package docstring for why): the ghost Grams and the tied cross term are
float64; a formed gradient's sum of squares and the book-keeping sums stay fp32. On the CPU a
Gram over a vocabulary (at least WIDE_GRAM features: an LM head's output gradients) is the one
exception: fp32 over chunks of GRAM_CHUNK features, the chunks added in float64, with a bound on
its rounding that the engine absorbs (`ghost_weight_norms`, `within_gram_slack`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Literal

import torch

WeightNormRule = Literal["mixed", "ghost", "direct"]
WEIGHT_NORM_RULES: tuple[str, ...] = ("mixed", "ghost", "direct")

# Per-chunk budget (in fp32 elements, 256 MiB) for the temporaries of one layer's norm or sum:
# examples are processed in chunks so that, e.g., an fp32 copy of a bf16 LM-head gradient
# [B, T, vocab] or the direct per-example gradients [B, d_in, d_out] never exist all at once.
CHUNK_ELEMENTS = 1 << 26
# A CPU group's float64 copies and Grams (16 MiB): near the cache. Whole chunks of narrow layers'
# examples ran up to 1.5× slower than one example at a time; groups of this size were as fast or
# faster at every shape measured (T 52–128, 128–3072 features), 2–4× at the tiny model's.
CPU_GROUP_ELEMENTS = 1 << 22
FP64_ELEMENTS = 2  # a float64 temporary counts as two fp32 elements of the budget


def example_chunks(batch: int, elements_per_example: int, budget: int = CHUNK_ELEMENTS) -> Iterator[slice]:
    step = max(1, budget // max(1, elements_per_example))
    for start in range(0, batch, step):
        yield slice(start, min(start + step, batch))


def prefers_ghost(rule: WeightNormRule, positions: int, d_in: int, d_out: int) -> bool:
    """Whether a weight's per-example norms should use the ghost (Gram) form.

    mixed: ghost costs T²(d_in + d_out) per example, direct T·d_in·d_out (and d_in·d_out
    memory), so ghost wins exactly when T(d_in + d_out) < d_in·d_out.
    """
    if rule == "ghost":
        return True
    if rule == "direct":
        return False
    return positions * (d_in + d_out) < d_in * d_out


# A float64 Gram over an LM head's vocabulary was two thirds of the fast engine's norm work at
# a 50k vocabulary; fp32 runs at twice the rate and needs no float64 copy of the output gradients.
# Its rounding is bounded instead of avoided: a dot product of k terms computed in fp32 in any
# order is within γ_k·Σ|x_v y_v| ≤ γ_k·‖x‖‖y‖ of the exact one (γ_k = k·u/(1 − k·u), u = 2⁻²⁴),
# plus what flush-to-zero loses, under 2⁻¹²⁶ per product and per sum. Chunks of GRAM_CHUNK keep
# γ at 1.5e-5; adding the chunks in float64 adds nothing of that order.
WIDE_GRAM = 8192
GRAM_CHUNK = 256
GRAM_CHUNK_ERROR = GRAM_CHUNK * 2.0**-24 / (1 - GRAM_CHUNK * 2.0**-24)
# The share of a squared norm its bound may reach before the norm is raised: the bound's excess
# over GRAM_SLACK·‖g‖² is added (`within_gram_slack`), so the norm used is ≥ ‖g‖²/(1 + GRAM_SLACK)
# however the Gram rounds. Half of GRAM_SLACK in the norm is 2⁻¹²·C_W, a quarter of the clip
# margin (blocks.py has the budget). Real sequences stay about within it: at the tiny model's and
# SmolLM2's heads on E2E the bound was 10–37 γ of ‖g‖² (about the supervised tokens), against
# 2⁻¹¹ = 32 γ.
GRAM_SLACK = 2.0**-11


def _gram64(x: torch.Tensor) -> torch.Tensor:
    """[B, T, T] float64 Grams x_i x_iᵀ of x [B, T, d], batched (the GPU path)."""
    x = x.double()
    return x @ x.mT


def _gram(x: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """(x xᵀ in float64, e, f) for one example's x [T, d]: each entry within e·‖x_s‖‖x_t‖ + f of
    the exact Gram. Float64 (e = f = 0: its rounding is the measured part of the clip margin)
    unless d ≥ WIDE_GRAM and fp32 matrix products run at IEEE precision (a CPU whose fp32 matmuls
    were set to bf16 or TF32, `torch.set_float32_matmul_precision`, keeps float64)."""
    features = x.shape[1]
    if features < WIDE_GRAM or torch.backends.mkldnn.matmul.fp32_precision not in ("ieee", "none"):
        x = x.double()
        return x @ x.T, 0.0, 0.0
    whole = features // GRAM_CHUNK * GRAM_CHUNK
    chunks = x[:, :whole].unflatten(1, (-1, GRAM_CHUNK)).transpose(0, 1)  # [chunks, T, GRAM_CHUNK], a view
    # Each chunk's [T, T] Gram is kept until they are added: as many at once as CHUNK_ELEMENTS allows.
    per_call = max(1, CHUNK_ELEMENTS // max(1, 3 * x.shape[0] ** 2))  # fp32 Grams and their float64 copy
    gram = sum(torch.bmm(group, group.mT).double().sum(0) for group in chunks.split(per_call))
    if whole < features:
        rest = x[:, whole:]
        gram += (rest @ rest.T).double()
    return gram, GRAM_CHUNK_ERROR, 2 * features * 2.0**-126


def _select_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, rows) for increasing `rows`, as a view where they are one run (at an LM
    head, an example's labelled tokens): the same values with the same strides, without a copy."""
    if rows.numel() and int(rows[-1]) - int(rows[0]) + 1 == rows.numel():
        return x[int(rows[0]) : int(rows[-1]) + 1]
    return x.index_select(0, rows)


def compact_rows_(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
    """x.index_select(0, keep) for a contiguous 2-D x and increasing `keep`, made by moving those
    rows to x's front in place (x's other rows are overwritten) and returned as a view of x.

    At an LM head a fresh copy of the active rows is 10⁸ bytes that the CPU faults in anew at every
    micro-batch (glibc maps blocks that large afresh), several times the copy itself. Each run of
    kept rows moves down by the rows skipped before it (its gap), in pieces of at most the gap so
    that no piece overlaps its source. None, with x untouched, where that would take more than a
    few pieces per run (a long run behind a short gap); the caller then copies.
    """
    n = keep.numel()
    starts = torch.ones(n, dtype=torch.bool, device=keep.device)
    starts[1:] = keep[1:] != keep[:-1] + 1
    firsts = starts.nonzero().squeeze(1).tolist()
    sources = keep[firsts].tolist() if firsts else []
    runs = [(first, source, end - first) for first, source, end in zip(firsts, sources, firsts[1:] + [n]) if source > first]
    if sum(-(-length // (source - first)) for first, source, length in runs) > 2 * len(firsts) + 16:
        return None
    for first, source, length in runs:
        gap = source - first
        for offset in range(0, length, gap):
            size = min(gap, length - offset)
            x[first + offset : first + offset + size].copy_(x[source + offset : source + offset + size])
    return x[:n]


def row_norms(gram: torch.Tensor, error: tuple[float, float]) -> torch.Tensor:
    """Upper bounds on ‖x_t‖ from a computed Gram whose entries are within e·‖x_s‖‖x_t‖ + f:
    G_tt ≥ (1 − e)·‖x_t‖² − f."""
    e, f = error
    return ((gram.diagonal() + f) / (1 - e)).sqrt()


def gram_error_bound(gram_a: torch.Tensor, a_error: tuple[float, float], gram_b: torch.Tensor, b_error: tuple[float, float]) -> torch.Tensor:
    """A bound on |Σ_{s,t} Â_st B̂_st − ‖g‖²| for computed Grams Â, B̂ within (e, f) of a's and b's
    (`_gram`). With ρ = √(f/e), each entry's error is ≤ e·(‖x_s‖ + ρ)(‖x_t‖ + ρ), and |A_st| ≤
    (‖a_s‖ + ρ_a)(‖a_t‖ + ρ_a); the products' errors sum to at most
    (e_a + e_b + e_a·e_b)·(Σ_t (‖a_t‖ + ρ_a)(‖b_t‖ + ρ_b))²."""
    e_a, e_b = a_error[0], b_error[0]
    if e_a == 0 and e_b == 0:
        return gram_b.new_zeros(())
    rho_a, rho_b = (math.sqrt(f / e) if e else 0.0 for e, f in (a_error, b_error))
    spread = ((row_norms(gram_a, a_error) + rho_a) * (row_norms(gram_b, b_error) + rho_b)).sum()
    return (e_a + e_b + e_a * e_b) * spread.square() * (1 + 2.0**-40)  # the bound's own float64 rounding


def within_gram_slack(squared: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """The squared norms to clip with, given `bound` on their rounding: raised just enough that
    the true ‖g‖² ≤ (1 + GRAM_SLACK)·result (fmax: a dropped example's +inf stays, a NaN bound
    changes nothing). Unchanged where the bound is within GRAM_SLACK of the norm."""
    return torch.fmax(squared, (squared + bound) / (1 + GRAM_SLACK))


def ghost_weight_norms(a: torch.Tensor, b: torch.Tensor, active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B] float64 ‖b_iᵀ a_i‖²_F = Σ_{s,t} ⟨a_s, a_t⟩⟨b_s, b_t⟩ for a [B, T, d_in], b [B, T, d_out];
    [B] float64 ‖b_i‖²_F, the trace of b's Gram (free here; the engine bounds it; an upper bound
    where the Gram rounds); and [B] float64 bounds on the norms' rounding (0 where both Grams are
    float64; `_gram`).

    Float64 Grams but over a vocabulary: the sum cancels (see the package docstring). active
    [B, T]: the positions with a nonzero b_t (`Trace.active`); the others add nothing, so the CPU
    path over a vocabulary leaves them out of the T² cost — at the LM head, every prompt token.
    """
    cpu = a.device.type == "cpu"
    if cpu and max(a.shape[2], b.shape[2]) >= WIDE_GRAM:
        # One example at a time: on CPU a batched float64 product over thousands of features
        # (the LM head's vocabulary) runs 2–3× slower than the 2-D ones, and each example's
        # copy is then made only when needed, on its active rows only.
        norms, grads, bounds = [], [], []
        for i in range(a.shape[0]):
            ai, bi = a[i], b[i]
            if active is not None and not bool(active[i].all()):
                rows = active[i].nonzero().squeeze(1)
                ai, bi = _select_rows(ai, rows), _select_rows(bi, rows)
            (gram_a, *a_error), (gram_b, *b_error) = _gram(ai), _gram(bi)
            grads.append(row_norms(gram_b, b_error).square().sum())
            bounds.append(gram_error_bound(gram_a, a_error, gram_b, b_error))  # before gram_a is overwritten
            norms.append(gram_a.mul_(gram_b).sum())
        if not norms:
            empty = torch.zeros(0, dtype=torch.float64, device=a.device)
            return empty, empty, empty
        return torch.stack(norms), torch.stack(grads), torch.stack(bounds)
    # Narrower layers, and every layer on an accelerator: groups of examples over all positions
    # (an inactive one's b_t is 0, so it adds exact zeros).
    batch, positions = a.shape[:2]
    norms, grads = [], []
    per_example = FP64_ELEMENTS * positions * (a.shape[2] + b.shape[2] + 2 * positions)
    for rows in example_chunks(batch, per_example, CPU_GROUP_ELEMENTS if cpu else CHUNK_ELEMENTS):
        gram_b = _gram64(b[rows])
        grads.append(gram_b.diagonal(dim1=1, dim2=2).sum(1))
        norms.append(_gram64(a[rows]).mul_(gram_b).sum((1, 2)))
    if not norms:
        empty = torch.zeros(0, dtype=torch.float64, device=a.device)
        return empty, empty, empty
    norms = torch.cat(norms)
    return norms, torch.cat(grads), torch.zeros_like(norms)


def direct_weight_norms(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B] ‖b_iᵀ a_i‖²_F by forming each example's gradient, a chunk of examples at a time.

    fp32 (the default) is enough for a gradient of its own: a sum of squares does not cancel.
    """
    batch, positions, d_in = a.shape
    d_out = b.shape[2]
    width = dtype.itemsize // torch.float32.itemsize
    out = []
    for rows in example_chunks(batch, width * (d_in * d_out + positions * (d_in + d_out))):
        out.append((a[rows].to(dtype).mT @ b[rows].to(dtype)).square_().sum((1, 2)))
    return torch.cat(out)


def weighted_outer_sum(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    out_in: bool,
    out: torch.Tensor | None = None,
    active: torch.Tensor | None = None,
    overwrite_b: bool = False,
) -> torch.Tensor:
    """Σ_i scale_i · b_iᵀ a_i in fp32 ([d_out, d_in] if out_in, else its transpose [d_in, d_out]),
    added into `out` when given (and returned).

    The book-keeping product: one GEMM per chunk of examples over their (example, position)
    rows, with the per-example scale applied to the narrower operand. On CPU, rows outside
    `active` (zero b_t) are left out when that saves a tenth of the product or more: at the LM
    head the unlabelled prompt is about half the rows, which the non-private backward multiplies
    anyway. (Not on GPU, where choosing the rows would synchronize the device at every layer.)
    overwrite_b: b's memory is the caller's to overwrite (this is its last use and no other tensor
    shares it), so its kept rows are moved within it (`compact_rows_`) rather than copied.
    The first chunk writes a fresh result rather than adding into zeros: filling a
    vocabulary-sized matrix first costs about as much as the product's memory traffic.
    """
    batch, positions, d_in = a.shape
    d_out = b.shape[2]
    for rows in example_chunks(batch, positions * (d_in + d_out)):
        ac, bc = a[rows].reshape(-1, d_in), b[rows].reshape(-1, d_out)
        weights = scale[rows].repeat_interleave(positions)
        if active is not None and a.device.type == "cpu":  # on GPU the selection would sync per layer
            keep = active[rows].reshape(-1).nonzero().squeeze(1)
            if keep.numel() < 0.9 * ac.shape[0]:  # index_select copies rows faster than a boolean mask
                ac, weights = ac.index_select(0, keep), weights.index_select(0, keep)
                moved = compact_rows_(bc, keep) if overwrite_b and bc.is_contiguous() else None
                bc = bc.index_select(0, keep) if moved is None else moved
        ac, bc = ac.float(), bc.float()
        if d_in <= d_out:
            ac = ac * weights[:, None]
        else:
            bc = bc * weights[:, None]
        left, right = (bc.mT, ac) if out_in else (ac.mT, bc)
        out = left @ right if out is None else out.addmm_(left, right)
    if out is None:  # no examples
        out = torch.zeros((d_out, d_in) if out_in else (d_in, d_out), dtype=torch.float32, device=a.device)
    return out


def tied_cross_term(a_head: torch.Tensor, b_head: torch.Tensor, ids: torch.Tensor, b_emb: torch.Tensor) -> torch.Tensor:
    """[B] ⟨G_head,i, G_emb,i⟩ for a head weight shared with the embedding ([vocab, d] both).

    G_head = b_headᵀ a_head, so its row v is Σ_s b_head[s, v] a_s; G_emb's row v is
    Σ_{t: x_t = v} b_emb,t. Their inner product is Σ_t ⟨G_head[x_t], b_emb,t⟩
    = Σ_{s,t} b_head[s, x_t] ⟨a_s, b_emb,t⟩: a [S, T] Gram and a gather, never a vocab × d matrix.
    In float64: the sum cancels like the ghost form's, and so may its sum with the parts' norms.
    """
    batch, positions = a_head.shape[:2]
    tokens = ids.shape[1]
    per_example = FP64_ELEMENTS * (positions * (a_head.shape[2] + 2 * tokens) + tokens * b_emb.shape[2])
    out = []
    for rows in example_chunks(batch, per_example):
        logit_grads = b_head[rows].gather(2, ids[rows].unsqueeze(1).expand(-1, positions, -1))
        out.append(((a_head[rows].double() @ b_emb[rows].double().mT) * logit_grads.double()).sum((1, 2)))
    return torch.cat(out)
