"""Layer rules: per-example squared norms and clipped sums of one module's own parameters, from
what the module saw in a micro-batch (its inputs and the gradients of its outputs).

Rules are looked up by the module's exact type in `LAYER_RULES` (a subclass may use its
weights differently in its own forward, so it must be registered on its own):

    @register_layer(MyLayer)
    class MyLayerRule(Layer): ...

    register_layer(MistralRMSNorm)(RMSNormLayer)  # a third-party class with a known forward
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding
from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding
from transformers.models.opt.modeling_opt import OPTDecoderLayer, OPTLearnedPositionalEmbedding
from transformers.pytorch_utils import Conv1D

from ..norms import HF_OFFSET_RMS_NORMS, HF_RMS_NORMS, rms_normalized
from .kernels import WeightNormRule, direct_weight_norms, ghost_weight_norms, prefers_ghost, weighted_outer_sum

# name → [B] fp32 scale for the examples' contributions to that parameter's clipped sum.
ScaleOf = Callable[[str], torch.Tensor]

# An example whose layer inputs or output gradients at an affine layer or an embedding exceed this
# (Frobenius norm over its positions) is dropped as if non-finite: its fp32 book-keeping would not
# be exact to the clip margin. The book-keeping scales one operand by the example's factor c
# before the product, and a scaled entry that underflows loses up to 2⁻¹²⁶ (flushed; 2⁻¹⁵⁰ with
# gradual underflow), which the other operand multiplies: crafted so that the lost part cancels
# the rest, an example clipped to C_W = 1e-3 contributed 100·C_W (tests/privacy/
# test_sensitivity_fp.py). Below the bound that loss is at most 2⁻¹²⁶·√(T·d)·2⁴⁰, under 2⁻¹²·C_W
# (a quarter of the margin; blocks.py budgets the rest) for every C_W ≥ MIN_THRESHOLD while
# T·d ≤ 2⁶⁸; every product is under 2⁸⁰ and no fp32 sum of
# fewer than 2⁴⁷ of them overflows (one that did would stop the run, when the example is drawn).
# Real examples are many orders below it (activations ~10²–10⁴ over T·d entries).
TRACE_BOUND = 2.0**40


def beyond_trace_bound(*norms: torch.Tensor) -> torch.Tensor:
    """[B] bool: examples whose trace norms exceed `TRACE_BOUND` in any of `norms` (NaN too)."""
    return ~torch.stack([n <= TRACE_BOUND for n in norms]).all(0)


def trace_norms(x: torch.Tensor) -> torch.Tensor:
    """[B] Frobenius norm of each example's rows of x [B, positions, features] (fp32 accumulation;
    an overflow reads as inf, which only errs towards dropping)."""
    return torch.linalg.vector_norm(x, dim=(1, 2), dtype=torch.float32)


def dropped_where(squared: dict[str, torch.Tensor], beyond: torch.Tensor) -> dict[str, torch.Tensor]:
    """The squared norms with +inf for the examples `beyond` the bound: the engine drops them."""
    return {name: values.masked_fill(beyond, float("inf")) for name, values in squared.items()}


def _nonzero_rows(x: torch.Tensor) -> torch.Tensor:
    """[...] bool: whether x[..., :] holds an entry other than ±0 (a NaN or ±inf counts, as for
    ne(0).any()). Two float reductions, which propagate NaN: on the CPU `any()` first converts the
    whole [B, positions, vocabulary] tensor to bool (a copy), and this reads it without writing
    anything, 1.7× faster at the head."""
    if x.shape[-1] == 0:
        return x.new_zeros(x.shape[:-1], dtype=torch.bool)
    return (x.amax(dim=-1) != 0).logical_or_(x.amin(dim=-1) != 0)


def zero_rows(t: torch.Tensor, dropped: torch.Tensor, own: bool) -> torch.Tensor:
    """`t` with the `dropped` examples' rows zeroed (their factor is 0, but 0·NaN = NaN): in place
    where `t` is the engine's own (a pass; a copy of an LM head's [B, T, vocabulary] costs a fresh
    allocation every micro-batch under constant-time lots), in a copy where it may be the caller's."""
    rows = dropped.view(-1, *([1] * (t.dim() - 1)))
    return t.masked_fill_(rows, 0) if own and t.is_contiguous() else t.masked_fill(rows, 0)


@dataclass
class Trace:
    """What one hooked module saw in a micro-batch, flattened to [B, positions, features].

    Several calls of the module in one forward are concatenated along the position axis: the
    per-example gradient is the sum over calls, exactly as over positions.
    """

    inputs: torch.Tensor  # layer inputs (token ids for an embedding), detached
    grads: torch.Tensor  # gradient of Σ_i loss_i w.r.t. the layer's outputs
    # Constant-time lots: every position counts as active, so padding rows cost what real rows do.
    keep_all: bool = False
    # The output gradients' memory is the engine's alone (autograd made it, and no other trace
    # shares it: autograd hands one tensor to both branches of an addition). Their last reader, the
    # book-keeping, may then reorder their rows in place (`kernels.compact_rows_`).
    exclusive: bool = False
    # Parameter name → [B] bound on the rounding of its squared norms, where the rule's were not
    # computed in float64 (`kernels.ghost_weight_norms` over a vocabulary); the engine absorbs it
    # once a block's norm is complete (a tied head's cross term may cancel against it).
    rounding: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _active: torch.Tensor | None = field(default=None, init=False, repr=False)

    def active(self) -> torch.Tensor:
        """[B, positions] bool: where the output gradient is nonzero (computed once).

        The other positions — padding, and at the LM head every prompt token without a label —
        add nothing to any per-example gradient, so the kernels may skip them exactly (except
        under `keep_all`, where skipping them would make the step's time depend on the lot).
        """
        if self._active is None:
            self._active = self.grads.new_ones(self.grads.shape[:-1], dtype=torch.bool) if self.keep_all else _nonzero_rows(self.grads)
        return self._active

    def without(self, dropped: torch.Tensor) -> Trace:
        """The trace with the dropped examples' rows zeroed: the output gradients (autograd's
        results, the engine's own) in place, the inputs (maybe the caller's tensors) in a copy."""
        inputs = zero_rows(self.inputs, dropped, own=False) if self.inputs.is_floating_point() else self.inputs
        return Trace(inputs, zero_rows(self.grads, dropped, own=True), keep_all=self.keep_all, exclusive=self.exclusive)


class Layer(ABC):
    """The rule for one module: built once per engine with the names of its trainable parameters.

    names: attribute ("weight" / "bias") → parameter name, for the trainable ones only.
    weight_norms: the engine's ghost / direct choice, for rules with a weight matrix.
    tied: the module's weight is shared with another module (an LM head tied to the token
    embedding); its norm is then one part of a sum that may cancel.
    """

    def __init__(self, module: nn.Module, names: Mapping[str, str], weight_norms: WeightNormRule = "mixed", tied: bool = False):
        self.module = module
        self.names = dict(names)
        self.weight_norms = weight_norms
        self.tied = tied

    def record(self, args: tuple, kwargs: dict, output: Any) -> tuple[Any, list[torch.Tensor]]:
        """What the engine keeps of one forward call: (the input `trace` gets, the outputs whose
        gradients it gets). By default the first argument, and an output that is one tensor."""
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            raise RuntimeError("the fast engine needs the loss computed with gradients enabled")
        layer_input = args[0] if args else next(iter(kwargs.values()))
        return layer_input.detach(), [output]

    @abstractmethod
    def trace(self, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> Trace:
        """Flatten and concatenate the calls' inputs and output gradients."""

    @abstractmethod
    def squared_norms(self, trace: Trace) -> dict[str, torch.Tensor]:
        """Parameter name → [B] squared norm of each example's gradient (fp32 or float64)."""

    @abstractmethod
    def clipped_sums(self, trace: Trace, scale_of: ScaleOf) -> dict[str, torch.Tensor]:
        """Parameter name → Σ_i scale_i g_i in fp32, shaped like the parameter."""

    def add_clipped_sums(self, trace: Trace, scale_of: ScaleOf, sums: dict[str, torch.Tensor]) -> None:
        """Add this module's clipped sums into `sums` (name → fp32 tensor; absent names are set).

        What the engine calls. Rules whose sums are large (a vocabulary-sized head or embedding)
        override it to write into an existing sum directly, as a tied weight's second use does.
        """
        for name, values in self.clipped_sums(trace, scale_of).items():
            sums[name] = sums[name].add_(values) if name in sums else values


class InPlaceLayer(Layer):
    """A rule that adds its sums into existing ones (`add_clipped_sums`, abstract here);
    `clipped_sums` is then that into an empty dict."""

    @abstractmethod
    def add_clipped_sums(self, trace: Trace, scale_of: ScaleOf, sums: dict[str, torch.Tensor]) -> None: ...

    def clipped_sums(self, trace, scale_of):
        sums: dict[str, torch.Tensor] = {}
        self.add_clipped_sums(trace, scale_of, sums)
        return sums


LAYER_RULES: dict[type[nn.Module], type[Layer]] = {}

# Modules that flatten their batch-first hidden states [B, T, d] to token rows [B·T, d] with a
# reshape before calling their children (OPT's MLP and its LayerNorm): the rows are then
# example-major, so a child's [B·T, …] tensors are its examples' rows in order, which the rules'
# reshape to [B, T, …] recovers. Any other leading dimension than B is refused; the coverage
# test (tests/privacy/engines/test_coverage.py) checks these against the naive loop.
EXAMPLE_MAJOR_FLATTENING: tuple[type[nn.Module], ...] = (OPTDecoderLayer,)


def register_layer(*module_types: type[nn.Module]) -> Callable[[type[Layer]], type[Layer]]:
    """Class decorator: `rule` handles modules of exactly these types (replacing any earlier rule)."""

    def decorator(rule: type[Layer]) -> type[Layer]:
        if not (isinstance(rule, type) and issubclass(rule, Layer)):
            raise TypeError(f"a layer rule must subclass fast.Layer, got {rule!r}")
        for module_type in module_types:
            LAYER_RULES[module_type] = rule
        return rule

    return decorator


def rule_for(module: nn.Module) -> type[Layer] | None:
    return LAYER_RULES.get(type(module))


def _flatten_calls(tensors: list[torch.Tensor], batch: int, features: int | None) -> torch.Tensor:
    shape = (batch, -1) if features is None else (batch, -1, features)
    flat = [t.reshape(shape) for t in tensors]
    return flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)


@register_layer(nn.Linear, Conv1D)
class AffineLayer(InPlaceLayer):
    """nn.Linear (weight stored (out, in)) or HF Conv1D (weight stored (in, out)): y = a·W + b, b optional."""

    def __init__(self, module, names, weight_norms="mixed", tied=False):
        super().__init__(module, names, weight_norms, tied)
        self.in_out = isinstance(module, Conv1D)
        # A tied head's norm is one part of a sum that may cancel: direct norms then in float64.
        self.direct_dtype = torch.float64 if tied else torch.float32

    def trace(self, inputs, grads):
        d_in, d_out = self.module.weight.shape if self.in_out else self.module.weight.shape[::-1]
        batch = grads[0].shape[0]
        return Trace(_flatten_calls(inputs, batch, d_in), _flatten_calls(grads, batch, d_out))

    def squared_norms(self, trace):
        a, b = trace.inputs, trace.grads
        out = {}
        grads_norm = None
        if "weight" in self.names:
            if prefers_ghost(self.weight_norms, a.shape[1], a.shape[2], b.shape[2]):
                out[self.names["weight"]], grads_squared, rounding = ghost_weight_norms(a, b, trace.active())
                trace.rounding[self.names["weight"]] = rounding
                grads_norm = grads_squared.sqrt()  # b's own Gram: no extra pass over a vocabulary-wide b
            else:
                out[self.names["weight"]] = direct_weight_norms(a, b, self.direct_dtype)
        if "bias" in self.names:
            out[self.names["bias"]] = b.float().sum(1).square().sum(1)
        if grads_norm is None:
            grads_norm = trace_norms(b)
        bounded = [grads_norm, trace_norms(a)] if "weight" in self.names else [grads_norm]
        return dropped_where(out, beyond_trace_bound(*bounded))

    def add_clipped_sums(self, trace, scale_of, sums):
        a, b = trace.inputs, trace.grads
        if "bias" in self.names:
            name = self.names["bias"]
            bias = torch.einsum("b,btj->j", scale_of(name), b.float())
            sums[name] = sums[name].add_(bias) if name in sums else bias
        if "weight" in self.names:  # the last reader of b: an exclusive b may be reordered in place
            name = self.names["weight"]
            # Linear's gradient is bᵀa (out, in); Conv1D stores its transpose aᵀb (in, out).
            sums[name] = weighted_outer_sum(a, b, scale_of(name), not self.in_out, sums.get(name), trace.active(), overwrite_b=trace.exclusive)


@register_layer(nn.Embedding)
class EmbeddingLayer(InPlaceLayer):
    """nn.Embedding: example i's gradient scatters its output gradients into the rows it looked up."""

    def __init__(self, module, names, weight_norms="mixed", tied=False):
        super().__init__(module, names, weight_norms, tied)
        if module.scale_grad_by_freq:
            raise ValueError("an embedding with scale_grad_by_freq=True has a gradient that depends on the whole batch, so it has no per-example decomposition")

    def trace(self, inputs, grads):
        batch = grads[0].shape[0]
        ids = _flatten_calls(inputs, batch, None)
        b = _flatten_calls(grads, batch, self.module.embedding_dim)
        if self.module.padding_idx is not None:
            # PyTorch gives the padding row no gradient.
            b = b.masked_fill((ids == self.module.padding_idx).unsqueeze(-1), 0)
        return Trace(ids, b)

    def squared_norms(self, trace):
        # Exact and O(B·T·d): sum the gradient rows of each (example, token) pair once, then
        # ‖g_i‖² = Σ_v ‖Σ_{t: x_t = v} b_t‖² — the Gram identity Σ_{s,t}[x_s = x_t]⟨b_s, b_t⟩
        # without its T² term. Float64, cheap at this size: a tied embedding's norm is one part
        # of a sum that may cancel. Every tensor is B·T rows whatever the lot's tokens (sorted
        # keys, not torch.unique's data-sized output), so the work does not depend on how often
        # a lot repeats a token.
        ids, b = trace.inputs, trace.grads
        batch, _, dim = b.shape
        keys = (ids + self.module.num_embeddings * torch.arange(batch, device=ids.device).unsqueeze(1)).flatten()
        pair = _pair_of_position(keys)
        rows = torch.zeros(len(keys), dim, dtype=torch.float64, device=b.device)
        rows.index_add_(0, pair, b.reshape(-1, dim).double())
        example_of_pair = torch.zeros_like(keys).scatter_(0, pair, keys // self.module.num_embeddings)  # unused pairs: rows of 0
        squared = torch.zeros(batch, dtype=torch.float64, device=b.device).index_add_(0, example_of_pair, rows.square().sum(1))
        return dropped_where({self.names["weight"]: squared}, beyond_trace_bound(trace_norms(b)))

    def add_clipped_sums(self, trace, scale_of, sums):
        ids, b = trace.inputs, trace.grads
        name = self.names["weight"]
        scaled = b.float() * scale_of(name)[:, None, None]
        if name not in sums:
            sums[name] = torch.zeros(self.module.weight.shape, dtype=torch.float32, device=b.device)
        sums[name].index_add_(0, ids.flatten(), scaled.reshape(-1, b.shape[2]))


def _pair_of_position(keys: torch.Tensor) -> torch.Tensor:
    """Each key's group number among the distinct keys (0, 1, … in sorted order), as long as keys."""
    ordered, order = keys.sort()
    starts = torch.ones_like(ordered)
    starts[1:] = (ordered[1:] != ordered[:-1]).long()
    return torch.empty_like(order).scatter_(0, order, starts.cumsum(0) - 1)


@register_layer(GemmaTextScaledWordEmbedding, Gemma2TextScaledWordEmbedding)
class ScaledEmbeddingLayer(EmbeddingLayer):
    """HF's scaled word embeddings (Gemma, Gemma2): y = W[x] · s, s = `embed_scale` in W's dtype,
    so example i's gradient scatters s · b_t: the embedding rule on scaled output gradients."""

    def trace(self, inputs, grads):
        trace = super().trace(inputs, grads)
        scale = self.module.embed_scale.to(self.module.weight.dtype)
        return Trace(trace.inputs, trace.grads * scale.to(trace.grads.dtype))


@register_layer(OPTLearnedPositionalEmbedding)
class OffsetEmbeddingLayer(EmbeddingLayer):
    """OPT's learned positions: forward(attention_mask, cache_length=0, position_ids=None) looks up
    position_ids + offset, the ids counted from the attention mask when none are given. The rule
    records the ids looked up (tests/privacy/engines/test_hf_layer_rules.py checks the forward)."""

    def record(self, args, kwargs, output):
        _, outputs = super().record(args, kwargs, output)
        call = inspect.signature(self.module.forward).bind(*args, **kwargs)
        call.apply_defaults()
        mask, cache_length, position_ids = (call.arguments[k] for k in ("attention_mask", "cache_length", "position_ids"))
        if position_ids is None:
            position_ids = ((torch.cumsum(mask, dim=1) * mask - 1).long())[:, cache_length:]
        return (position_ids + self.module.offset).detach(), outputs


class NormLayer(Layer):
    """A per-feature affine map of a normalized input, y = γ ⊙ x̂ (+ β): per-example gradients
    γ: Σ_t b_t ⊙ x̂_t and β: Σ_t b_t are d-sized, so they are formed exactly (fp32)."""

    @abstractmethod
    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 x̂ of the flattened inputs x [B, positions, features]."""

    def trace(self, inputs, grads):
        features = self.module.weight.numel() if self.module.weight is not None else self.module.bias.numel()
        batch = grads[0].shape[0]
        return Trace(_flatten_calls(inputs, batch, features), _flatten_calls(grads, batch, features))

    def _per_example_gradients(self, trace: Trace) -> dict[str, torch.Tensor]:
        b = trace.grads.float()
        grads = {}
        if "weight" in self.names:
            grads[self.names["weight"]] = (b * self.normalized(trace.inputs)).sum(1)
        if "bias" in self.names:
            grads[self.names["bias"]] = b.sum(1)
        return grads

    def squared_norms(self, trace):
        return {name: g.square().sum(1) for name, g in self._per_example_gradients(trace).items()}

    def clipped_sums(self, trace, scale_of):
        shapes = {name: getattr(self.module, attribute).shape for attribute, name in self.names.items()}
        return {name: (scale_of(name) @ g).reshape(shapes[name]) for name, g in self._per_example_gradients(trace).items()}


@register_layer(nn.LayerNorm)
class LayerNormLayer(NormLayer):
    """nn.LayerNorm: x̂ = (x − mean) / √(var + ε) over the (flattened) normalized dims."""

    def normalized(self, x):
        return F.layer_norm(x.float(), (x.shape[2],), eps=self.module.eps)


@register_layer(nn.RMSNorm, *HF_RMS_NORMS, *HF_OFFSET_RMS_NORMS)
class RMSNormLayer(NormLayer):
    """RMSNorm (torch's, and HF's per-model classes): x̂ = x / √(mean(x²) + ε), no bias. Gemma's
    (1 + γ) ⊙ x̂ has the same gradient in γ as γ ⊙ x̂, so it takes this rule too (see `norms`)."""

    def normalized(self, x):
        return rms_normalized(self.module, x)
