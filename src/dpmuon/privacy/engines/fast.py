"""Per-example block norms and clipped sums without per-example gradients (`privacy.engine=fast`).

One forward and one backward per micro-batch. Forward hooks keep each layer's input a_i;
the backward asks autograd only for the gradients b_i of the layers' outputs, so it never
forms the (non-private) summed weight gradients at all. From (a_i, b_i):

- norms: a linear layer's per-example weight gradient is g_i = b_iᵀ a_i (Linear layout; Conv1D
  stores its transpose). ‖g_i‖² is taken either by the ghost identity ⟨a_i a_iᵀ, b_i b_iᵀ⟩
  (cost T²(d_in+d_out), never forms g_i) or directly from g_i (cost T·d_in·d_out, memory
  d_in·d_out per example), whichever is cheaper at the sequence length T at hand (Li et al.
  2022's mixed rule). Embeddings, LayerNorm and biases have small per-example gradients that
  are formed exactly.
- clipped sums (book-keeping, Bu et al.): once the per-block factors c_i,W are known,
  Σ_i c_i,W b_iᵀ a_i is a single matrix product over the flattened (example, position) axis —
  the same cost as the weight gradient the backward skipped — and no second backward is run.

A token embedding tied to the LM head gets one gradient that sums both uses; its norm needs
the cross term between the two parts (see `_tied_cross_term`).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from transformers.pytorch_utils import Conv1D

from ..blocks import BlockPartition
from ..clipping import ClipStats, clip_factors, mark_nonfinite_losses, per_example_block_norms
from .base import PerExampleEngine, PerExampleLoss, register_engine

WeightNormRule = Literal["mixed", "ghost", "direct"]
WEIGHT_NORM_RULES: tuple[str, ...] = ("mixed", "ghost", "direct")

# Per-chunk budget (in fp32 elements, 256 MiB) for the temporaries of one layer's norm or sum:
# examples are processed in chunks so that, e.g., an fp32 copy of a bf16 LM-head gradient
# [B, T, vocab] or the direct per-example gradients [B, d_in, d_out] never exist all at once.
CHUNK_ELEMENTS = 1 << 26

# name → [B] fp32 scale for the examples' contributions to that parameter's clipped sum.
ScaleOf = Callable[[str], torch.Tensor]


def _example_chunks(batch: int, elements_per_example: int) -> Iterator[slice]:
    step = max(1, CHUNK_ELEMENTS // max(1, elements_per_example))
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


def ghost_weight_norms(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B] ‖b_iᵀ a_i‖²_F = Σ_{s,t} ⟨a_s, a_t⟩⟨b_s, b_t⟩ for a [B, T, d_in], b [B, T, d_out]."""
    batch, positions = a.shape[:2]
    out = []
    for rows in _example_chunks(batch, positions * (a.shape[2] + b.shape[2] + 2 * positions)):
        ac, bc = a[rows].float(), b[rows].float()
        out.append((ac @ ac.mT).mul_(bc @ bc.mT).sum((1, 2)))
    return torch.cat(out)


def direct_weight_norms(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B] ‖b_iᵀ a_i‖²_F by forming each example's gradient, a chunk of examples at a time."""
    batch, positions, d_in = a.shape
    d_out = b.shape[2]
    out = []
    for rows in _example_chunks(batch, d_in * d_out + positions * (d_in + d_out)):
        out.append((a[rows].float().mT @ b[rows].float()).square_().sum((1, 2)))
    return torch.cat(out)


def weighted_outer_sum(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, out_in: bool) -> torch.Tensor:
    """Σ_i scale_i · b_iᵀ a_i in fp32 ([d_out, d_in] if out_in, else its transpose [d_in, d_out]).

    The book-keeping product: one GEMM per chunk of examples over their (example, position)
    rows, with the per-example scale applied to the narrower operand.
    """
    batch, positions, d_in = a.shape
    d_out = b.shape[2]
    out = torch.zeros((d_out, d_in) if out_in else (d_in, d_out), dtype=torch.float32, device=a.device)
    for rows in _example_chunks(batch, positions * (d_in + d_out)):
        ac, bc = a[rows].float(), b[rows].float()
        weights = scale[rows, None, None]
        if d_in <= d_out:
            ac = ac * weights
        else:
            bc = bc * weights
        ac, bc = ac.reshape(-1, d_in), bc.reshape(-1, d_out)
        out.addmm_(*((bc.mT, ac) if out_in else (ac.mT, bc)))
    return out


@dataclass
class Call:
    """One forward call of a hooked module."""

    inputs: torch.Tensor  # detached
    output: GradientEdge  # where autograd delivers the gradient of the module's output
    shape: torch.Size  # the output's, for a zero gradient when the output went unused
    dtype: torch.dtype


@dataclass
class Trace:
    """What one hooked module saw in a micro-batch, flattened to [B, positions, features].

    Several calls of the module in one forward are concatenated along the position axis: the
    per-example gradient is the sum over calls, exactly as over positions.
    """

    inputs: torch.Tensor  # layer inputs (token ids for an embedding), detached
    grads: torch.Tensor  # gradient of Σ_i loss_i w.r.t. the layer's outputs

    def without(self, dropped: torch.Tensor) -> "Trace":
        """The trace with the dropped examples' rows zeroed (their factor is 0, but 0·NaN = NaN)."""
        rows = dropped.view(-1, *([1] * (self.grads.dim() - 1)))
        inputs = self.inputs.masked_fill(rows, 0) if self.inputs.is_floating_point() else self.inputs
        return Trace(inputs, self.grads.masked_fill(rows, 0))


class Layer(ABC):
    """Per-example squared norms and clipped sums of one module's own trainable parameters."""

    def __init__(self, module: nn.Module, names: Mapping[str, str]):
        self.module = module
        self.names = dict(names)  # attribute ("weight" / "bias") → parameter name

    @abstractmethod
    def trace(self, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> Trace:
        """Flatten and concatenate the calls' inputs and output gradients."""

    @abstractmethod
    def squared_norms(self, trace: Trace) -> dict[str, torch.Tensor]:
        """Parameter name → [B] fp32 squared norm of each example's gradient."""

    @abstractmethod
    def clipped_sums(self, trace: Trace, scale_of: ScaleOf) -> dict[str, torch.Tensor]:
        """Parameter name → Σ_i scale_i g_i in fp32, shaped like the parameter."""


def _flatten_calls(tensors: list[torch.Tensor], batch: int, features: int | None) -> torch.Tensor:
    shape = (batch, -1) if features is None else (batch, -1, features)
    flat = [t.reshape(shape) for t in tensors]
    return flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)


class AffineLayer(Layer):
    """nn.Linear (weight stored (out, in)) or HF Conv1D (weight stored (in, out)): y = a·W + b."""

    def __init__(self, module: nn.Module, names: Mapping[str, str], rule: WeightNormRule):
        super().__init__(module, names)
        self.rule = rule
        self.in_out = isinstance(module, Conv1D)

    def trace(self, inputs, grads):
        d_in, d_out = self.module.weight.shape if self.in_out else self.module.weight.shape[::-1]
        batch = grads[0].shape[0]
        return Trace(_flatten_calls(inputs, batch, d_in), _flatten_calls(grads, batch, d_out))

    def squared_norms(self, trace):
        a, b = trace.inputs, trace.grads
        out = {}
        if "weight" in self.names:
            ghost = prefers_ghost(self.rule, a.shape[1], a.shape[2], b.shape[2])
            out[self.names["weight"]] = ghost_weight_norms(a, b) if ghost else direct_weight_norms(a, b)
        if "bias" in self.names:
            out[self.names["bias"]] = b.float().sum(1).square().sum(1)
        return out

    def clipped_sums(self, trace, scale_of):
        a, b = trace.inputs, trace.grads
        out = {}
        if "weight" in self.names:
            name = self.names["weight"]
            # Linear's gradient is bᵀa (out, in); Conv1D stores its transpose aᵀb (in, out).
            out[name] = weighted_outer_sum(a, b, scale_of(name), out_in=not self.in_out)
        if "bias" in self.names:
            name = self.names["bias"]
            out[name] = torch.einsum("b,btj->j", scale_of(name), b.float())
        return out


class EmbeddingLayer(Layer):
    """nn.Embedding: example i's gradient scatters its output gradients into the rows it looked up."""

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
        # without its T² term.
        ids, b = trace.inputs, trace.grads
        batch, _, dim = b.shape
        vocab = self.module.num_embeddings
        keys = ids + vocab * torch.arange(batch, device=ids.device).unsqueeze(1)
        pairs, which = torch.unique(keys.flatten(), return_inverse=True)
        rows = torch.zeros(len(pairs), dim, dtype=torch.float32, device=b.device)
        rows.index_add_(0, which, b.reshape(-1, dim).float())
        squared = torch.zeros(batch, dtype=torch.float32, device=b.device)
        return {self.names["weight"]: squared.index_add_(0, pairs // vocab, rows.square().sum(1))}

    def clipped_sums(self, trace, scale_of):
        ids, b = trace.inputs, trace.grads
        name = self.names["weight"]
        scaled = b.float() * scale_of(name)[:, None, None]
        out = torch.zeros(self.module.weight.shape, dtype=torch.float32, device=b.device)
        return {name: out.index_add_(0, ids.flatten(), scaled.reshape(-1, b.shape[2]))}


class LayerNormLayer(Layer):
    """nn.LayerNorm: per-example gradients γ: Σ_t b_t ⊙ x̂_t and β: Σ_t b_t, formed exactly."""

    def trace(self, inputs, grads):
        features = self.module.weight.numel() if self.module.weight is not None else self.module.bias.numel()
        batch = grads[0].shape[0]
        return Trace(_flatten_calls(inputs, batch, features), _flatten_calls(grads, batch, features))

    def _per_example_gradients(self, trace: Trace) -> dict[str, torch.Tensor]:
        b = trace.grads.float()
        grads = {}
        if "weight" in self.names:
            # Normalizing the flattened trailing dims equals normalizing over normalized_shape.
            normalized = F.layer_norm(trace.inputs.float(), (trace.inputs.shape[2],), eps=self.module.eps)
            grads[self.names["weight"]] = (b * normalized).sum(1)
        if "bias" in self.names:
            grads[self.names["bias"]] = b.sum(1)
        return grads

    def squared_norms(self, trace):
        return {name: g.square().sum(1) for name, g in self._per_example_gradients(trace).items()}

    def clipped_sums(self, trace, scale_of):
        shape = self.module.normalized_shape
        return {name: (scale_of(name) @ g).reshape(shape) for name, g in self._per_example_gradients(trace).items()}


@dataclass(frozen=True)
class TiedHead:
    """A token embedding whose weight is also the weight of a Linear LM head."""

    name: str
    embedding: nn.Embedding
    head: nn.Linear


def _tied_cross_term(head: Trace, embedding: Trace) -> torch.Tensor:
    """[B] ⟨G_head,i, G_emb,i⟩ for a head weight shared with the embedding ([vocab, d] both).

    G_head = b_headᵀ a_head, so its row v is Σ_s b_head[s, v] a_s; G_emb's row v is
    Σ_{t: x_t = v} b_emb,t. Their inner product is Σ_t ⟨G_head[x_t], b_emb,t⟩
    = Σ_{s,t} b_head[s, x_t] ⟨a_s, b_emb,t⟩: a [S, T] Gram and a gather, never a vocab × d matrix.
    """
    ids, b_emb = embedding.inputs, embedding.grads
    batch, positions = head.inputs.shape[:2]
    tokens = ids.shape[1]
    out = []
    for rows in _example_chunks(batch, positions * (head.inputs.shape[2] + 2 * tokens) + tokens * b_emb.shape[2]):
        logit_grads = head.grads[rows].gather(2, ids[rows].unsqueeze(1).expand(-1, positions, -1))
        out.append(((head.inputs[rows].float() @ b_emb[rows].float().mT) * logit_grads.float()).sum((1, 2)))
    return torch.cat(out)


# Exact types: a subclass may use its weights differently in its own forward.
SUPPORTED_TYPES: tuple[type, ...] = (nn.Linear, Conv1D, nn.Embedding, nn.LayerNorm)


def _layer_for(module: nn.Module, names: Mapping[str, str], rule: WeightNormRule) -> Layer:
    if type(module) is nn.Embedding:
        return EmbeddingLayer(module, names)
    if type(module) is nn.LayerNorm:
        return LayerNormLayer(module, names)
    return AffineLayer(module, names, rule)


def _full_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """Backward, norms and sums outside autocast, even when the caller runs the whole release
    under it: autocast would also recast the backward's and our own matrix products to bf16
    (only the loss function's forward is the caller's to cast)."""
    return torch.autocast(device_type=device.type, enabled=False)


@register_engine("fast")
class FastEngine(PerExampleEngine):
    """Ghost / direct per-example norms (mixed rule) and book-keeping clipped sums.

    weight_norms: "mixed" (default: per layer, whichever of ghost and direct is cheaper for
    the micro-batch's sequence length), "ghost" or "direct" (forced, e.g. for testing).
    """

    def __init__(self, model: nn.Module, partition: BlockPartition, weight_norms: WeightNormRule = "mixed"):
        super().__init__(model, partition)
        if weight_norms not in WEIGHT_NORM_RULES:
            raise ValueError(f"unknown weight norm rule {weight_norms!r}; valid: {', '.join(WEIGHT_NORM_RULES)}")
        owners = self._trainable_owners(model)
        self.tied: list[TiedHead] = []
        names_by_module: dict[nn.Module, dict[str, str]] = defaultdict(dict)
        for name, uses in owners.items():
            for module, attribute in uses:
                names_by_module[module][attribute] = name
            if len(uses) > 1:
                self.tied.append(self._tied_head(name, [m for m, _ in uses]))
        self.layers: dict[nn.Module, Layer] = {m: _layer_for(m, names, weight_norms) for m, names in names_by_module.items()}

    def _trainable_owners(self, model: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
        """Parameter name → the (module, attribute) pairs holding it; refuses what we cannot handle."""
        name_of = {id(p): n for n, p in model.named_parameters()}
        owners: dict[str, list[tuple[nn.Module, str]]] = defaultdict(list)
        for module_name, module in model.named_modules():
            for attribute, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                name = name_of[id(p)]
                if type(module) not in SUPPORTED_TYPES:
                    supported = ", ".join(t.__name__ for t in SUPPORTED_TYPES)
                    raise ValueError(
                        f"parameter {name!r} is held by module {module_name!r} of type {type(module).__name__}, "
                        f"which the fast engine cannot differentiate per example (supported: {supported}); "
                        "freeze it or use privacy.engine=opacus"
                    )
                if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
                    raise ValueError(
                        f"embedding {module_name!r} has scale_grad_by_freq=True: its gradient depends on the "
                        "whole batch, so it has no per-example decomposition"
                    )
                owners[name].append((module, attribute))
        outside = [n for n in owners if n not in self.params]
        if outside:
            raise ValueError(f"trainable parameters outside the block partition: {outside[:5]}")
        return owners

    @staticmethod
    def _tied_head(name: str, modules: list[nn.Module]) -> TiedHead:
        embeddings = [m for m in modules if type(m) is nn.Embedding]
        heads = [m for m in modules if type(m) is nn.Linear]
        if len(modules) != 2 or len(embeddings) != 1 or len(heads) != 1:
            kinds = ", ".join(type(m).__name__ for m in modules)
            raise ValueError(
                f"parameter {name!r} is shared by modules of types {kinds}; the fast engine supports "
                "sharing only between an nn.Embedding and an nn.Linear output head"
            )
        return TiedHead(name, embeddings[0], heads[0])

    # -- one forward and one backward -------------------------------------------------------

    @contextlib.contextmanager
    def _recording(self) -> Iterator[dict[nn.Module, list[Call]]]:
        calls: dict[nn.Module, list[Call]] = defaultdict(list)

        def record(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
            if not output.requires_grad:
                raise RuntimeError("the fast engine needs the loss computed with gradients enabled")
            layer_input = args[0] if args else next(iter(kwargs.values()))
            # The output's gradient edge, not the output: holding the tensor (e.g. the logits,
            # B × T × vocab) through the backward would keep memory autograd otherwise frees.
            calls[module].append(Call(layer_input.detach(), get_gradient_edge(output), output.shape, output.dtype))

        handles = [m.register_forward_hook(record, with_kwargs=True) for m in self.layers]
        try:
            yield calls
        finally:
            for handle in handles:
                handle.remove()

    def _forward(self, batch: Mapping[str, Any], loss_fn: PerExampleLoss) -> tuple[torch.Tensor, dict[nn.Module, list[Call]]]:
        with self._recording() as calls:
            losses = loss_fn(self.model, batch)
        return losses, calls

    def _backward(self, losses: torch.Tensor, calls: Mapping[nn.Module, list[Call]]) -> dict[nn.Module, Trace]:
        size = losses.shape[0]
        modules = [m for m in self.layers if m in calls]
        edges = [call.output for m in modules for call in calls[m]]
        if losses.requires_grad and edges:
            # Gradients w.r.t. the layer outputs only: autograd then skips every parameter's
            # gradient, so no summed (non-private) gradient is ever formed or left in p.grad.
            grads = torch.autograd.grad(losses.sum(), edges, allow_unused=True)
        else:
            grads = (None,) * len(edges)
        traces = {}
        position = 0
        for module in modules:
            module_calls = calls[module]
            inputs = [call.inputs for call in module_calls]
            outs = [
                g if g is not None else torch.zeros(call.shape, dtype=call.dtype, device=losses.device)
                for call, g in zip(module_calls, grads[position:])
            ]
            position += len(module_calls)
            for x in inputs + outs:
                if x.shape[0] != size:
                    raise ValueError(
                        f"module {type(module).__name__} saw a tensor of shape {tuple(x.shape)} for a micro-batch "
                        f"of {size} examples; per-example gradients need batch-first tensors (GPT-2 needs "
                        "batch-shaped position_ids)"
                    )
            traces[module] = self.layers[module].trace(inputs, outs)
        return traces

    # -- norms and sums ---------------------------------------------------------------------

    def _squared_norms(self, traces: Mapping[nn.Module, Trace], size: int, device: torch.device) -> dict[str, torch.Tensor]:
        squared = {name: torch.zeros(size, dtype=torch.float32, device=device) for name in self.params}
        for module, trace in traces.items():
            for name, values in self.layers[module].squared_norms(trace).items():
                squared[name] += values
        for tie in self.tied:
            if tie.head in traces and tie.embedding in traces:
                squared[tie.name] += 2 * _tied_cross_term(traces[tie.head], traces[tie.embedding])
        return squared

    def per_example_squared_norms(self, batch: Mapping[str, Any], loss_fn: PerExampleLoss) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """({name: [B] fp32 ‖g_i‖² of that parameter}, per-example losses [B]); nothing left in p.grad."""
        losses, calls = self._forward(batch, loss_fn)
        with _full_precision(losses.device):
            traces = self._backward(losses, calls)
            return self._squared_norms(traces, losses.shape[0], losses.device), losses.detach()

    def clipped_sum(self, batch, loss_fn):
        losses, calls = self._forward(batch, loss_fn)
        with _full_precision(losses.device):
            traces = self._backward(losses, calls)
            return self._clip_and_sum(traces, losses.detach())

    def _clip_and_sum(self, traces: dict[nn.Module, Trace], losses: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, ClipStats]:
        norms = per_example_block_norms(self.partition, self._squared_norms(traces, losses.shape[0], losses.device))
        # A non-finite loss drops its example even where its gradient happens to be finite.
        norms = mark_nonfinite_losses(norms, losses)
        factors = clip_factors(norms, self.thresholds)
        dropped = ~torch.isfinite(norms).all(dim=1)
        if bool(dropped.any()):
            traces = {module: trace.without(dropped) for module, trace in traces.items()}

        def scale_of(name: str) -> torch.Tensor:
            return factors[:, self.block_of[name]]

        summed: dict[str, torch.Tensor] = {}
        for module in list(traces):
            for name, values in self.layers[module].clipped_sums(traces.pop(module), scale_of).items():
                # Each layer returns fresh tensors, so a tied weight's second part can be added in place.
                summed[name] = summed[name].add_(values) if name in summed else values
        for name, p in self.params.items():
            if name not in summed:  # its module was not called in this forward
                summed[name] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return summed, losses, ClipStats.from_norms(norms, self.thresholds)
