"""``assert_no_waste``: a regression test that fails when a model starts saving what backward cannot use.

Works in any test runner (it raises AssertionError); the pytest plugin (gradaudit.pytest_plugin)
only hands it out as a fixture.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .records import Finding, Report


def remaining_waste(report: Report, allow: Sequence[str] = ()) -> list[Finding]:
    """Waste findings whose code does not start with an allowed prefix."""
    from .rules.registry import selected

    prefixes = tuple(p.strip() for p in allow if p.strip())
    return [f for f in report.waste_findings if selected(f.code, ignore=prefixes)]


def reclaimable_by(report: Report, findings: Sequence[Finding]) -> int:
    """Bytes freed when exactly these findings are fixed together (storage-aware)."""
    from .accounting import Accountant

    accountant = Accountant(report.tensors, report.storages)
    freed = accountant.freed(*accountant.fixes_of(i for f in findings for i in f.tensors))
    # a rule may state its bytes itself (e.g. what a fused kernel would save): never report less
    return max([freed] + [f.bytes for f in findings])


def format_findings(findings: Sequence[Finding], *, limit: int = 20) -> str:
    """The finding list as the command line prints it: code, name, where, bytes, fix."""
    from .report.units import human_bytes
    from .report.views import finding_rank

    lines = []
    for f in sorted(findings, key=finding_rank)[:limit]:
        where = f"{f.module or '<model>'} ({f.module_class})" if f.module_class else (f.module or "<model>")
        lines.append(f"  {f.code} {f.name}  {where}  at {f.source or 'unknown source line'}")
        lines.append(f"      {f.message}")
        lines.append(f"      frees {human_bytes(f.bytes)} alone ({f.bytes} bytes), "
                     f"{human_bytes(f.bytes_together)} with every fix ({f.bytes_together} bytes)"
                     f"{', proven' if f.proven else ''}")
        lines.append(f"      fix: {f.fix}{'' if f.fix_safe else ' (changes numerics)'}; "
                     f"docs: gradaudit explain {f.code}")
    if len(findings) > limit:
        lines.append(f"  ... and {len(findings) - limit} more")
    return "\n".join(lines)


def assert_no_waste(
    model: Any,
    inputs: Any,
    *,
    allow: Sequence[str] = (),
    verify: bool = False,
    max_reclaimable_bytes: int = 0,
    trainable: Optional[Sequence[str]] = None,
) -> Report:
    """Fail when autograd holds memory for ``model(inputs)`` that backward cannot use.

    Raises AssertionError when waste findings remain after ``allow`` (rule code prefixes, e.g.
    ``("GA401",)``) and fixing them together would free more than ``max_reclaimable_bytes``. The
    message lists each finding: code, name, module path, source line, bytes and fix.
    ``verify=True`` also runs the empirical proof, which finds waste in custom autograd Functions
    (needs real tensors, not the meta device). ``trainable``: glob patterns over parameter names
    that require grad during the check (as in ``gradaudit.audit``). Returns the report on success.
    """
    __tracebackhide__ = True  # pytest shows the caller's line and the message, not these frames
    from .auditing import audit

    if isinstance(allow, str):
        allow = (allow,)
    report = audit(model, inputs, verify=verify, trainable=trainable)
    waste = remaining_waste(report, allow)
    if not waste:
        return report
    from .report.units import human_bytes

    freed = reclaimable_by(report, waste)
    if freed <= max_reclaimable_bytes:
        return report
    allowed = f"; allowed: {', '.join(allow)}" if allow else ""
    limit = f" (limit {human_bytes(max_reclaimable_bytes)})" if max_reclaimable_bytes else ""
    raise AssertionError(
        f"gradaudit: {report.model} holds {human_bytes(freed)} ({freed} bytes) for backward that "
        f"backward cannot use{limit}: {len(waste)} waste finding{'s' if len(waste) != 1 else ''}"
        f"{allowed}\n{format_findings(waste)}")
