"""The optimizers the driver builds, one settings class each (the `_target_` of
conf/optimizer/<name>.yaml). Every optimizer only ever reads p.grad (the release).

A settings class declares its options once, as fields (`dpmuon.settings.option`: type, default,
checks, help); `@settings("optimizer")` offers them to the YAMLs. `build(inputs)` makes the torch
optimizer from what the release makes public: the named trainable parameters, which of them are
hidden-layer matrices (and their storage layout), and the per-entry noise std of each one's
released gradient (0 for a non-private run). This module imports torch only in `build`, so that
reading the options is light. A new optimizer is its settings class plus one YAML that lists it
in its defaults; `@settings("optimizer", name=...)` registers the class under the name its YAML
has, for `dpmuon.optim.build` and `DPTrainer`. The learning rate has no default (it depends on
the task): the experiment's recipe or the caller gives it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hydra.utils import instantiate

from ..settings import Settings, option, settings
from .choices import BC_NOISE_STDS, MOMENTUM_KINDS, NS_NORMALIZATIONS, SCHEDULES, UPDATE_SCALES

if TYPE_CHECKING:
    import torch


@dataclass
class OptimizerInputs:
    params: Mapping[str, torch.nn.Parameter]
    hidden_matrices: Mapping[str, str] = field(default_factory=dict)  # name → "out_in" | "in_out"
    release_noise_std: Mapping[str, float] = field(default_factory=dict)
    generator: torch.Generator | None = None


@dataclass(kw_only=True)
class Display:
    rank: int = option(100, "row order in tables and curves", ge=0)
    color: str = option("#7f7f7f", "colour in every figure")


@dataclass(kw_only=True)
class OptimizerSettings(Settings):
    """What every optimizer takes; a subclass adds its own options and `build`."""

    name: str | None = option(None, "optimizer label (the YAML's file name)")
    private: bool = option(True, "clip, noise and account (false: the non-private reference)")
    display: Display = option(factory=Display, help="how tables and figures show it")
    lr: float = option(help="learning rate (peak of the schedule; default: the recipe's rate for this optimizer)", gt=0)
    schedule: str = option("constant", "learning-rate schedule over the planned steps (public: no privacy cost)", choices=SCHEDULES)
    warmup_steps: int = option(0, "linear warmup over the first N steps (0: none)", ge=0)
    weight_decay: float = option(0.0, "decoupled weight decay", ge=0)

    def build(self, inputs: OptimizerInputs) -> torch.optim.Optimizer:
        raise NotImplementedError


def build_optimizer(section: Mapping, inputs: OptimizerInputs) -> torch.optim.Optimizer:
    """The optimizer of a config section (`hydra.utils.instantiate` makes its `_target_` class)."""
    return instantiate(section, _convert_="all").build(inputs)


@settings("optimizer", name="dp_sgd")
@dataclass(kw_only=True)
class SGDSettings(OptimizerSettings):
    momentum: float = option(0.0, "momentum β", ge=0, lt=1)
    nesterov: bool = option(False, "Nesterov momentum")

    def build(self, inputs: OptimizerInputs) -> torch.optim.Optimizer:
        import torch

        return torch.optim.SGD(list(inputs.params.values()), lr=self.lr, momentum=self.momentum, nesterov=self.nesterov, weight_decay=self.weight_decay)


@settings("optimizer", name="dp_adam")
@dataclass(kw_only=True)
class AdamSettings(OptimizerSettings):
    betas: list = option(factory=lambda: [0.9, 0.999], help="Adam's (β1, β2)", kind="betas")
    eps: float = option(1.0e-8, "Adam ε", gt=0)

    def build(self, inputs: OptimizerInputs) -> torch.optim.Optimizer:
        return adamw(inputs.params.values(), self)


@dataclass(kw_only=True)
class AdamPart(Settings):
    """The Adam(W) that a Muon optimizer runs on the tensors that are not hidden matrices."""

    lr: float | None = option(None, "learning rate of the Adam part (null: optimizer.lr)", gt=0)
    betas: list = option(factory=lambda: [0.9, 0.999], help="Adam's (β1, β2)", kind="betas")
    eps: float = option(1.0e-8, "Adam ε", gt=0)
    weight_decay: float = option(0.0, "decoupled weight decay", ge=0)


def adamw(params, adam: AdamSettings | AdamPart) -> torch.optim.AdamW | None:
    import torch

    params = list(params)
    if not params:
        return None
    return torch.optim.AdamW(params, lr=float(adam.lr), betas=tuple(adam.betas), eps=adam.eps, weight_decay=adam.weight_decay)


@settings("optimizer", name="dp_muon")
@dataclass(kw_only=True)
class MuonSettings(OptimizerSettings):
    """Muon on the hidden matrices, Adam(W) on every other tensor, both from the same gradient."""

    momentum: float = option(0.95, "momentum β", ge=0, lt=1)
    momentum_kind: str = option("heavy_ball", "Muon momentum: m = βm + g, or m = βm + (1-β)g", choices=MOMENTUM_KINDS)
    nesterov: bool = option(False, "Nesterov momentum")
    ns_steps: int = option(5, "Newton–Schulz iterations", ge=1)
    ns_coefficients: str | list = option("quintic", "Newton–Schulz polynomial: quintic | series:K | [a, b, c]", kind="ns_coefficients")
    ns_normalize: str = option("frobenius", "normalisation before Newton–Schulz", choices=NS_NORMALIZATIONS)
    ns_dtype: str | None = option(None, "Newton–Schulz dtype (null: the parameter's)", choices=("bfloat16",))
    update_scale: str = option("adam_rms", "Muon update scale: 0.2·√max(m,n), √max(1,out/in) or 1", choices=UPDATE_SCALES)
    adam: AdamPart = option(factory=AdamPart, help="the Adam part (non-matrix tensors)")

    def build(self, inputs: OptimizerInputs) -> torch.optim.Optimizer:
        return self._hybrid(inputs, bias_correction=None)

    def _hybrid(self, inputs: OptimizerInputs, bias_correction: BiasCorrection | None) -> torch.optim.Optimizer:
        import torch

        from .hybrid import HybridOptimizer
        from .muon import Muon

        matrices = {n: p for n, p in inputs.params.items() if n in inputs.hidden_matrices}
        others = [p for n, p in inputs.params.items() if n not in inputs.hidden_matrices]
        if not matrices:
            raise ValueError("Muon found no hidden-layer matrices among the trainable parameters")
        muon = Muon(
            list(matrices.values()),
            lr=self.lr,
            momentum=self.momentum,
            momentum_kind=self.momentum_kind,
            nesterov=self.nesterov,
            ns_steps=self.ns_steps,
            ns_coefficients=self.ns_coefficients,
            ns_normalize=self.ns_normalize,
            ns_dtype=getattr(torch, self.ns_dtype) if self.ns_dtype else None,
            update_scale=self.update_scale,
            weight_decay=self.weight_decay,
            bias_correction=bias_correction is not None,
            **(dataclasses.asdict(bias_correction) if bias_correction is not None else {}),
            release_noise_std={p: inputs.release_noise_std.get(n, 0.0) for n, p in matrices.items()},
            layouts={p: inputs.hidden_matrices[n] for n, p in matrices.items()},
            generator=inputs.generator,
        )
        adam = dataclasses.replace(self.adam, lr=self.lr if self.adam.lr is None else self.adam.lr)
        return HybridOptimizer({"muon": muon, "adam": adamw(others, adam)})


@dataclass(kw_only=True)
class BiasCorrection:
    probe_scale: float = option(1.0, "DP-MuonBC probe scale ρ / s", gt=0)
    num_probes: int = option(1, "DP-MuonBC antithetic probe pairs K", ge=1)
    min_snr: float | None = option(None, "correct only where the public SNR estimate exceeds this (null: always)")
    match_norm: bool = option(False, "rescale F_BC(M) per matrix to ‖F(M)‖_F: the correction changes only the direction")
    noise_std: str = option("buffer", "DP-MuonBC's s: the momentum buffer's noise std, or one step's release", choices=BC_NOISE_STDS)


@settings("optimizer", name="dp_muonbc")
@dataclass(kw_only=True)
class MuonBCSettings(MuonSettings):
    """DP-MuonBC: Muon with the Newton–Schulz output replaced by its bias-corrected estimate."""

    bias_correction: BiasCorrection = option(factory=BiasCorrection, help="the bias correction")

    def build(self, inputs: OptimizerInputs) -> torch.optim.Optimizer:
        return self._hybrid(inputs, bias_correction=self.bias_correction)
