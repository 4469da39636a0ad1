"""Human-readable figures for reports: binary byte units and shares."""

from __future__ import annotations

from typing import Any, Sequence

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float | None) -> str:
    """``1536 -> "1.5 KiB"``; at most three significant figures from KiB up, exact bytes below."""
    if n is None:
        return "?"
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    unit = 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{sign}{int(value)} B"
    # 1023.9 KiB would print as "1024 KiB" with 3 significant figures; keep it in the current unit
    digits = 2 if value < 10 else 1 if value < 100 else 0
    figure = f"{value:.{digits}f}"
    if "." in figure:
        figure = figure.rstrip("0").rstrip(".")
    return f"{sign}{figure} {_UNITS[unit]}"


def stands_for(device: str, target: str) -> str:
    """Where figures are for: the device, or on meta the one it stands for ("meta as cuda")."""
    return f"meta as {target}" if device == "meta" else device


def share(part: int, whole: int) -> str:
    """``part`` as a percentage of ``whole`` ("-" when there is nothing to share)."""
    if whole <= 0:
        return "-"
    percent = 100.0 * part / whole
    if 0 < percent < 0.1:
        return "<0.1%"
    return f"{percent:.1f}%"


def path_ranges(paths: Sequence[str]) -> str:
    """``model.layers.3, model.layers.4, model.layers.5, fc`` -> ``model.layers.3-5, fc``."""
    parts: list[str] = []
    run: list[Any] = []  # [prefix, first, last]
    for path in paths:
        prefix, _, last = path.rpartition(".")
        number = int(last) if last.isdigit() else None
        if run and number is not None and prefix == run[0] and number == run[2] + 1:
            run[2] = number
            continue
        if run:
            parts.append(f"{run[0] + '.' if run[0] else ''}{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
            run = []
        if number is not None:
            run = [prefix, number, number]
        else:
            parts.append(path)
    if run:
        parts.append(f"{run[0] + '.' if run[0] else ''}{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
    return ", ".join(parts)


def signed_bytes(amount: int) -> str:
    """A change in bytes: "+1.5 MiB", "-512 B", "0 B"."""
    return ("+" if amount > 0 else "-" if amount < 0 else "") + human_bytes(abs(amount))

