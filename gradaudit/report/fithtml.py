"""The fit as one self-contained HTML page: the step's memory through time by category, stacked,
with the device's memory as a line, before and after the remedy; the breakdown at the peak and what
users otherwise try beside the remedy.

Module paths and notes are user data: the template autoescapes everything it prints. No script runs.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from markupsafe import Markup

from .html import load_template, environment
from .units import human_bytes, path_ranges

# one colour per category, in the order they are stacked (what is there all along at the bottom)
COLOURS = {"parameters": "#8a96a3", "buffers": "#b4bcc6", "inputs": "#c9a66b", "optimizer_state": "#7d5ba6",
           "workspaces": "#6b6b6b", "gradient_buckets": "#e08e7b",
           "pipeline_buffers": "#d4a5c9", "gradients": "#c0392b", "activations": "#2a5db0", "temporaries": "#56a6c9",
           "unsplit_blocks": "#9a9a9a"}


MANY_PHASES = 8  # more phases than this (a pipeline stage's micro-batches) are labelled where there is room
LABEL_ROOM = 150  # pixels from one shown phase label to the next


def timeline_chart(timeline: Sequence[dict[str, Any]], memory: int, categories: Sequence[str], top_bytes: int,
                   width: int = 900, height: int = 300) -> dict[str, Any]:
    """The stacked areas of a timeline, the memory line and the phases' starts, as SVG coordinates;
    ``top_bytes``: the height of the scale (shared by the pictures before and after a remedy)."""
    left, right, top, bottom = 80, width - 20, 16, height - 36
    count = max(len(timeline), 1)

    def x(i: float) -> float:
        return round(left + (right - left) * i / max(count - 1, 1), 1)

    def y(nbytes: float) -> float:
        return round(bottom - (bottom - top) * nbytes / max(top_bytes, 1), 1)

    areas, below = [], [0] * len(timeline)
    for category in categories:
        above = [b + point.get(category, 0) for b, point in zip(below, timeline)]
        if any(a != b for a, b in zip(above, below)):
            upper = " ".join(f"{x(i)},{y(v)}" for i, v in enumerate(above))
            lower = " ".join(f"{x(i)},{y(v)}" for i, v in reversed(list(enumerate(below))))
            areas.append({"category": category, "colour": COLOURS.get(category, "#999"),
                          "points": f"{upper} {lower}"})
        below = above
    phases, last = [], None
    # (a label near the right edge is written leftwards; with many phases it is wider than 80 pixels)
    room = 80 if len({point["phase"] for point in timeline}) <= MANY_PHASES else LABEL_ROOM
    for i, point in enumerate(timeline):
        if point["phase"] != last:
            # a label near the right edge is written leftwards, so it stays inside the picture
            near_end = x(i) > right - room
            phases.append({"x": x(i), "name": point["phase"], "anchor": "end" if near_end else "start",
                           "lx": x(i) - 4 if near_end else x(i) + 4})
            last = point["phase"]
    if len(phases) > MANY_PHASES:  # a pipeline's micro-batches: a label where it has room, a line for each
        free_from = float("-inf")  # where the last label shown ends
        for phase in phases:
            start = phase["lx"] if phase["anchor"] == "start" else phase["lx"] - LABEL_ROOM
            if start < free_from:
                phase["name"] = ""
            else:
                free_from = start + LABEL_ROOM
    return {"width": width, "height": height, "left": left, "right": right, "top": top, "bottom": bottom,
            "areas": areas, "phases": phases,
            "memory": y(memory) if memory <= top_bytes else None,
            "yticks": [{"y": y(top_bytes * k / 4), "label": human_bytes(top_bytes * k / 4)} for k in range(5)]}


def render(fit: Any, *, title: Optional[str] = None) -> str:
    """The fit as one HTML document (a string; the caller decides where it goes)."""
    from ..fitting import CATEGORIES

    # on CUDA the allocator's unsplit blocks are a category of their own, last
    # (DDP's gradient buckets and a pipeline stage's buffers only where there are some)
    categories = (*(c for c in CATEGORIES if c in fit.breakdown), *(c for c in fit.breakdown if c not in CATEGORIES))
    remedy = fit.remedy
    highest = max([fit.memory, fit.peak_bytes] + ([remedy.peak_bytes] if remedy is not None else []))
    charts = [{"name": "the step as it is", "peak": fit.peak_bytes,
               "chart": timeline_chart(fit.timeline, fit.memory, categories, highest)}]
    if remedy is not None and remedy.timeline:
        charts.append({"name": f"with the remedy: {remedy.describe()}", "peak": remedy.peak_bytes,
                       "chart": timeline_chart(remedy.timeline, fit.memory, categories, highest)})
    context = {
        "title": title or f"gradaudit fit: {fit.model}",
        "fit": fit,
        "charts": charts,
        "legend": [{"category": c, "colour": COLOURS[c]} for c in categories],
        "breakdown": [{"category": c, "bytes": fit.breakdown.get(c, 0),
                       "remedied": remedy.breakdown.get(c, 0) if remedy is not None else None}
                      for c in categories],
        "ranges": path_ranges(remedy.checkpointed) if remedy is not None else "",
        "css": Markup(load_template("report.css")),
    }
    return environment().get_template("fit.html.j2").render(context)
