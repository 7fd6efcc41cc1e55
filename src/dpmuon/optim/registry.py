"""Optimizer registry: name → builder and its defaults. Every optimizer only ever reads p.grad
(the release).

A builder receives the named trainable parameters, its config section, which parameters are
hidden-layer matrices (and their storage layout), and the public per-entry noise std of the
released gradient of each parameter (0 for a non-private run). Each builder's defaults are
declared beside it (`register_optimizer(name, defaults)`): `build_optimizer` completes a partial
section from them, and builders read every key without a fallback of their own. The learning
rates have no default (they depend on the task): a section must give them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from .hybrid import HybridOptimizer
from .muon import Muon


@dataclass
class OptimizerInputs:
    params: Mapping[str, torch.nn.Parameter]
    hidden_matrices: Mapping[str, str] = field(default_factory=dict)  # name → "out_in" | "in_out"
    release_noise_std: Mapping[str, float] = field(default_factory=dict)
    generator: torch.Generator | None = None


Builder = Callable[[OptimizerInputs, Mapping], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Builder] = {}
DEFAULTS: dict[str, dict] = {}  # name → every hyperparameter but the learning rates


def register_optimizer(name: str, defaults: Mapping | None = None):
    def decorator(builder: Builder) -> Builder:
        if name in OPTIMIZERS:
            raise ValueError(f"optimizer {name!r} is already registered")
        OPTIMIZERS[name] = builder
        DEFAULTS[name] = copy.deepcopy(dict(defaults or {}))
        return builder

    return decorator


def build_optimizer(name: str, inputs: OptimizerInputs, cfg: Mapping) -> torch.optim.Optimizer:
    """Build optimizer kind `name`; keys `cfg` leaves out take the builder's defaults."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(sorted(OPTIMIZERS))}")
    completed = _completed(copy.deepcopy(DEFAULTS[name]), cfg)
    missing = [key for key, section in (("lr", completed), ("adam.lr", completed.get("adam"))) if isinstance(section, Mapping) and "lr" not in section]
    if missing:
        raise ValueError(f"optimizer {name!r} needs {' and '.join(missing)} (learning rates have no default)")
    return OPTIMIZERS[name](inputs, completed)


def _completed(defaults: dict, given: Mapping) -> dict:
    """`given` over `defaults`, section by section (a partial `adam:` keeps the other keys)."""
    out = dict(defaults)
    for key, value in given.items():
        nested = isinstance(value, Mapping) and isinstance(out.get(key), dict)
        out[key] = _completed(out[key], value) if nested else value
    return out


def _adamw(params, cfg: Mapping) -> torch.optim.AdamW | None:
    params = list(params)
    if not params:
        return None
    return torch.optim.AdamW(
        params,
        lr=float(cfg["lr"]),
        betas=tuple(float(b) for b in cfg["betas"]),
        eps=float(cfg["eps"]),
        weight_decay=float(cfg["weight_decay"]),
    )


_ADAM = {"betas": [0.9, 0.999], "eps": 1.0e-8, "weight_decay": 0.0}
_MUON = {
    "momentum": 0.95,
    "momentum_kind": "heavy_ball",
    "nesterov": False,
    "ns_steps": 5,
    "ns_coefficients": "quintic",
    "ns_normalize": "frobenius",
    "ns_dtype": None,
    "update_scale": "adam_rms",
    "weight_decay": 0.0,
    "adam": _ADAM,  # the other tensors' Adam part
}
_BIAS_CORRECTION = {"probe_scale": 1.0, "num_probes": 1, "min_snr": None, "match_norm": False, "noise_std": "buffer"}


@register_optimizer("sgd", {"momentum": 0.0, "nesterov": False, "weight_decay": 0.0})
def build_sgd(inputs: OptimizerInputs, cfg: Mapping) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        list(inputs.params.values()),
        lr=float(cfg["lr"]),
        momentum=float(cfg["momentum"]),
        nesterov=bool(cfg["nesterov"]),
        weight_decay=float(cfg["weight_decay"]),
    )


@register_optimizer("adam", _ADAM)
def build_adam(inputs: OptimizerInputs, cfg: Mapping) -> torch.optim.Optimizer:
    return _adamw(inputs.params.values(), cfg)


def _build_muon(inputs: OptimizerInputs, cfg: Mapping, bias_correction: bool) -> torch.optim.Optimizer:
    matrices = {n: p for n, p in inputs.params.items() if n in inputs.hidden_matrices}
    others = [p for n, p in inputs.params.items() if n not in inputs.hidden_matrices]
    if not matrices:
        raise ValueError("Muon found no hidden-layer matrices among the trainable parameters")
    correction = {}
    if bias_correction:  # plain Muon has no bias_correction section
        bc = cfg["bias_correction"]
        correction = dict(
            probe_scale=float(bc["probe_scale"]),
            num_probes=int(bc["num_probes"]),
            min_snr=None if bc["min_snr"] is None else float(bc["min_snr"]),
            match_norm=bool(bc["match_norm"]),
            noise_std=str(bc["noise_std"]),
        )
    muon = Muon(
        list(matrices.values()),
        lr=float(cfg["lr"]),
        momentum=float(cfg["momentum"]),
        momentum_kind=str(cfg["momentum_kind"]),
        nesterov=bool(cfg["nesterov"]),
        ns_steps=int(cfg["ns_steps"]),
        ns_coefficients=cfg["ns_coefficients"],
        ns_normalize=str(cfg["ns_normalize"]),
        ns_dtype=getattr(torch, cfg["ns_dtype"]) if cfg["ns_dtype"] else None,
        update_scale=str(cfg["update_scale"]),
        weight_decay=float(cfg["weight_decay"]),
        bias_correction=bias_correction,
        **correction,
        release_noise_std={p: inputs.release_noise_std.get(n, 0.0) for n, p in matrices.items()},
        layouts={p: inputs.hidden_matrices[n] for n, p in matrices.items()},
        generator=inputs.generator,
    )
    return HybridOptimizer({"muon": muon, "adam": _adamw(others, cfg["adam"])})


@register_optimizer("muon", _MUON)
def build_muon(inputs: OptimizerInputs, cfg: Mapping) -> torch.optim.Optimizer:
    return _build_muon(inputs, cfg, bias_correction=False)


@register_optimizer("muonbc", {**_MUON, "bias_correction": _BIAS_CORRECTION})
def build_muonbc(inputs: OptimizerInputs, cfg: Mapping) -> torch.optim.Optimizer:
    return _build_muon(inputs, cfg, bias_correction=True)
