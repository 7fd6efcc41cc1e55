"""The fast engine: hooks, one forward and one backward per micro-batch, then the layer rules'
norms and book-keeping sums (see the package docstring)."""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.profiler import record_function

from ...blocks import BlockPartition
from ...clipping import ClipStats, clip_factors, mark_nonfinite_losses, per_example_block_norms
from ...conformance import public_stand_in, rng_kept
from ...settings import ENGINE_FALLBACKS
from ..base import PerExampleEngine, PerExampleLoss, add_to_lot_total, example_losses, example_rows, full_precision, ieee_fp32_matmuls, register_engine
from .generic import GenericLayer, PerExampleGradients
from .kernels import WEIGHT_NORM_RULES, WeightNormRule, tied_cross_term, within_gram_slack
from .layers import EXAMPLE_MAJOR_FLATTENING, LAYER_RULES, AffineLayer, EmbeddingLayer, Layer, Trace, rule_for


@dataclass
class Output:
    """One differentiable output of a hooked module's call."""

    edge: GradientEdge  # where autograd delivers its gradient
    shape: torch.Size  # for a zero gradient when the output went unused
    dtype: torch.dtype


@dataclass
class Call:
    """One forward call of a hooked module."""

    inputs: Any  # what its rule records (`Layer.record`), detached
    outputs: list[Output]


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
        "parameter, or set privacy.engine_fallback=generic (per-example gradients of that module by torch.func)"
    )


@register_engine("fast")
class FastEngine(PerExampleEngine):
    """Ghost / direct per-example norms (mixed rule) and book-keeping clipped sums.

    weight_norms: "mixed" (default: per layer, whichever of ghost and direct is cheaper for
    the micro-batch's sequence length), "ghost" or "direct" (forced, e.g. for testing).
    constant_time: keep every position in the kernels (`Trace.keep_all`), so that padding rows
    cost what real rows cost.
    """

    def __init__(
        self,
        model: nn.Module,
        partition: BlockPartition,
        weight_norms: WeightNormRule = "mixed",
        constant_time: bool = False,
        fallback: str = "generic",
    ):
        super().__init__(model, partition, constant_time)
        if weight_norms not in WEIGHT_NORM_RULES:
            raise ValueError(f"unknown weight norm rule {weight_norms!r}; valid: {', '.join(WEIGHT_NORM_RULES)}")
        if fallback not in ENGINE_FALLBACKS:
            raise ValueError(f"unknown privacy.engine_fallback {fallback!r}; valid: {', '.join(ENGINE_FALLBACKS)}")
        owners, module_names = self._trainable_owners(model)
        generic = self._generic_modules(owners, module_names, fallback)
        self.tied: list[TiedHead] = []
        names_by_module: dict[nn.Module, dict[str, str]] = defaultdict(dict)
        for name, uses in owners.items():
            for module, attribute in uses:
                names_by_module[module][attribute] = name
            if len(uses) > 1 and uses[0][0] not in generic:
                self.tied.append(self._tied_head(name, [m for m, _ in uses]))
        shared = {m for tie in self.tied for m in (tie.head, tie.embedding)}
        self.layers: dict[nn.Module, Layer] = {}
        for module, names in names_by_module.items():
            rule = GenericLayer if module in generic else rule_for(module)
            try:
                self.layers[module] = rule(module, names, weight_norms, tied=module in shared)
            except ValueError as err:
                raise ValueError(f"module {module_names[module]!r}: {err}") from err
        # Modules whose tensors come as example-major token rows [B·T, …] (layers.EXAMPLE_MAJOR_FLATTENING).
        self.token_rows = {m for parent in model.modules() if type(parent) in EXAMPLE_MAJOR_FLATTENING for m in parent.modules()}
        # Generic modules sharing a parameter: their traces are merged before norms are taken.
        self.generic_groups = self._sharing_groups(owners, generic)
        self.forms_row_gradients = bool(generic)
        sizes = {name: p.numel() for name, p in self.params.items()}
        generic_names = {names_by_module[m][a] for m in generic for a in names_by_module[m]}
        share = sum(sizes[n] for n in generic_names) / max(1, sum(sizes.values()))
        # One line for the run log (the caller logs it): which modules cost per-example gradients.
        self.fallback_summary = (
            f"engine fallback (generic: per-example gradients by torch.func) for {len(generic)} modules, "
            f"{share:.2%} of trainable parameters: " + ", ".join(sorted(f"{module_names[m]} ({type(m).__name__})" for m in generic))
            if generic
            else None
        )

    def _trainable_owners(self, model: nn.Module) -> tuple[dict[str, list[tuple[nn.Module, str]]], dict[nn.Module, str]]:
        """(parameter name → the (module, attribute) pairs holding it, module → its name)."""
        name_of = {id(p): n for n, p in model.named_parameters()}
        owners: dict[str, list[tuple[nn.Module, str]]] = defaultdict(list)
        module_names: dict[nn.Module, str] = {}
        for module_name, module in model.named_modules():
            for attribute, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                name = name_of[id(p)]
                owners[name].append((module, attribute))
                module_names[module] = module_name
        outside = [n for n in owners if n not in self.params]
        if outside:
            raise ValueError(f"trainable parameters outside the block partition: {outside[:5]}")
        return owners, module_names

    @staticmethod
    def _generic_modules(owners: Mapping[str, list[tuple[nn.Module, str]]], module_names: Mapping[nn.Module, str], fallback: str) -> set[nn.Module]:
        """The modules the generic rule handles: those without a layer rule and, so that a shared
        parameter's per-example gradient is one formed tensor, every other holder of a parameter
        they share. Under fallback=error, the first module without a rule is refused."""
        generic: set[nn.Module] = set()
        for name, uses in owners.items():
            for module, _ in uses:
                if rule_for(module) is None:
                    if fallback == "error":
                        raise unsupported_module_error(name, module_names[module], module)
                    generic.add(module)
        grown = True
        while grown:
            grown = False
            for uses in owners.values():
                holders = {m for m, _ in uses}
                if holders & generic and not holders <= generic:
                    generic |= holders
                    grown = True
        return generic

    @staticmethod
    def _sharing_groups(owners: Mapping[str, list[tuple[nn.Module, str]]], generic: set[nn.Module]) -> list[list[nn.Module]]:
        """Groups (≥ 2) of generic modules linked by shared parameters."""
        group_of: dict[nn.Module, list[nn.Module]] = {}
        for uses in owners.values():
            holders = list(dict.fromkeys(m for m, _ in uses))
            if len(holders) < 2 or holders[0] not in generic:
                continue
            merged: list[nn.Module] = []
            for m in holders:
                for member in group_of.get(m, [m]):
                    if member not in merged:
                        merged.append(member)
            for m in merged:
                group_of[m] = merged
        return list({id(g): g for g in group_of.values()}.values())

    @staticmethod
    def _tied_head(name: str, modules: list[nn.Module]) -> TiedHead:
        # By rule, not by isinstance: the cross term needs an embedding's lookup and a Linear's (out, in) layout.
        embeddings = [m for m in modules if rule_for(m) is not None and issubclass(rule_for(m), EmbeddingLayer)]
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
    def _recording(self) -> Iterator[tuple[dict[nn.Module, list[Call]], dict[str, torch.Tensor]]]:
        calls: dict[nn.Module, list[Call]] = defaultdict(list)
        # The weights each module computed with, by parameter name: the parameters themselves,
        # or under FSDP2 (fully_shard) the unsharded copies it gathers for the forward; the
        # first micro-batch's check differentiates with respect to these.
        used: dict[str, torch.Tensor] = {}

        def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            layer = self.layers[module]
            inputs, outputs = layer.record(args, kwargs, output)
            # The outputs' gradient edges, not the outputs: holding a tensor (e.g. the logits,
            # B × T × vocab) through the backward would keep memory autograd otherwise frees.
            calls[module].append(Call(inputs, [Output(get_gradient_edge(o), o.shape, o.dtype) for o in outputs]))
            if not self.uses_checked:
                for attribute, name in layer.names.items():
                    used.setdefault(name, getattr(module, attribute))

        handles = [m.register_forward_hook(record, with_kwargs=True) for m in self.layers]
        try:
            yield calls, used
        finally:
            for handle in handles:
                handle.remove()

    def _forward(self, batch: Mapping[str, Any], loss_fn: PerExampleLoss) -> tuple[torch.Tensor, dict[nn.Module, list[Call]], dict[str, torch.Tensor]]:
        with self._recording() as (calls, used), record_function("dpmuon.forward"):
            losses = loss_fn(self.model, batch)
        return losses, calls, used

    def _backward(self, losses: torch.Tensor, calls: Mapping[nn.Module, list[Call]]) -> dict[nn.Module, Trace | PerExampleGradients]:
        size = losses.shape[0]
        modules = [m for m in self.layers if m in calls]
        outputs = [output for m in modules for call in calls[m] for output in call.outputs]
        if losses.requires_grad and outputs:
            # Gradients w.r.t. the layer outputs only: autograd then skips every parameter's
            # gradient, so no summed (non-private) gradient is ever formed or left in p.grad.
            with record_function("dpmuon.backward"):
                grads = torch.autograd.grad(losses.sum(), [o.edge for o in outputs], allow_unused=True)
        else:
            grads = (None,) * len(outputs)
        grads = [g if g is not None else torch.zeros(o.shape, dtype=o.dtype, device=losses.device) for o, g in zip(outputs, grads)]
        traces: dict[nn.Module, Trace | PerExampleGradients] = {}
        position = 0
        for module in modules:
            module_calls = calls[module]
            outs = []
            for call in module_calls:
                outs.append(grads[position : position + len(call.outputs)])
                position += len(call.outputs)
            layer = self.layers[module]
            checked = [g for call_outs in outs for g in call_outs]
            if not isinstance(layer, GenericLayer):
                outs = [call_outs[0] for call_outs in outs]
                checked += [call.inputs for call in module_calls]
            rows_per_example = module in self.token_rows and not isinstance(layer, GenericLayer)
            for x in checked:
                if x.shape[0] != size and not (rows_per_example and x.shape[0] % max(size, 1) == 0):
                    raise ValueError(
                        f"module {type(module).__name__} saw a tensor of shape {tuple(x.shape)} for a micro-batch "
                        f"of {size} examples; per-example gradients need batch-first tensors (GPT-2 needs "
                        "batch-shaped position_ids)"
                    )
            inputs = [call.inputs for call in module_calls]
            if rows_per_example:
                inputs, outs = ([x.reshape(size, -1, *x.shape[1:]) for x in xs] for xs in (inputs, outs))
            traces[module] = layer.trace(inputs, outs)
            traces[module].keep_all = self.constant_time
        # Autograd hands one gradient tensor to both branches of an addition, so two traces may
        # hold the same memory: only a trace that holds its own may have it reordered in place.
        holders = Counter(t.grads.untyped_storage().data_ptr() for t in traces.values() if isinstance(t, Trace))
        for trace in traces.values():
            if isinstance(trace, Trace):
                trace.exclusive = holders[trace.grads.untyped_storage().data_ptr()] == 1
        for group in self.generic_groups:  # one formed gradient per shared parameter
            present = [m for m in group if m in traces]
            for m in present[1:]:
                traces[present[0]] = traces[present[0]].merged(traces.pop(m))
        return traces

    # -- norms and sums ---------------------------------------------------------------------

    def _squared_norms(self, traces: Mapping[nn.Module, Trace], size: int, device: torch.device) -> dict[str, torch.Tensor]:
        # Float64 sums: a tied weight's parts and their cross term may cancel.
        squared = {name: torch.zeros(size, dtype=torch.float64, device=device) for name in self.params}
        bounds: dict[str, torch.Tensor] = {}  # on the norms' rounding, where a rule's is not negligible
        for module, trace in traces.items():
            # Named per module type (and shape) for the bench's breakdown (scripts/bench_step.py --phases).
            with record_function(f"dpmuon.norms/{type(module).__name__}{tuple(module.weight.shape) if hasattr(module, 'weight') else ''}"):
                for name, values in self.layers[module].squared_norms(trace).items():
                    squared[name] += values
            for name, bound in trace.rounding.items():
                bounds[name] = bounds[name] + bound if name in bounds else bound
        for tie in self.tied:
            if tie.head in traces and tie.embedding in traces:
                head, embedding = traces[tie.head], traces[tie.embedding]
                with record_function("dpmuon.norms/tied head cross term"):
                    squared[tie.name] += 2 * tied_cross_term(head.inputs, head.grads, embedding.inputs, embedding.grads)
        # A norm computed with rounding is raised where its bound exceeds the slack: after the
        # cross term, since the bound is absolute and the whole may be far smaller than the part.
        for name, bound in bounds.items():
            squared[name] = within_gram_slack(squared[name], bound)
        return squared

    def clipped_sum(self, batch, loss_fn):
        summed: dict[str, torch.Tensor] = {}
        losses, stats = self._clipped(batch, loss_fn, lambda names: None, summed)
        for name, p in self.params.items():
            if name not in summed:  # its module was not called in this forward
                summed[name] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return summed, losses, stats

    def add_clipped_sum(self, batch, loss_fn, total):
        # Each parameter's fp32 sum goes into the float64 total once its last module is booked,
        # so the micro-batch's fp32 sums never all exist at once (peak memory: docs/performance.md).
        # A parameter no module used adds nothing.
        summed: dict[str, torch.Tensor] = {}

        def booked(names: Iterable[str]) -> None:
            with record_function("dpmuon.lot_total"):
                add_to_lot_total(total, {name: summed.pop(name) for name in names if name in summed})

        return self._clipped(batch, loss_fn, booked, summed)

    def _clipped(
        self, batch: Mapping[str, Any], loss_fn: PerExampleLoss, booked: Callable[[Iterable[str]], None], summed: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, ClipStats]:
        """One forward and backward, then the clipped sums into `summed`; `booked(names)` is called
        with the parameters whose sums are complete, module by module."""
        if not self.uses_checked:
            self._check_uses(public_stand_in(batch), loss_fn)
        losses, calls, _ = self._forward(batch, loss_fn)
        examples = example_rows(batch, losses.shape[0], losses.device)
        with full_precision(losses.device):
            traces = self._backward(losses, calls)
            with ieee_fp32_matmuls():
                return self._clip_and_sum(traces, losses.detach(), examples, booked, summed)

    # -- the first micro-batch's check -------------------------------------------------------

    uses_checked = False  # set once the rules' sums have matched autograd's batch gradient

    def _check_uses(self, stand_in: Mapping[str, Any], loss_fn: PerExampleLoss) -> None:
        """`_check_every_use_is_seen` on a public stand-in of the first micro-batch, not on the
        micro-batch itself: a check that had to wait for a micro-batch without a non-finite
        example would run an extra backward at a time set by the data (a timing channel under
        constant-time lots), and one run on filler rows alone would pass on zero gradients. The
        run's random streams (dropout) are left as they were."""
        device = next(iter(self.params.values())).device
        with rng_kept(self.model):
            losses, calls, used = self._forward(stand_in, loss_fn)
            if not losses.requires_grad:  # no parameter takes part: no use to miss
                self.uses_checked = True
                return
            # Under autocast or with half-precision weights, the batch gradient is rounded coarsely.
            coarse = torch.is_autocast_enabled(device.type) or any(p.dtype in (torch.float16, torch.bfloat16) for p in self.params.values())
            with full_precision(losses.device):
                batch_grads = self._batch_gradients(losses, used)
                traces = self._backward(losses, calls)
                self._check_every_use_is_seen(traces, batch_grads, losses.shape[0], coarse=coarse)

    def _batch_gradients(self, losses: torch.Tensor, used: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Autograd's (non-private) batch gradient, once, to check the rules against; never released.

        With respect to the weights the modules computed with (`used`): under FSDP2 the
        parameters are row shards that the forward never touches, and their gradient would be
        zero (a sharded DTensor), while the rules' sums are whole, plain tensors."""
        names = list(self.params)
        grads = torch.autograd.grad(losses.sum(), [used.get(name, self.params[name]) for name in names], retain_graph=True, allow_unused=True)
        found = {}
        for name, g in zip(names, grads):
            p = self.params[name]
            found[name] = torch.zeros(p.shape, dtype=p.dtype, device=losses.device) if g is None else g  # p.shape: the whole shape, sharded or not
        return found

    def _check_every_use_is_seen(
        self, traces: Mapping[nn.Module, Trace | PerExampleGradients], batch_grads: Mapping[str, torch.Tensor], size: int, coarse: bool
    ) -> None:
        """Refuse a model whose rules' unclipped sums Σ_i g_i miss part of a parameter's batch
        gradient: a parameter used outside the calls of the module holding it (a parent's
        `F.linear(h, embedding.weight)`) has a use no hook sees, so its norms would come out low.
        Checked once, to 1% (10% when `coarse`: a missed use is typically a large part of the
        gradient; the tolerance only absorbs rounding, TF32 matmuls included)."""
        if not all(bool(torch.isfinite(g).all()) for g in batch_grads.values()):
            raise ValueError(
                "the fast engine's check that every use of a parameter is seen ran the model on a public stand-in of the first "
                "micro-batch (its shapes; integers 0 or 1, floats in [0.5, 1.5), booleans True: conformance.public_stand_in), and "
                "the model's gradient came out non-finite, so the model cannot be checked; check its forward on such a batch"
            )
        sums: dict[str, torch.Tensor] = {}
        device = next(iter(batch_grads.values())).device
        ones = torch.ones(size, dtype=torch.float32, device=device)
        # Heads before embeddings, as in `_clip_and_sum`: a tied embedding adds into the head's sum.
        for module in sorted(traces, key=lambda m: isinstance(self.layers[m], EmbeddingLayer)):
            self.layers[module].add_clipped_sums(traces[module], lambda name: ones, sums)
        tolerance = 0.1 if coarse else 1e-2
        for name, expected in batch_grads.items():
            got = sums.get(name, torch.zeros(expected.shape, dtype=torch.float32, device=device))
            error = float((got.double() - expected.double()).norm())
            if error > tolerance * float(expected.double().norm()) + 1e-7:
                raise ValueError(
                    f"the fast engine's per-example gradients of {name!r} do not add up to its batch gradient (error {error:.3g}): "
                    "the parameter is used outside the calls of the module that holds it (e.g. a parent's F.linear(h, module.weight)), "
                    "which no per-example rule sees. Refusing rather than clipping a norm that comes out low; use the parameter "
                    "through its module, or freeze it"
                )
        self.uses_checked = True

    def _clip_and_sum(
        self,
        traces: dict[nn.Module, Trace],
        losses: torch.Tensor,
        examples: torch.Tensor,
        booked: Callable[[Iterable[str]], None],
        summed: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, ClipStats]:
        with record_function("dpmuon.norms"):
            norms = per_example_block_norms(self.partition, self._squared_norms(traces, losses.shape[0], losses.device))
        # A non-finite loss drops its example even where its gradient happens to be finite.
        norms = mark_nonfinite_losses(norms, losses)
        # Float64 factors from float64 norms, rounded once to scale the fp32 sums; rows that only
        # fill the micro-batch up (EXAMPLE_MASK) get 0.
        factors = clip_factors(norms, self.thresholds).masked_fill(~examples.unsqueeze(1), 0).float()
        dropped = ~torch.isfinite(norms).all(dim=1)
        # Under constant-time lots always, or a lot holding a non-finite example would take longer.
        if self.constant_time or bool(dropped.any()):
            traces = {module: trace.without(dropped) for module, trace in traces.items()}

        def scale_of(name: str) -> torch.Tensor:
            return factors[:, self.block_of[name]]

        # Heads before embeddings: a tied weight's embedding part is then added into the head's sum.
        # A parameter's sum is complete once the last module holding it is booked.
        uses = Counter(name for module in traces for name in self.layers[module].names.values())
        for module in sorted(traces, key=lambda m: isinstance(self.layers[m], EmbeddingLayer)):
            layer = self.layers[module]
            with record_function("dpmuon.bookkeeping"):
                layer.add_clipped_sums(traces.pop(module), scale_of, summed)
            uses.subtract(layer.names.values())
            booked([name for name in layer.names.values() if uses[name] == 0])
        booked(list(summed))  # a merged generic group's sums also hold its other members' parameters
        return example_losses(losses, examples), ClipStats.from_norms(norms, self.thresholds, examples)
