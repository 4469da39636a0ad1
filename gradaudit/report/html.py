"""The self-contained HTML report: one file, inline CSS, JS and SVG, nothing fetched from the network.

Module names and source paths are user data: jinja2 autoescapes everything the template prints, the
tensor table is built in the browser with textContent, and the JSON it reads is embedded with <, >
and & escaped so a name like ``</script>`` cannot end the script element.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import jinja2
from markupsafe import Markup

from ..accounting import counted
from ..records import Report
from ..rules.registry import get_rule
from . import graph
from .jsonout import finite
from .units import human_bytes, share, signed_bytes
from .views import module_bitpacking_totals, ranked_findings, selection, timeline

# The module picture lists at most this many rows, cutting at the deepest level that fits.
MAX_MODULE_ROWS = 300
# Collapsed-graph boxes expanded on demand, each drawn as its own small SVG.
MAX_EXPANDABLE_GROUPS = 12
TENSOR_COLUMNS = ("index", "module", "module_class", "node", "attr", "shape", "dtype", "view_bytes",
                  "storage_bytes", "storage_kind", "verdict", "bitpackable", "rule", "managed_by",
                  "source", "reason")

_env: Optional[jinja2.Environment] = None


def environment() -> jinja2.Environment:
    global _env
    if _env is None:
        _env = jinja2.Environment(
            loader=jinja2.FunctionLoader(load_template), autoescape=True,
            undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
        )
        _env.filters["bytes"] = human_bytes
        _env.filters["signed_bytes"] = signed_bytes
    return _env


def load_template(name: str) -> str:
    try:  # installed: pyproject.toml ships the top-level templates/ folder as gradaudit.templates
        folder = resources.files("gradaudit.templates")
    except ModuleNotFoundError:  # a checkout on sys.path, not installed: templates/ beside gradaudit/
        folder = Path(__file__).resolve().parents[2] / "templates"
    return folder.joinpath(name).read_text(encoding="utf-8")


def script_json(value: Any) -> Markup:
    """JSON safe inside a <script> element: no "</script>", "<!--" or "&" can appear literally."""
    text = json.dumps(finite(value), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    # U+2028/2029 are legal in JSON but end a line in older JavaScript parsers
    text = text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return Markup(text)


_SVG_PROLOG = re.compile(r"^.*?(?=<svg\b)", re.S)


def inline_svg(svg: str) -> Markup:
    """dot's SVG without its XML prolog/doctype so it can sit inside HTML; labels are already escaped."""
    return Markup(_SVG_PROLOG.sub("", svg, count=1))


def _natural(path: str) -> tuple:
    return graph.natural_key(path)


def module_rows(report: Report) -> list[dict[str, Any]]:
    """Rows of the "where the memory is" picture: modules in tree order, bars relative to the root."""
    packing = module_bitpacking_totals(report)
    modules = [m for m in report.modules if m.total_bytes > 0]
    root = max((m.total_bytes for m in modules), default=0)
    depth_of = {m.path: (len(m.path.split(".")) if m.path else 0) for m in modules}
    limit = max(depth_of.values(), default=0)
    while limit > 0 and sum(1 for d in depth_of.values() if d <= limit) > MAX_MODULE_ROWS:
        limit -= 1
    rows = []
    for m in sorted(modules, key=lambda m: _natural(m.path)):
        depth = depth_of[m.path]
        if depth > limit:
            continue
        packed = max(packing.get(m.path, 0), m.total_reclaimable_bytes)
        rows.append({
            "path": m.path or "(model)", "name": (m.path.rpartition(".")[2] or "(model)"),
            "module_class": m.module_class, "depth": depth, "bytes": m.total_bytes,
            "reclaimable": m.total_reclaimable_bytes, "packing": packed,
            "width": 100.0 * m.total_bytes / root if root else 0.0,
            "red": 100.0 * m.total_reclaimable_bytes / root if root else 0.0,
            "amber": 100.0 * (packed - m.total_reclaimable_bytes) / root if root else 0.0,
        })
    return rows


def finding_groups(report: Report) -> list[dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {}
    for f in ranked_findings(report):
        group = groups.get(f.code)
        if group is None:
            try:
                # docstring line breaks are not paragraph breaks
                sections = {k: " ".join(v.split()) for k, v in get_rule(f.code).sections().items()}
            except KeyError:  # a report from a gradaudit with rules this one does not know
                sections = {}
            group = groups[f.code] = {
                "code": f.code, "name": f.name, "severity": f.severity, "sections": sections,
                "fix": f.fix, "fix_code": f.fix_code, "fix_safe": f.fix_safe, "docs": f.docs, "docs_url": f.docs_url,
                "findings": [], "bytes": 0, "bytes_together": 0, "fixes": [],
            }
        group["findings"].append(f)
        group["bytes"] += f.bytes
        group["bytes_together"] += f.bytes_together
        if (f.fix, f.fix_code) not in group["fixes"]:
            group["fixes"].append((f.fix, f.fix_code))
    return sorted(groups.values(), key=lambda g: (-g["bytes_together"], -g["bytes"], g["code"]))


def tensor_rows(report: Report) -> list[list[Any]]:
    rows = []
    for t in report.tensors:
        storage = report.storages[t.storage_id] if t.storage_id >= 0 else None
        rows.append([t.index, t.module, t.module_class, t.node, t.attr, "x".join(map(str, t.shape)),
                     t.dtype, t.view_nbytes, storage.nbytes if storage else None, t.storage_kind,
                     t.verdict, t.bitpackable, t.rule, t.managed_by if t.node_id >= 0 else "freed",
                     t.source, t.reason])
    return rows


def timeline_chart(report: Report, width: int = 960, height: int = 240) -> Optional[dict[str, Any]]:
    """Coordinates for the step chart of bytes held as the forward proceeds (drawn in the template)."""
    points = timeline(report)
    if not points:
        return None
    left, right, top, bottom = 70, 10, 10, 30
    saves = points[-1].saves
    peak = max(p.held_bytes for p in points) or 1

    def x(n: int) -> float:
        return round(left + (width - left - right) * n / saves, 1)

    def y(b: int) -> float:
        return round(top + (height - top - bottom) * (1 - b / peak), 1)

    held_path, after_path = [f"M{x(0)},{y(0)}"], [f"M{x(0)},{y(0)}"]
    bands = []
    previous = 0
    for p in points:
        held_path.append(f"V{y(p.held_bytes)}H{x(p.saves)}")
        after_path.append(f"V{y(p.held_after_fixes_bytes)}H{x(p.saves)}")
        bands.append({"x": x(previous), "w": max(x(p.saves) - x(previous), 0.5), "module": p.module or "(model)",
                      "held": p.held_bytes, "after": p.held_after_fixes_bytes})
        previous = p.saves
    area = "".join(held_path) + f"V{y(0)}Z"
    ticks = [{"y": y(peak * k / 4), "label": human_bytes(peak * k / 4)} for k in range(5)]
    return {"width": width, "height": height, "held": "".join(held_path), "area": area,
            "after": "".join(after_path), "bands": bands, "ticks": ticks, "left": left,
            "right": width - right, "bottom": height - bottom, "saves": saves,
            "final": points[-1].held_bytes, "final_after": points[-1].held_after_fixes_bytes}


def graph_section(report: Report) -> dict[str, Any]:
    collapsed = len(report.nodes) > graph.AUTO_COLLAPSE_NODES
    try:
        svg = inline_svg(graph.to_svg(report))
    except graph.GraphvizMissing:
        return {"svg": None, "hint": graph.INSTALL_HINT, "collapsed": collapsed, "expansions": []}
    expansions = []
    if collapsed:
        for path in graph.waste_groups(report)[:MAX_EXPANDABLE_GROUPS]:
            expansions.append({"path": path, "svg": inline_svg(graph.to_svg(report, focus=path))})
    return {"svg": svg, "hint": None, "collapsed": collapsed, "expansions": expansions,
            "nodes": len(report.nodes)}


def render(report: Report, *, title: Optional[str] = None) -> str:
    """The whole report as one HTML document (a string; the caller decides where it goes)."""
    heldset = counted(report.tensors)
    context = {
        "title": title or f"gradaudit: {report.model}",
        "report": report,
        "summary": report.summary(),
        "shares": {
            "reclaimable": share(report.reclaimable_bytes, report.saved_bytes),
            "packing": share(report.reclaimable_with_bitpacking_bytes, report.saved_bytes),
            "every": share(report.reclaimable_with_all_fixes_bytes, report.saved_bytes),
        },
        "selection": selection(report) if report.select or report.ignore else "",
        "modules": module_rows(report),
        "groups": finding_groups(report),
        "timeline": timeline_chart(report),
        "graph": graph_section(report),
        "held_count": len(heldset),
        "data": script_json({"columns": TENSOR_COLUMNS, "rows": tensor_rows(report)}),
        "css": Markup(load_template("report.css")),
        "js": Markup(load_template("report.js")),
    }
    return environment().get_template("report.html.j2").render(context)
