"""Non-private diagnostics: quantities computed from the noise-free private signal, for
studying the mechanism. They are outside the (ε, δ) guarantee, off by default, and never feed
back into training."""

from .oracle import OracleAlignment

__all__ = ["OracleAlignment"]
