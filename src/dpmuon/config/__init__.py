"""The configuration schema and its checks (see schema.py)."""

from .schema import OPTIONS, ConfigError, Option, validate

__all__ = ["OPTIONS", "ConfigError", "Option", "validate"]
