"""The configuration schema and its checks (see schema.py)."""

from .compose import compose_config
from .schema import OPTIONS, ConfigError, Option, validate

__all__ = ["OPTIONS", "ConfigError", "Option", "compose_config", "validate"]
