"""Per-example gradient engines (registry: `privacy.engine`)."""

from . import fast, opacus_engine  # noqa: F401  (register "fast" and "opacus")
from .base import ENGINES, PerExampleEngine, PerExampleLoss, build_engine, register_engine
from .norms import register_rms_norm

__all__ = ["ENGINES", "PerExampleEngine", "PerExampleLoss", "build_engine", "register_engine", "register_rms_norm"]
