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

from .settings import AdamSettings, MuonBCSettings, MuonSettings, OptimizerInputs, OptimizerSettings, SGDSettings

# The built-in optimizers by the names the driver's roster gives them (conf/optimizer/dp_*.yaml;
# tests/config/test_configs.py checks they agree). Any other is given by its settings class.
NAMES = {"dp_sgd": SGDSettings, "dp_adam": AdamSettings, "dp_muon": MuonSettings, "dp_muonbc": MuonBCSettings}


class ReleasedParameters(Protocol):
    """What an optimizer may know of a private release."""

    params: Mapping[str, nn.Parameter]  # the trainable parameters the release writes (name → parameter)
    hidden_matrices: Mapping[str, str]  # name → "out_in" | "in_out" (models.hidden_matrices)

    def release_noise_std(self) -> Mapping[str, float]: ...


def settings_class(name: str | type[OptimizerSettings]) -> type[OptimizerSettings]:
    """The settings class of a built-in optimizer's name, or the class given (a new optimizer's)."""
    if isinstance(name, type) and issubclass(name, OptimizerSettings):
        return name
    if name not in NAMES:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(NAMES)}, or an OptimizerSettings subclass")
    return NAMES[name]


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
