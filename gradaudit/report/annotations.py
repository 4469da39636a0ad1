"""Findings where CI shows them: GitHub Actions workflow commands (one annotation per finding, on the
model's source line) and SARIF 2.1.0 (code scanning), for ``gradaudit scan --output-format``.

A finding's source is ``file:line`` as the report gives it (relative to where the scan ran, a library
file by its package path); a finding whose source is unknown is annotated without a location.
"""

from __future__ import annotations

from typing import Any, Optional

from ..records import Report, Severity, rule_docs_url
from .units import human_bytes

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
INFORMATION_URI = "https://pypi.org/project/gradaudit/"
# GitHub's annotation levels and SARIF's result levels for a finding's severity
GITHUB_LEVELS = {Severity.WASTE: "warning", Severity.WARNING: "warning", Severity.INFO: "notice"}
SARIF_LEVELS = {Severity.WASTE: "warning", Severity.WARNING: "warning", Severity.INFO: "note"}


def _location(source: Optional[str]) -> Optional[tuple[str, int]]:
    """(file, line) of ``file:line``, or None for an unknown source."""
    if not source or ":" not in source:
        return None
    path, _, line = source.rpartition(":")
    return (path, int(line)) if line.isdigit() else None


def _escape(text: str, property_value: bool = False) -> str:
    """A workflow command's message (or property value) escaped as the runner reads it back."""
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if property_value else text


def _text(finding: Any) -> str:
    freed = f" ({human_bytes(finding.bytes)} reclaimable)" if finding.bytes else ""
    return f"{finding.message}{freed}. Fix: {finding.fix} ({finding.docs})"


def github(report: Report) -> str:
    """One ``::warning`` (waste, warning) or ``::notice`` (info) workflow command per finding."""
    lines = []
    for finding in report.findings:
        properties = [f"title={_escape(f'gradaudit {finding.code} {finding.name}', True)}"]
        where = _location(finding.source)
        if where is not None:
            properties[:0] = [f"file={_escape(where[0], True)}", f"line={where[1]}"]
        lines.append(f"::{GITHUB_LEVELS[finding.severity]} {','.join(properties)}::{_escape(_text(finding))}")
    return "\n".join(lines)


def sarif(report: Report) -> dict[str, Any]:
    """The findings as one SARIF 2.1.0 run: the rules they come from, one result per finding."""
    from ..rules import all_rules

    used = {f.code for f in report.findings}
    rules = [r for r in all_rules() if r.code in used]
    index = {r.code: i for i, r in enumerate(rules)}
    driver = {"name": "gradaudit", "informationUri": INFORMATION_URI, "rules": [
        {"id": r.code, "name": r.name, "shortDescription": {"text": r.summary},
         "fullDescription": {"text": r.doc.split("\n\n", 1)[0]}, "help": {"text": r.doc},
         "defaultConfiguration": {"level": SARIF_LEVELS[Severity(r.severity)]},
         **({"helpUri": rule_docs_url(r.code)} if "://" in rule_docs_url(r.code) else {})} for r in rules]}
    results = []
    for finding in report.findings:
        result: dict[str, Any] = {
            "ruleId": finding.code, "ruleIndex": index[finding.code], "level": SARIF_LEVELS[finding.severity],
            "message": {"text": _text(finding)},
            "properties": {"bytes": finding.bytes, "module": finding.module, "node": finding.node}}
        where = _location(finding.source)
        if where is not None:
            result["locations"] = [{"physicalLocation": {"artifactLocation": {"uri": where[0]},
                                                         "region": {"startLine": where[1]}}}]
        results.append(result)
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [{"tool": {"driver": driver}, "results": results}]}
