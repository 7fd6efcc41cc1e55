"""`dpmuon.optim.build`: an optimizer for a model and its private release, by name.

What an optimizer takes from the release is public: which parameters it covers, which of them
are hidden-layer matrices (Muon's part) and the per-entry noise std of their released gradient
(DP-MuonBC's bias correction). Any object that says these (`ReleasedParameters`) will do — the
façade's `dpmuon.make_private(...)` does — so this module needs nothing of the privacy package.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from ..settings import registered
from .settings import OptimizerInputs, OptimizerSettings


class ReleasedParameters(Protocol):
    """What an optimizer may know of a private release."""

    params: Mapping[str, nn.Parameter]  # the trainable parameters the release writes (name → parameter)
    hidden_matrices: Mapping[str, str]  # name → "out_in" | "in_out" (models.hidden_matrices)

    def release_noise_std(self) -> Mapping[str, float]: ...


def settings_class(name: str | type[OptimizerSettings]) -> type[OptimizerSettings]:
    """The settings class registered under `name` (`@settings("optimizer", name=...)`: the
    built-in dp_sgd, dp_adam, dp_muon, dp_muonbc, and any imported module's), or the class given."""
    if isinstance(name, type) and issubclass(name, OptimizerSettings):
        return name
    names = registered("optimizer")
    if name not in names:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(names)}, or an OptimizerSettings subclass")
    return names[name]


def build(
    name: str | type[OptimizerSettings], model: nn.Module, release: ReleasedParameters, generator: torch.Generator | None = None, **hyper: Any
) -> torch.optim.Optimizer:
    """The optimizer `name` (dp_sgd, dp_adam, dp_muon, dp_muonbc, or the settings class of your
    own: an `OptimizerSettings` subclass) over the parameters `release` privatizes; `hyper` are
    its hyperparameters (conf/optimizer/<name>.yaml; nested sections as dicts, e.g.
    adam={"betas": [0.9, 0.99]}). `lr` has no default; the Adam part of the Muon optimizers takes
    it too unless adam={"lr": …} says otherwise. `generator` draws DP-MuonBC's probes (public
    randomness)."""
    cls = settings_class(name)
    if "lr" not in hyper:
        raise ValueError(f"dpmuon.optim.build({name!r}, …) needs lr=<learning rate> (no default: it depends on the task)")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(trainable) != set(release.params):
        differ = sorted(set(trainable) ^ set(release.params))
        raise ValueError(
            f"the model's trainable parameters are not those the release covers (first difference: {differ[0]}); freeze or unfreeze before make_private"
        )
    inputs = OptimizerInputs(
        params=trainable, hidden_matrices=dict(release.hidden_matrices), release_noise_std=dict(release.release_noise_std()), generator=generator
    )
    return cls(**hyper).build(inputs)
