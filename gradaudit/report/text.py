"""Terminal summary: what autograd holds, what can be reclaimed, and where to act first."""

from __future__ import annotations

from typing import Optional, Sequence

from ..records import UNKNOWN, Report, Severity
from ..torchapi.compiler import COMPILED_NODE
from .units import human_bytes, share, signed_bytes
from .views import ranked_findings, selection

_RESET = "\033[0m"
_STYLES = {"bold": "\033[1m", "dim": "\033[2m", "red": "\033[31m", "amber": "\033[33m", "green": "\033[32m"}


class _Painter:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, style: str) -> str:
        # colour wraps already padded text, so it never disturbs the column arithmetic
        if not self.enabled or not text:
            return text
        return f"{_STYLES[style]}{text}{_RESET}"


def _clip(text: str, width: Optional[int]) -> str:
    if width is None:  # no width: whole lines (a pipe, a file)
        return text
    if width <= 0:
        return ""
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _columns(rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[list[str]]:
    """Pad every cell to its column's width (right-aligned where asked)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [[cell.rjust(widths[i]) if right[i] else cell.ljust(widths[i]) for i, cell in enumerate(row)]
            for row in rows]


def render(report: Report, *, color: bool = False, top: int = 10, width: Optional[int] = 100) -> str:
    """The summary a person reads in a terminal. ``color`` adds ANSI colours (the CLI asks on a TTY)."""
    paint = _Painter(color)
    mode = "train" if report.training else "eval"
    checked = "verified by the empirical check" if report.verified else "static rules"
    # on meta, the device whose kernels (and autocast) the figures follow
    device = f"{report.device} as {report.target}" if report.device == "meta" else report.device
    rank = f", rank {report.rank} of {report.world_size}" if report.world_size > 1 else ""
    lines = [paint(f"gradaudit: {report.model}", "bold")
             + f" (torch {report.torch_version}, {device}{rank}, {mode} mode, {checked})", ""]
    lines += _figures(report, paint) + [""]
    lines += _findings(report, paint, top, width) + [""]
    modules = _modules(report, paint, top, width)
    lines += modules + ([""] if modules else [])
    compared = _compared(report, paint, top, width)
    lines += compared + ([""] if compared else [])
    for note in report.notes:
        lines.append(_clip(f"note: {note}", width) if width is not None and len(note) < width else f"note: {note}")
    return "\n".join(lines).rstrip() + "\n"


def _figures(report: Report, paint: "_Painter") -> list[str]:
    """The byte figures: held, reclaimable (with bit-packing, with all fixes), and what is not held."""
    summary = report.summary()
    held = report.saved_bytes
    figures = [
        ("held by autograd", human_bytes(held), f"{summary['saved_tensors']} saved tensors", ""),
        ("reclaimable", human_bytes(report.reclaimable_bytes), share(report.reclaimable_bytes, held), "red"),
        ("reclaimable with bit-packing", human_bytes(report.reclaimable_with_bitpacking_bytes),
         share(report.reclaimable_with_bitpacking_bytes, held), "amber"),
    ]
    if report.rewrite_bytes:  # code changes (fused attention, a clone...) free more than trimming can
        figures.append(("reclaimable with all fixes", human_bytes(report.reclaimable_with_all_fixes_bytes),
                        share(report.reclaimable_with_all_fixes_bytes, held), "amber"))
    if report.recomputed_bytes:
        figures.append(("recomputed by checkpointing", human_bytes(report.recomputed_bytes), "not held", ""))
    if report.offloaded_bytes:
        figures.append(("offloaded", human_bytes(report.offloaded_bytes), "not held", ""))
    if report.kept_on_modules_bytes:
        figures.append(("kept on modules (attributes)", human_bytes(report.kept_on_modules_bytes),
                        "not autograd's", ""))
    lines = []
    padded = _columns([f[:3] for f in figures], (False, True, False))
    for (label, amount, note), (_, _, _, style) in zip(padded, figures):
        amount = paint(amount, style) if style and amount.strip() != "0 B" else amount
        lines.append(f"  {label}  {amount}  {note}".rstrip())
    if report.select or report.ignore:
        lines.append(paint(f"  counting the selected rules only ({selection(report)}): their findings, "
                           f"these figures and the thresholds", "dim"))
    if summary["uncounted_tensors"]:
        lines.append(paint(f"  {summary['uncounted_tensors']} saved tensors are not in these bytes: their "
                           f"size is unknown (sparse or other non-strided layout)", "dim"))
    if summary["unknown_tensors"]:
        lines.append(paint(f"  {summary['unknown_tensors']} saved tensors have no verdict ({_why_unknown(report)}); "
                           f"see the report's unexplained list", "dim"))
    return lines


def _why_unknown(report: Report) -> str:
    """Why the saves with no verdict have none: a compiled region's that its backward graph does not
    settle are judged by the proof, which leaves parameters, buffers and inputs (alive anyway)
    unproven; the rest have no rule."""
    unknown = [t for t in report.tensors if t.held and t.verdict == UNKNOWN]
    compiled = sum(t.node == COMPILED_NODE for t in unknown)
    if not compiled:
        return "no rule knows their op"
    rest = len(unknown) - compiled
    count = f"{compiled} " if rest else ""
    if report.verified:
        region = f"{count}kept by compiled regions, whose proof leaves parameters, buffers and inputs alone"
    else:
        region = f"{count}kept by compiled regions, taken by backward ops no rule reads; --verify judges them"
    return region if not rest else f"{region}; {rest} whose op no rule knows"


def _findings(report: Report, paint: "_Painter", top: int, width: Optional[int]) -> list[str]:
    """The ``top`` findings by bytes, each with its fix; or why there are none."""
    findings = ranked_findings(report)
    if not findings:
        if any(t.verdict == "unknown" for t in report.held_tensors):
            return [paint("No findings among the saves the rules understand (see the tensors "
                          "without a verdict above; --verify tries to settle them).", "amber")]
        return [paint("No findings: backward needs everything autograd holds here.", "green")]
    shown = findings[:top]
    lines = [paint(f"Top findings by bytes ({len(shown)} of {len(findings)})", "bold")]
    rows = [["CODE", "SEVERITY", "ALONE", "ALL FIXES", "MODULE", "SOURCE"]]
    for f in shown:
        module = f.module or "(root)"
        if f.module_class:
            module += f" ({f.module_class})"
        rows.append([f.code, str(f.severity), human_bytes(f.bytes), human_bytes(f.bytes_together), module,
                     f.source or "unknown"])
    table = _columns(rows, (False, False, True, True, False, False))
    for i, row in enumerate(table):
        text = _clip("  " + "  ".join(row).rstrip(), width)
        if i == 0:
            lines.append(paint(text, "dim"))
            continue
        finding = shown[i - 1]
        style = "red" if finding.severity == Severity.WASTE else "amber"
        lines.append(paint(text[:7], style) + text[7:] if text.startswith("  GA") else text)
        indent = " " * (2 + len(row[0]) + 2)
        lines.append(paint(_clip(f"{indent}{finding.name}: {finding.fix}", width), "dim"))
    if len(findings) > len(shown):
        lines.append(f"  … {len(findings) - len(shown)} more (JSON or HTML report lists them all)")
    lines.append(paint(f"  explain a rule: {shown[0].docs}", "dim"))
    return lines


def _modules(report: Report, paint: "_Painter", top: int, width: Optional[int]) -> list[str]:
    """The ``top`` modules by the bytes their own saves hold (none: no lines)."""
    modules = sorted((m for m in report.modules if m.own_bytes > 0), key=lambda m: (-m.own_bytes, m.path))[:top]
    if not modules:
        return []
    lines = [paint("Top modules by held bytes (their own saves)", "bold")]
    rows = [["MODULE", "CLASS", "HELD", "SHARE", "RECLAIMABLE"]]
    for m in modules:
        rows.append([m.path or "(root)", m.module_class, human_bytes(m.own_bytes), share(m.own_bytes, report.saved_bytes),
                     human_bytes(m.own_reclaimable_bytes)])
    for i, row in enumerate(_columns(rows, (False, False, True, True, True))):
        text = _clip("  " + "  ".join(row).rstrip(), width)
        lines.append(paint(text, "dim") if i == 0 else text)
    return lines


def _compared(report: Report, paint: "_Painter", top: int, width: Optional[int]) -> list[str]:
    """With ``compare_eager``: what the model run eagerly holds, and the ``top`` modules whose own saves
    changed most by compiling (none asked: no lines)."""
    if report.eager is None:
        return []
    eager = report.eager
    change = report.saved_bytes - eager.saved_bytes
    lines = [paint("Compiled against eager", "bold"),
             f"  eager autograd would hold {human_bytes(eager.saved_bytes)} (reclaimable with its fixes: "
             f"{human_bytes(eager.reclaimable_with_bitpacking_bytes)}); compiled, {human_bytes(report.saved_bytes)} "
             f"({signed_bytes(change)})"]
    rows = [["MODULE", "CLASS", "EAGER", "COMPILED", "CHANGE"]]
    for m in [m for m in eager.modules if m.compiled_bytes != m.eager_bytes][:top]:
        rows.append([m.path or "(root)", m.module_class, human_bytes(m.eager_bytes), human_bytes(m.compiled_bytes),
                     signed_bytes(m.compiled_bytes - m.eager_bytes)])
    if len(rows) > 1:
        for i, row in enumerate(_columns(rows, (False, False, True, True, True))):
            text = _clip("  " + "  ".join(row).rstrip(), width)
            lines.append(paint(text, "dim") if i == 0 else text)
    return lines

