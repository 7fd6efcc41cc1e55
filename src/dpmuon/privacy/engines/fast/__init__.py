"""Per-example block norms and clipped sums without per-example gradients (`privacy.engine=fast`).

One forward and one backward per micro-batch. Forward hooks keep each layer's input a_i;
the backward asks autograd only for the gradients b_i of the layers' outputs, so it never
forms the (non-private) summed weight gradients at all. From (a_i, b_i):

- norms: a linear layer's per-example weight gradient is g_i = b_iᵀ a_i (Linear layout; Conv1D
  stores its transpose). ‖g_i‖² is taken either by the ghost identity ⟨a_i a_iᵀ, b_i b_iᵀ⟩
  (cost T²(d_in+d_out), never forms g_i) or directly from g_i (cost T·d_in·d_out, memory
  d_in·d_out per example), whichever is cheaper at the sequence length T at hand (Li et al.
  2022's mixed rule). Embeddings, LayerNorm / RMSNorm and biases have small per-example
  gradients that are formed exactly.
- clipped sums (book-keeping, Bu et al.): once the per-block factors c_i,W are known,
  Σ_i c_i,W b_iᵀ a_i is a single matrix product over the flattened (example, position) axis —
  the same cost as the weight gradient the backward skipped — and no second backward is run.

Positions whose output gradient b_t is zero (padding; at the LM head every prompt token
without a label) add nothing to any of these sums, so the ghost Grams and the book-keeping
product leave them out (`Trace.active`): exact, and at the head about half the rows of a
table-to-text lot, which the non-private backward multiplies anyway. The rows kept are moved to
the front of the output gradients' own memory, not copied, where no other trace shares it
(`Trace.exclusive`): on the CPU a fresh copy of the head's rows cost 5% of a step in page faults.

A token embedding tied to the LM head gets one gradient that sums both uses; its norm needs
the cross term between the two parts (see `kernels.tied_cross_term`).

A trainable module no rule knows takes the generic rule (`generic`, `privacy.engine_fallback=
generic`, the default): its per-example gradients formed by torch.func from what it saw — exact,
at the cost of those gradients — or, under `engine_fallback=error`, stops the engine naming it.
Once, on a public stand-in of its first micro-batch (so that the check's work and outcome do not
depend on the lot), the engine checks that the rules' Σ_i g_i equals autograd's batch gradient:
a parameter used outside its module's calls, which no hook sees, is refused.

Precision: a norm that comes out low lets a clipped contribution exceed C_W. Formulas that
cancel run in float64 (inputs and output gradients convert exactly). The ghost form adds up T²
products as large as ‖a_s‖‖a_t‖‖b_s‖‖b_t‖, however small the gradient itself is: its relative
rounding error grows with R² for R = Σ_t ‖a_t‖‖b_t‖ / ‖g_i‖ (crafted inputs with T = 100,
d = 64, R ≈ 6000 came out 7% low in fp32 — contributions of 1.08·C). A tied weight's norm
‖G_head‖² + ‖G_emb‖² + 2⟨G_head, G_emb⟩ cancels when the parts nearly oppose each other and
amplifies their rounding, so the parts and the cross term are float64 too; all squared norms
are accumulated in float64. On the CPU a Gram over a vocabulary (an LM head's output
gradients, two thirds of the norm work at a 50k vocabulary in float64) is computed in fp32
chunks instead, with a bound on its rounding: a norm whose bound exceeds `kernels.GRAM_SLACK` of
it is raised by the excess, after a tied head's cross term (`kernels.within_gram_slack`). Norms
and sums run with IEEE fp32 products whatever the caller set (`base.ieee_fp32_matmuls`). A formed
gradient's sum of squares does not cancel: direct,
LayerNorm and bias norms stay fp32 (rounding linear in R, like the fp32 book-keeping sums: a
relative 3e-5 at R ≈ 6000 — the floor Opacus' materialized fp32 per-example gradients have).
Underflow is an absolute error, not a relative one: thresholds have a floor (`blocks.
MIN_THRESHOLD`), and an example whose traces at an affine layer or an embedding exceed
`layers.TRACE_BOUND` is dropped, since the book-keeping's scaled operand can underflow against a
large other operand (the bound's comment has the arithmetic).

Layout: `kernels` (norm and book-keeping tensor kernels), `layers` (the layer rules and their
registry, keyed by exact module type: `register_layer`), `generic` (the fallback rule), `engine`
(hooks, backward, clipping).
"""

from .engine import FastEngine, TiedHead
from .generic import GenericLayer, PerExampleGradients
from .kernels import WEIGHT_NORM_RULES, WeightNormRule, direct_weight_norms, ghost_weight_norms, prefers_ghost, weighted_outer_sum
from .layers import (
    LAYER_RULES,
    AffineLayer,
    EmbeddingLayer,
    Layer,
    LayerNormLayer,
    NormLayer,
    OffsetEmbeddingLayer,
    RMSNormLayer,
    ScaledEmbeddingLayer,
    Trace,
    register_layer,
    rule_for,
)

__all__ = [
    "LAYER_RULES",
    "WEIGHT_NORM_RULES",
    "AffineLayer",
    "EmbeddingLayer",
    "FastEngine",
    "GenericLayer",
    "Layer",
    "LayerNormLayer",
    "NormLayer",
    "OffsetEmbeddingLayer",
    "PerExampleGradients",
    "RMSNormLayer",
    "ScaledEmbeddingLayer",
    "TiedHead",
    "Trace",
    "WeightNormRule",
    "direct_weight_norms",
    "ghost_weight_norms",
    "prefers_ghost",
    "register_layer",
    "rule_for",
    "weighted_outer_sum",
]
