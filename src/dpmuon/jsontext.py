"""The one JSON writer for everything dpmuon writes or prints: strict JSON, always.

Python's `json` writes NaN and ±inf as the bare words `NaN`/`Infinity`, which no strict
parser (jq, JavaScript, most JSON libraries) accepts: a diverged run's summary would be
unreadable exactly when it matters. Here a non-finite float becomes `null` (its meaning, "no
finite value", is kept by the field's documentation), and `allow_nan=False` makes any path
that escapes the mapping fail loudly instead of writing invalid JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["finite_or_null", "to_json"]


def finite_or_null(value: Any) -> Any:
    """`value` with every non-finite float (also inside dicts, lists, tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy / torch scalars
        return finite_or_null(value.item())
    return value


def to_json(obj: Any, **kwargs: Any) -> str:
    """`json.dumps(obj, **kwargs)` as strict JSON: non-finite floats as null, never NaN/Infinity."""
    return json.dumps(finite_or_null(obj), allow_nan=False, **kwargs)
