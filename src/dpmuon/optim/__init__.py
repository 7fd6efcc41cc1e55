"""Optimizers: post-processing of the released gradient g̃ (no access to data).

The names below load their module on first use (PEP 562): reading the optimizers' options
(dpmuon.optim.settings, for the configs) does not load torch. The Newton–Schulz iteration is
`dpmuon.optim.newton_schulz.newton_schulz` (its module's name would shadow it here).
"""

from __future__ import annotations

from ..lazy import lazy_exports

# name → the submodule that defines it
_EXPORTS = {
    "bias_corrected_newton_schulz": "bias_correction",
    "ReleasedParameters": "for_release",
    "build": "for_release",
    "HybridOptimizer": "hybrid",
    "MomentumRule": "momentum",
    "Muon": "muon",
    "estimate_snr": "muon",
    "update_scale_factor": "muon",
    "QUINTIC_TUNED": "newton_schulz",
    "resolve_coefficients": "newton_schulz",
    "series_coefficients": "newton_schulz",
    "AdamSettings": "settings",
    "MuonBCSettings": "settings",
    "MuonSettings": "settings",
    "OptimizerInputs": "settings",
    "OptimizerSettings": "settings",
    "SGDSettings": "settings",
    "build_optimizer": "settings",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
