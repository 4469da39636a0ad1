"""The checkpoint plan as one self-contained HTML page: the memory/compute frontier as an SVG
picture with the baselines and the budget marked, the comparison table and the blocks.

Module paths are user data: the template autoescapes everything it prints. No script runs.
"""

from __future__ import annotations

from typing import Any, Optional

from markupsafe import Markup

from ..records import Bound, Cost
from .html import load_template, environment
from .units import human_bytes, path_ranges, share, stands_for


def frontier_chart(plan: Any, width: int = 900, height: int = 340) -> dict[str, Any]:
    """Coordinates of the frontier, the baselines, the chosen plan and the budget line."""
    left, right, top, bottom = 80, width - 30, 24, height - 40
    # the frontier is in the plan's cost units (FLOPs, or seconds with cost="time")
    step = (plan.step_seconds if plan.cost == Cost.TIME else plan.step_flops) or 1
    points = [(held, 100 * extra / step) for held, extra in plan.frontier]
    marks = [(b.name, b.held_bytes, 100 * plan.share(b)) for b in plan.baselines]
    chosen = (plan.held_bytes, 100 * plan.extra_compute)
    most_bytes = max([h for h, _ in points] + [h for _, h, _ in marks] + [plan.budget, 1])
    most_compute = max([c for _, c in points] + [c for _, _, c in marks] + [1.0])

    def x(held: float) -> float:
        return round(left + (right - left) * held / most_bytes, 1)

    def y(compute: float) -> float:
        return round(bottom - (bottom - top) * compute / most_compute, 1)

    path = "".join(f"{'M' if k == 0 else 'L'}{x(h)},{y(c)}" for k, (h, c) in enumerate(sorted(points)))
    return {
        "width": width, "height": height, "left": left, "right": right, "top": top, "bottom": bottom,
        "path": path,
        "points": [{"x": x(h), "y": y(c), "title": f"{human_bytes(h)} held, +{c:.1f}%"} for h, c in points],
        # a label near the right edge is written leftwards, so it stays inside the picture
        "baselines": [{"x": x(h), "y": y(c), "name": name, "title": f"{name}: {human_bytes(h)} held, +{c:.1f}%",
                       "anchor": "end" if x(h) > right - 120 else "start",
                       "lx": x(h) - 9 if x(h) > right - 120 else x(h) + 9} for name, h, c in marks],
        "chosen": {"x": x(chosen[0]), "y": y(chosen[1]),
                   "title": f"this plan: {human_bytes(chosen[0])} held, +{chosen[1]:.1f}%"},
        "budget": x(plan.budget) if plan.budget <= most_bytes and plan.bound == Bound.HELD else None,
        "xticks": [{"x": x(most_bytes * k / 4), "label": human_bytes(most_bytes * k / 4)} for k in range(5)],
        "yticks": [{"y": y(most_compute * k / 4), "label": f"{most_compute * k / 4:.0f}%"} for k in range(5)],
    }


def render(plan: Any, *, title: Optional[str] = None) -> str:
    """The plan as one HTML document (a string; the caller decides where it goes)."""
    rows = [{"name": "this plan" if plan.fits else "least possible", "held": plan.held_bytes, "peak": plan.peak_bytes,
             "extra": 100 * plan.extra_compute, "count": len(plan.checkpointed), "fits": plan.fits}]
    rows += [{"name": b.name, "held": b.held_bytes, "peak": b.peak_bytes, "extra": 100 * plan.share(b),
              "count": len(b.checkpointed), "fits": b.held_bytes <= plan.budget} for b in plan.baselines]
    context = {
        "title": title or f"gradaudit plan: {plan.model}",
        "plan": plan,
        "where": stands_for(plan.device, plan.target),  # as the terminal says it: "meta as cuda"
        "shares": {"held": share(plan.held_bytes, plan.unplanned_held_bytes)},
        "ranges": path_ranges(plan.checkpointed),
        "chart": frontier_chart(plan),
        "rows": rows,
        "chosen": set(plan.checkpointed),
        "by_time": plan.cost == Cost.TIME,  # the cost is measured time (else FLOPs)
        "by_peak": plan.bound == Bound.PEAK,  # the budget bounds the peak (else the held bytes)
        "css": Markup(load_template("report.css")),
    }
    return environment().get_template("plan.html.j2").render(context)
