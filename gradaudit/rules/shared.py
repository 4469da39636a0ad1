"""What several rule families share: the trim snippet their fixes show, and a save's shape as text."""

from __future__ import annotations

from typing import Any

# the fix of every rule whose waste gradaudit.trim drops as the forward proceeds
TRIM_SNIPPET = """
    import gradaudit
    with gradaudit.trim(model):        # keeps only what backward needs
        model(x).sum().backward()
"""


def shape_text(t: Any) -> str:
    """A save's shape as text: ``2x8x16x16``."""
    return "x".join(map(str, t.shape))
