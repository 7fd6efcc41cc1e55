"""Optimizers: post-processing of the released gradient g̃ (no access to data)."""

from .bias_correction import bias_corrected_newton_schulz
from .hybrid import HybridOptimizer
from .momentum import MomentumRule
from .muon import Muon, estimate_snr, update_scale_factor
from .newton_schulz import QUINTIC_TUNED, newton_schulz, resolve_coefficients, series_coefficients
from .registry import OPTIMIZERS, OptimizerInputs, build_optimizer, register_optimizer

__all__ = [
    "HybridOptimizer",
    "MomentumRule",
    "Muon",
    "OPTIMIZERS",
    "OptimizerInputs",
    "QUINTIC_TUNED",
    "bias_corrected_newton_schulz",
    "build_optimizer",
    "estimate_snr",
    "newton_schulz",
    "register_optimizer",
    "resolve_coefficients",
    "series_coefficients",
    "update_scale_factor",
]
