"""Several torch optimizers over disjoint parameter sets, stepped as one torch optimizer."""

from __future__ import annotations

from collections.abc import Mapping

import torch


class HybridOptimizer(torch.optim.Optimizer):
    """Muon on the hidden matrices and AdamW on the rest, as one `torch.optim.Optimizer`.

    `param_groups` are the parts' own group dicts (each tagged with "part"), so a torch
    scheduler that sets `group["lr"]` sets the parts' learning rates, and loggers see every
    rate. Each part keeps, steps and saves its own state; `state_dict()` is keyed by part.
    """

    def __init__(self, parts: Mapping[str, torch.optim.Optimizer | None]):
        self.parts = {name: opt for name, opt in parts.items() if opt is not None}
        for name, opt in self.parts.items():
            for group in opt.param_groups:
                group["part"] = name
        # No defaults of its own: every group already carries its part's hyperparameters.
        super().__init__(self._parts_groups(), defaults={})

    def _parts_groups(self) -> list[dict]:
        return [group for opt in self.parts.values() for group in opt.param_groups]

    @property
    def state(self):
        """The parts' states, merged (read-only view: each part owns its entries)."""
        merged = {}
        for opt in self.parts.values():
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value):
        # torch.optim.Optimizer.__init__ assigns an empty state; the parts hold the real one.
        if value:
            raise ValueError("HybridOptimizer's state lives in its parts")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.parts.values():
            opt.step()
        return loss

    def diagnostics(self) -> dict[str, dict[torch.Tensor, float]]:
        """The parts' `diagnostics()` (those that have one), merged: name → {parameter: value}."""
        merged: dict[str, dict[torch.Tensor, float]] = {}
        for opt in self.parts.values():
            for key, values in (opt.diagnostics() if hasattr(opt, "diagnostics") else {}).items():
                merged.setdefault(key, {}).update(values)
        return merged

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {name: opt.state_dict() for name, opt in self.parts.items()}

    def load_state_dict(self, state_dict):
        if set(self.parts) != set(state_dict):
            raise ValueError(f"optimizer state has parts {sorted(state_dict)}, expected {sorted(self.parts)}")
        for name, opt in self.parts.items():
            opt.load_state_dict(state_dict[name])
        # Loading replaces each part's group dicts: point at the new ones.
        self.param_groups = self._parts_groups()

    def __repr__(self):
        inner = ", ".join(f"{name}={type(opt).__name__}" for name, opt in self.parts.items())
        return f"HybridOptimizer({inner})"
