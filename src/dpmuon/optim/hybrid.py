"""Several torch optimizers over disjoint parameter sets, stepped as one."""

from __future__ import annotations

from typing import Mapping

import torch


class HybridOptimizer:
    """Muon on the hidden matrices and AdamW on the rest, behind one optimizer interface.

    `param_groups` is the concatenation of the parts' groups (each tagged with "part"), so
    schedulers and loggers see every learning rate; state is saved per part.
    """

    def __init__(self, parts: Mapping[str, torch.optim.Optimizer]):
        self.parts = {name: opt for name, opt in parts.items() if opt is not None}
        for name, opt in self.parts.items():
            for group in opt.param_groups:
                group["part"] = name

    @property
    def param_groups(self):
        return [g for opt in self.parts.values() for g in opt.param_groups]

    @property
    def state(self):
        merged = {}
        for opt in self.parts.values():
            merged.update(opt.state)
        return merged

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.parts.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {name: opt.state_dict() for name, opt in self.parts.items()}

    def load_state_dict(self, state_dict):
        missing = set(self.parts) ^ set(state_dict)
        if missing:
            raise ValueError(f"optimizer state has parts {sorted(state_dict)}, expected {sorted(self.parts)}")
        for name, opt in self.parts.items():
            opt.load_state_dict(state_dict[name])

    def __repr__(self):
        inner = ", ".join(f"{name}={type(opt).__name__}" for name, opt in self.parts.items())
        return f"HybridOptimizer({inner})"
