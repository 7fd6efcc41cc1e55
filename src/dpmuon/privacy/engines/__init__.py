"""Per-example gradient engines (registry: `privacy.engine`)."""

from .base import ENGINES, PerExampleEngine, PerExampleLoss, build_engine, register_engine
from . import fast, opacus_engine  # noqa: F401  (register "fast" and "opacus")

__all__ = ["ENGINES", "PerExampleEngine", "PerExampleLoss", "build_engine", "register_engine"]
