"""The fast engine: hooks, one forward and one backward per micro-batch, then the layer rules'
norms and book-keeping sums (see the package docstring)."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.profiler import record_function

from ...blocks import BlockPartition
from ...clipping import ClipStats, clip_factors, mark_nonfinite_losses, per_example_block_norms
from ..base import PerExampleEngine, PerExampleLoss, example_rows, full_precision, register_engine
from .kernels import WEIGHT_NORM_RULES, WeightNormRule, tied_cross_term
from .layers import LAYER_RULES, AffineLayer, EmbeddingLayer, Layer, Trace, rule_for


@dataclass
class Call:
    """One forward call of a hooked module."""

    inputs: torch.Tensor  # detached
    output: GradientEdge  # where autograd delivers the gradient of the module's output
    shape: torch.Size  # the output's, for a zero gradient when the output went unused
    dtype: torch.dtype


@dataclass(frozen=True)
class TiedHead:
    """A token embedding whose weight is also the weight of a Linear LM head."""

    name: str
    embedding: nn.Module
    head: nn.Module


def unsupported_module_error(name: str, module_name: str, module: nn.Module) -> ValueError:
    kind = type(module)
    known = ", ".join(sorted(t.__name__ for t in LAYER_RULES))
    return ValueError(
        f"parameter {name!r} is held by module {module_name!r} of type {kind.__name__} ({kind.__module__}), "
        f"which has no layer rule in the fast engine (rules: {known}). Register one with "
        f"`dpmuon.privacy.engines.fast.register_layer({kind.__name__})` on a `fast.Layer` subclass "
        "(for an HF-style RMSNorm: `dpmuon.privacy.engines.register_rms_norm(cls)`), freeze the "
        "parameter, or use privacy.engine=opacus"
    )


@register_engine("fast")
class FastEngine(PerExampleEngine):
    """Ghost / direct per-example norms (mixed rule) and book-keeping clipped sums.

    weight_norms: "mixed" (default: per layer, whichever of ghost and direct is cheaper for
    the micro-batch's sequence length), "ghost" or "direct" (forced, e.g. for testing).
    constant_time: keep every position in the kernels (`Trace.keep_all`), so that padding rows
    cost what real rows cost.
    """

    def __init__(self, model: nn.Module, partition: BlockPartition, weight_norms: WeightNormRule = "mixed", constant_time: bool = False):
        super().__init__(model, partition, constant_time)
        if weight_norms not in WEIGHT_NORM_RULES:
            raise ValueError(f"unknown weight norm rule {weight_norms!r}; valid: {', '.join(WEIGHT_NORM_RULES)}")
        owners, module_names = self._trainable_owners(model)
        self.tied: list[TiedHead] = []
        names_by_module: dict[nn.Module, dict[str, str]] = defaultdict(dict)
        for name, uses in owners.items():
            for module, attribute in uses:
                names_by_module[module][attribute] = name
            if len(uses) > 1:
                self.tied.append(self._tied_head(name, [m for m, _ in uses]))
        shared = {m for tie in self.tied for m in (tie.head, tie.embedding)}
        self.layers: dict[nn.Module, Layer] = {}
        for module, names in names_by_module.items():
            try:
                self.layers[module] = rule_for(module)(module, names, weight_norms, tied=module in shared)
            except ValueError as err:
                raise ValueError(f"module {module_names[module]!r}: {err}") from err

    def _trainable_owners(self, model: nn.Module) -> tuple[dict[str, list[tuple[nn.Module, str]]], dict[nn.Module, str]]:
        """(parameter name → the (module, attribute) pairs holding it, module → its name);
        refuses modules without a layer rule."""
        name_of = {id(p): n for n, p in model.named_parameters()}
        owners: dict[str, list[tuple[nn.Module, str]]] = defaultdict(list)
        module_names: dict[nn.Module, str] = {}
        for module_name, module in model.named_modules():
            for attribute, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                name = name_of[id(p)]
                if rule_for(module) is None:
                    raise unsupported_module_error(name, module_name, module)
                owners[name].append((module, attribute))
                module_names[module] = module_name
        outside = [n for n in owners if n not in self.params]
        if outside:
            raise ValueError(f"trainable parameters outside the block partition: {outside[:5]}")
        return owners, module_names

    @staticmethod
    def _tied_head(name: str, modules: list[nn.Module]) -> TiedHead:
        # By rule, not by isinstance: the cross term needs an embedding's lookup and a Linear's (out, in) layout.
        embeddings = [m for m in modules if rule_for(m) is EmbeddingLayer]
        heads = [m for m in modules if rule_for(m) is AffineLayer and isinstance(m, nn.Linear)]
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
        with self._recording() as calls, record_function("dpmuon.forward"):
            losses = loss_fn(self.model, batch)
        return losses, calls

    def _backward(self, losses: torch.Tensor, calls: Mapping[nn.Module, list[Call]]) -> dict[nn.Module, Trace]:
        size = losses.shape[0]
        modules = [m for m in self.layers if m in calls]
        edges = [call.output for m in modules for call in calls[m]]
        if losses.requires_grad and edges:
            # Gradients w.r.t. the layer outputs only: autograd then skips every parameter's
            # gradient, so no summed (non-private) gradient is ever formed or left in p.grad.
            with record_function("dpmuon.backward"):
                grads = torch.autograd.grad(losses.sum(), edges, allow_unused=True)
        else:
            grads = (None,) * len(edges)
        traces = {}
        position = 0
        for module in modules:
            module_calls = calls[module]
            inputs = [call.inputs for call in module_calls]
            outs = [g if g is not None else torch.zeros(call.shape, dtype=call.dtype, device=losses.device) for call, g in zip(module_calls, grads[position:])]
            position += len(module_calls)
            for x in inputs + outs:
                if x.shape[0] != size:
                    raise ValueError(
                        f"module {type(module).__name__} saw a tensor of shape {tuple(x.shape)} for a micro-batch "
                        f"of {size} examples; per-example gradients need batch-first tensors (GPT-2 needs "
                        "batch-shaped position_ids)"
                    )
            traces[module] = self.layers[module].trace(inputs, outs)
            traces[module].keep_all = self.constant_time
        return traces

    # -- norms and sums ---------------------------------------------------------------------

    def _squared_norms(self, traces: Mapping[nn.Module, Trace], size: int, device: torch.device) -> dict[str, torch.Tensor]:
        # Float64 sums: a tied weight's parts and their cross term may cancel.
        squared = {name: torch.zeros(size, dtype=torch.float64, device=device) for name in self.params}
        for module, trace in traces.items():
            for name, values in self.layers[module].squared_norms(trace).items():
                squared[name] += values
        for tie in self.tied:
            if tie.head in traces and tie.embedding in traces:
                head, embedding = traces[tie.head], traces[tie.embedding]
                squared[tie.name] += 2 * tied_cross_term(head.inputs, head.grads, embedding.inputs, embedding.grads)
        return squared

    def clipped_sum(self, batch, loss_fn):
        losses, calls = self._forward(batch, loss_fn)
        examples = example_rows(batch, losses.shape[0], losses.device)
        with full_precision(losses.device):
            traces = self._backward(losses, calls)
            return self._clip_and_sum(traces, losses.detach(), examples)

    def _clip_and_sum(
        self, traces: dict[nn.Module, Trace], losses: torch.Tensor, examples: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, ClipStats]:
        with record_function("dpmuon.norms"):
            norms = per_example_block_norms(self.partition, self._squared_norms(traces, losses.shape[0], losses.device))
        # A non-finite loss drops its example even where its gradient happens to be finite.
        norms = mark_nonfinite_losses(norms, losses)
        # Float64 factors from float64 norms, rounded once to scale the fp32 sums; rows that only
        # fill the micro-batch up (EXAMPLE_MASK) get 0.
        factors = clip_factors(norms, self.thresholds).masked_fill(~examples.unsqueeze(1), 0).float()
        dropped = ~torch.isfinite(norms).all(dim=1)
        if bool(dropped.any()):
            traces = {module: trace.without(dropped) for module, trace in traces.items()}

        def scale_of(name: str) -> torch.Tensor:
            return factors[:, self.block_of[name]]

        summed: dict[str, torch.Tensor] = {}
        # Heads before embeddings: a tied weight's embedding part is then added into the head's sum.
        with record_function("dpmuon.bookkeeping"):
            for module in sorted(traces, key=lambda m: isinstance(self.layers[m], EmbeddingLayer)):
                self.layers[module].add_clipped_sums(traces.pop(module), scale_of, summed)
        for name, p in self.params.items():
            if name not in summed:  # its module was not called in this forward
                summed[name] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return summed, losses[examples], ClipStats.from_norms(norms[examples], self.thresholds)
