"""The generic rule (`privacy.engine_fallback=generic`): per-example gradients of the own
parameters of a module no rule knows, by `torch.func`.

For each recorded call, the module alone is run again as a function of its own parameters
(`functional_call`, every other input — arguments, keyword arguments, children, buffers — as
recorded), once per example under `vmap`, and differentiated against the gradient autograd
delivered to its output: example i's gradient is the vector-Jacobian product ⟨∂y_i/∂θ, b_i⟩,
summed over the module's calls (exactly as a gradient sums over uses). Exact for any
module whose output row i depends only on input row i; it forms every example's gradient,
so it costs what Opacus' materialized gradients cost, for that module only.

What it cannot do exactly, it refuses, naming the module:
- randomness in the forward (dropout inside the module): a second draw would not be the first
  (vmap refuses random operations);
- a forward that mixes examples, or an argument whose first dimension only looks like the
  batch: on the engine's public stand-in of the first micro-batch, each call's per-example
  gradients must add up to the batch gradient of the same call, else the engine refuses rather
  than release a wrong clipping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .kernels import WeightNormRule
from .layers import Layer, ScaleOf, zero_rows


@dataclass(frozen=True)
class RecordedCall:
    """One call of a module the generic rule handles: its (detached) arguments and the positions,
    among the output's flattened leaves, of the tensors autograd delivers a gradient to."""

    args: tuple
    kwargs: dict
    differentiable: tuple[int, ...]
    autocast: tuple[bool, torch.dtype] | None  # (enabled, dtype) of the forward's device type


@dataclass
class PerExampleGradients:
    """The generic rule's trace: name → [B, *shape] fp32 per-example gradients, already formed."""

    grads: dict[str, torch.Tensor]
    keep_all: bool = False  # set by the engine; formed gradients cost the same for every row anyway
    # As `Trace.rounding`; always empty: a formed gradient's squared norm is a sum of squares, which
    # does not cancel.
    rounding: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def without(self, dropped: torch.Tensor) -> PerExampleGradients:
        """Dropped examples' rows zeroed, in place: the formed gradients are the engine's own."""
        return PerExampleGradients({name: zero_rows(g, dropped, own=True) for name, g in self.grads.items()}, self.keep_all)

    def merged(self, other: PerExampleGradients) -> PerExampleGradients:
        """Both traces' gradients, summed where they name the same (shared) parameter."""
        out = dict(self.grads)
        for name, g in other.grads.items():
            out[name] = out[name] + g if name in out else g
        return PerExampleGradients(out, self.keep_all)


def _detached(tree: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, tree)


class GenericLayer(Layer):
    """Per-example gradients of a module's own trainable parameters by torch.func (see the module docstring)."""

    def __init__(self, module: nn.Module, names: Mapping[str, str], weight_norms: WeightNormRule = "mixed", tied: bool = False):
        super().__init__(module, names, weight_norms, tied)
        self.checked = False  # whether the first micro-batch's per-example sums matched the batch gradient

    def record(self, args: tuple, kwargs: dict, output: Any) -> tuple[RecordedCall, list[torch.Tensor]]:
        leaves, _ = tree_flatten(output)
        positions = tuple(k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad)
        if not positions:
            raise RuntimeError("the fast engine needs the loss computed with gradients enabled")
        device = leaves[positions[0]].device.type
        autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) if torch.amp.is_autocast_available(device) else None
        return RecordedCall(_detached(tuple(args)), _detached(dict(kwargs)), positions, autocast), [leaves[k] for k in positions]

    def trace(self, inputs: list[RecordedCall], grads: list[list[torch.Tensor]]) -> PerExampleGradients:
        batch = grads[0][0].shape[0]
        total: dict[str, torch.Tensor] = {}
        for call, output_grads in zip(inputs, grads):
            for name, g in self._call_gradients(call, output_grads, batch).items():
                total[name] = total[name] + g if name in total else g
        self.checked = True
        return PerExampleGradients(total)

    def _call_gradients(self, call: RecordedCall, output_grads: list[torch.Tensor], batch: int) -> dict[str, torch.Tensor]:
        flat, spec = tree_flatten((call.args, call.kwargs))
        batched = [isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch for t in flat]
        params = {attribute: getattr(self.module, attribute).detach() for attribute in self.names}

        def call_with(own: dict[str, torch.Tensor], leaves: list) -> Any:
            args, kwargs = tree_unflatten(leaves, spec)
            # The forward's own autocast state: the engine's backward runs outside autocast.
            enabled, dtype = call.autocast or (False, None)
            with torch.autocast(output_grads[0].device.type, dtype=dtype, enabled=enabled):
                return functional_call(self.module, own, args, kwargs)

        def contracted(own: dict[str, torch.Tensor], leaves: list, grads: list[torch.Tensor]) -> torch.Tensor:
            """⟨y(θ), b⟩: its gradient in θ is the vector-Jacobian product of the call."""
            out, _ = tree_flatten(call_with(own, leaves))
            return sum((out[k].float() * g.float()).sum() for k, g in zip(call.differentiable, grads))

        def one_example(own: dict[str, torch.Tensor], rows: list[torch.Tensor], grads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
            rows_iter = iter(rows)
            leaves = [next(rows_iter).unsqueeze(0) if is_batched else t for t, is_batched in zip(flat, batched)]
            return grad(contracted)(own, leaves, [g.unsqueeze(0) for g in grads])

        rows = [t for t, is_batched in zip(flat, batched) if is_batched]
        try:
            per_example = vmap(one_example, in_dims=(None, 0, 0))(params, rows, list(output_grads))
        except RuntimeError as err:
            raise ValueError(
                f"the generic rule cannot form per-example gradients of {type(self.module).__name__}: {err}. "
                "(Randomness such as dropout inside the module cannot be replayed exactly.) Register a layer rule, "
                "freeze its parameters, or set privacy.engine_fallback=error to see every such module"
            ) from err
        per_example = {self.names[a]: g.float() for a, g in per_example.items()}
        if not self.checked:
            self._check_sums(per_example, params, call_with, flat, call.differentiable, output_grads)
        return per_example

    def _check_sums(self, per_example, params, call_with, flat, differentiable, output_grads) -> None:
        """Refuse a module whose examples' gradients do not add up to the batch gradient."""
        with torch.enable_grad():
            own = {a: p.clone().requires_grad_(True) for a, p in params.items()}
            out, _ = tree_flatten(call_with(own, flat))
            total = sum((out[k].float() * g.float()).sum() for k, g in zip(differentiable, output_grads))
            batch_grads = torch.autograd.grad(total, list(own.values()), allow_unused=True)
        for attribute, expected in zip(own, batch_grads):
            got = per_example[self.names[attribute]].sum(0)
            expected = torch.zeros_like(got) if expected is None else expected.float()
            scale = float(expected.abs().max()) if expected.numel() else 0.0
            if not torch.allclose(got, expected, rtol=1e-3, atol=1e-5 * max(scale, 1e-12)):
                raise ValueError(
                    f"the generic rule's per-example gradients of {type(self.module).__name__}.{attribute} do not add up to "
                    "the batch gradient: its forward mixes examples or takes an argument whose first dimension is not the "
                    "batch. Register a layer rule for it, or freeze its parameters"
                )

    def squared_norms(self, trace: PerExampleGradients) -> dict[str, torch.Tensor]:
        return {name: g.flatten(1).double().square().sum(1) for name, g in trace.grads.items()}

    def clipped_sums(self, trace: PerExampleGradients, scale_of: ScaleOf) -> dict[str, torch.Tensor]:
        return {name: torch.einsum("b,b...->...", scale_of(name), g) for name, g in trace.grads.items()}
