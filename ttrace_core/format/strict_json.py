"""Strict JSON for every result ttrace writes (`--json`, a localize job's result.json).

Python's `json.dumps` writes NaN and Infinity as the bare words `NaN` and `Infinity`, which are not
JSON: `jq`, JavaScript's `JSON.parse` and most other readers refuse the whole file. A comparison
holds such values by design (a tensor with NaNs has ratio inf), so they are written as `null`. What
the value was stays in the fields beside it: `status` ("nonfinite"), `num_nan` and `num_inf`.
"""

from __future__ import annotations

import json
import math


def finite_or_none(value: object) -> object:
    """`value` with every float that is NaN or +-inf, at any depth of dicts, lists and tuples, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {name: finite_or_none(item) for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


def dumps(value: object, **kwargs) -> str:
    """`json.dumps` that writes non-finite floats as null and refuses to write anything else that is not JSON."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)
