"""Sizes in bytes as people write them (``64MiB``, ``1.5GB``, a plain number of bytes): the one
parser that the command line's options and the API's budgets, memories and headrooms share.
"""

from __future__ import annotations

import re

from typing import Any

from .errors import GradauditError, LoadError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(text: str) -> int:
    """``64MiB`` -> 67108864; ``1.5GB`` -> 1500000000; a plain number is bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise LoadError(f"malformed size {text!r}: expected a number with an optional unit "
                        f"(B, KB, MB, GB, KiB, MiB, GiB), e.g. 64MiB")
    return int(float(match.group(1)) * _UNITS[unit])


def as_bytes(value: Any, what: str = "budget") -> int:
    """``value`` as bytes: an int as it is, a size such as '8GiB' parsed; anything else, or a negative
    figure, refused naming ``what`` it is (a budget, a memory, a headroom)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise GradauditError(f"{what} must be bytes (an int) or a size such as '8GiB', not {value!r}")
    nbytes = parse_size(value) if isinstance(value, str) else value
    if nbytes < 0:
        raise GradauditError(f"{what} must not be negative, got {nbytes}")
    return nbytes
