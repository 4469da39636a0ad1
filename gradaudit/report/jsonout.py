"""The JSON document (schema_version 1): Report.to_dict() as strict JSON."""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from ..records import Report


def finite(value: Any) -> Any:
    """Non-finite floats (a node scalar such as clamp's max=inf) as strings: strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def document(report: Report) -> dict[str, Any]:
    return finite(report.to_dict())


def render(report: Report, *, indent: Optional[int] = 2) -> str:
    return json.dumps(document(report), indent=indent, ensure_ascii=False, allow_nan=False) + "\n"
