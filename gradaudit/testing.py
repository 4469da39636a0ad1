"""``assert_no_waste``: a regression test that fails when a model starts holding what backward does not need.

Works in any test runner (it raises AssertionError); the pytest plugin (gradaudit.pytest_plugin)
only hands it out as a fixture.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .records import Finding, Report


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
    target: Optional[str] = None,
) -> Report:
    """Fail when autograd holds memory for ``model(inputs)`` that fixing the findings would free.

    ``allow``: rule code prefixes (e.g. ``("GA401",)``) left out exactly as ``gradaudit scan
    --ignore`` leaves them out: their findings are not in the report, and bytes that only their
    fixes free are not counted (a storage an allowed save keeps is not freed). An entry that is a
    prefix of no rule code raises UnknownCodeError: a typo must not pass every model.

    Raises AssertionError when fixing every remaining waste finding together would free more than
    ``max_reclaimable_bytes`` (``Report.reclaimable_with_all_fixes_bytes``: the figure
    ``--max-reclaimable`` compares). The message says what those bytes are and lists each finding:
    code, name, module path, source line, bytes and fix. ``verify=True`` also runs the empirical
    proof, which finds waste in custom autograd Functions (needs real tensors, not the meta
    device). ``trainable``: glob patterns over parameter names that require grad during the check
    (as in ``gradaudit.audit``). ``target``: on the meta device, the device type to check for
    ("cpu" or "cuda", as in ``gradaudit.audit``: e.g. cuDNN batch norm for "cuda"). Returns the
    report on success.
    """
    __tracebackhide__ = True  # pytest shows the caller's line and the message, not these frames
    from .auditing import audit
    from .rules.registry import check_codes

    allow = check_codes(allow, "allow entry")
    report = audit(model, inputs, verify=verify, trainable=trainable, ignore=allow, target=target)
    freed = report.reclaimable_with_all_fixes_bytes
    if freed <= max_reclaimable_bytes:
        return report
    from .report.units import human_bytes
    from .report.views import freed_parts, waste_findings_text

    allowed = f"; allowed: {', '.join(allow)}" if allow else ""
    limit = f" (limit {human_bytes(max_reclaimable_bytes)})" if max_reclaimable_bytes else ""
    raise AssertionError(
        f"gradaudit: {report.model}: {human_bytes(freed)} ({freed} bytes) held for backward could be freed"
        f"{limit}: {freed_parts(report)}; {waste_findings_text(report)}{allowed}\n"
        f"{format_findings(report.waste_findings)}")
