"""Per-example gradient engines (registry: `privacy.engine`)."""

from torch import nn

from . import fast, opacus_engine  # noqa: F401  (register "fast" and "opacus")
from .base import ENGINES, PerExampleEngine, PerExampleLoss, build_engine, register_engine
from .fast import RMSNormLayer, register_layer
from .opacus_samplers import register_rms_norm_sampler

__all__ = ["ENGINES", "PerExampleEngine", "PerExampleLoss", "build_engine", "register_engine", "register_rms_norm"]


def register_rms_norm(*module_types: type[nn.Module]) -> None:
    """Teach both engines an HF-style RMSNorm class (forward γ ⊙ x / √(mean(x²) + variance_epsilon))."""
    register_layer(*module_types)(RMSNormLayer)
    register_rms_norm_sampler(*module_types)
