"""Optimizers: post-processing of the released gradient g̃ (no access to data)."""

from .bias_correction import bias_corrected_newton_schulz
from .for_release import ReleasedParameters, build
from .hybrid import HybridOptimizer
from .momentum import MomentumRule
from .muon import Muon, estimate_snr, update_scale_factor
from .newton_schulz import QUINTIC_TUNED, newton_schulz, resolve_coefficients, series_coefficients
from .registry import DEFAULTS, OPTIMIZERS, OptimizerInputs, build_optimizer, register_optimizer

__all__ = [
    "DEFAULTS",
    "HybridOptimizer",
    "MomentumRule",
    "Muon",
    "OPTIMIZERS",
    "OptimizerInputs",
    "QUINTIC_TUNED",
    "ReleasedParameters",
    "bias_corrected_newton_schulz",
    "build",
    "build_optimizer",
    "estimate_snr",
    "newton_schulz",
    "register_optimizer",
    "resolve_coefficients",
    "series_coefficients",
    "update_scale_factor",
]
