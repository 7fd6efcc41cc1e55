"""Per-example gradient engines (registry: `privacy.engine`)."""

from .base import ENGINES, PerExampleEngine, PerExampleLoss, build_engine, register_engine
from . import fast, opacus_engine  # noqa: F401  (register "fast" and "opacus")
from .norms import register_rms_norm

__all__ = ["ENGINES", "PerExampleEngine", "PerExampleLoss", "build_engine", "register_engine", "register_rms_norm"]
