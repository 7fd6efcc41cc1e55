"""Optimizer registry: name → builder. Every optimizer only ever reads p.grad (the release).

A builder receives the named trainable parameters, its config section, which parameters are
hidden-layer matrices (and their storage layout), and the public per-entry noise std of the
released gradient of each parameter (0 for a non-private run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .hybrid import HybridOptimizer
from .muon import Muon


@dataclass
class OptimizerInputs:
    params: Mapping[str, torch.nn.Parameter]
    hidden_matrices: Mapping[str, str] = field(default_factory=dict)  # name → "out_in" | "in_out"
    release_noise_std: Mapping[str, float] = field(default_factory=dict)
    generator: torch.Generator | None = None


OptimizerLike = torch.optim.Optimizer | HybridOptimizer
Builder = Callable[[OptimizerInputs, Mapping], OptimizerLike]
OPTIMIZERS: dict[str, Builder] = {}


def register_optimizer(name: str):
    def decorator(builder: Builder) -> Builder:
        if name in OPTIMIZERS:
            raise ValueError(f"optimizer {name!r} is already registered")
        OPTIMIZERS[name] = builder
        return builder

    return decorator


def build_optimizer(name: str, inputs: OptimizerInputs, cfg: Mapping) -> OptimizerLike:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(sorted(OPTIMIZERS))}")
    return OPTIMIZERS[name](inputs, cfg)


def _adamw(params, cfg: Mapping) -> torch.optim.AdamW | None:
    params = list(params)
    if not params:
        return None
    return torch.optim.AdamW(
        params,
        lr=float(cfg["lr"]),
        betas=tuple(float(b) for b in cfg.get("betas", (0.9, 0.999))),
        eps=float(cfg.get("eps", 1e-8)),
        weight_decay=float(cfg.get("weight_decay", 0.0)),
    )


@register_optimizer("sgd")
def build_sgd(inputs: OptimizerInputs, cfg: Mapping) -> OptimizerLike:
    return torch.optim.SGD(
        list(inputs.params.values()),
        lr=float(cfg["lr"]),
        momentum=float(cfg.get("momentum", 0.0)),
        nesterov=bool(cfg.get("nesterov", False)),
        weight_decay=float(cfg.get("weight_decay", 0.0)),
    )


@register_optimizer("adam")
def build_adam(inputs: OptimizerInputs, cfg: Mapping) -> OptimizerLike:
    return _adamw(inputs.params.values(), cfg)


def _build_muon(inputs: OptimizerInputs, cfg: Mapping, bias_correction: bool) -> OptimizerLike:
    matrices = {n: p for n, p in inputs.params.items() if n in inputs.hidden_matrices}
    others = [p for n, p in inputs.params.items() if n not in inputs.hidden_matrices]
    if not matrices:
        raise ValueError("Muon found no hidden-layer matrices among the trainable parameters")
    bc = cfg.get("bias_correction", {}) or {}
    ns_dtype = cfg.get("ns_dtype")
    muon = Muon(
        list(matrices.values()),
        lr=float(cfg["lr"]),
        momentum=float(cfg.get("momentum", 0.95)),
        momentum_kind=str(cfg.get("momentum_kind", "heavy_ball")),
        nesterov=bool(cfg.get("nesterov", False)),
        ns_steps=int(cfg.get("ns_steps", 5)),
        ns_coefficients=cfg.get("ns_coefficients", "quintic"),
        ns_normalize=str(cfg.get("ns_normalize", "frobenius")),
        ns_dtype=getattr(torch, ns_dtype) if ns_dtype else None,
        update_scale=str(cfg.get("update_scale", "adam_rms")),
        weight_decay=float(cfg.get("weight_decay", 0.0)),
        bias_correction=bias_correction,
        probe_scale=float(bc.get("probe_scale", 1.0)),
        num_probes=int(bc.get("num_probes", 1)),
        min_snr=None if bc.get("min_snr") is None else float(bc["min_snr"]),
        release_noise_std={p: inputs.release_noise_std.get(n, 0.0) for n, p in matrices.items()},
        layouts={p: inputs.hidden_matrices[n] for n, p in matrices.items()},
        generator=inputs.generator,
    )
    return HybridOptimizer({"muon": muon, "adam": _adamw(others, cfg["adam"])})


@register_optimizer("muon")
def build_muon(inputs: OptimizerInputs, cfg: Mapping) -> OptimizerLike:
    return _build_muon(inputs, cfg, bias_correction=False)


@register_optimizer("muonbc")
def build_muonbc(inputs: OptimizerInputs, cfg: Mapping) -> OptimizerLike:
    return _build_muon(inputs, cfg, bias_correction=True)
