"""Figures several reporters derive from a Report: ranked findings, per-module savings, timeline.

Pure functions of the report's plain data, so the terminal, HTML and graph views agree.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from ..accounting import Accountant, counted, roll_up
from ..records import HELD_KINDS, Finding, Report, SavedTensor, Storage
from .units import human_bytes


def finding_rank(finding: Finding) -> tuple:
    """Sort key: most bytes first (alone or as a share of all fixes), then stable by place."""
    return (-max(finding.bytes, finding.bytes_together), finding.code, finding.module, finding.tensors)


def ranked_findings(report: Report) -> list[Finding]:
    return sorted(report.findings, key=finding_rank)


def selection(report: Report) -> str:
    """``select GA1; ignore GA101``: the rule selection a report's figures count."""
    parts = [f"{what} {','.join(codes)}" for what, codes in (("select", report.select), ("ignore", report.ignore))
             if codes]
    return "; ".join(parts) or "every rule"


def freed_parts(report: Report) -> str:
    """What the report's all-fixes figure is made of, in words: "12 KiB by dropping saves whose
    values backward never reads, 2 KiB by keeping 1 bit per element of ...". Bit-packed saves are
    read by backward (as a sign or mask): they are not "unusable", only wider than needed."""
    dropped = report.reclaimable_bytes
    packed = report.reclaimable_with_bitpacking_bytes - dropped
    parts = [(dropped, "by dropping saves whose values backward never reads"),
             (packed, "by keeping 1 bit per element of saves backward reads only as a sign or mask"),
             (report.rewrite_bytes, "by the code changes the findings name (see each fix)")]
    return ", ".join(f"{human_bytes(n)} {how}" for n, how in parts if n) or "nothing"


def waste_findings_text(report: Report) -> str:
    """"3 waste findings" (the selected rules'): the count every fail-on-waste gate states."""
    count = len(report.waste_findings)
    return f"{count} waste finding{'s' if count != 1 else ''}"


def freed_with_all_fixes(report: Report) -> dict[int, int]:
    """Bytes each storage frees when every not-needed save the report's findings name is dropped
    and every 1-bit one packed (with select/ignore: the selected rules' findings)."""
    return Accountant.for_report(report).freed_by_all_fixes()


def module_bitpacking_totals(report: Report) -> dict[str, int]:
    """Per module path (children included): bytes freed by all fixes, bit-packing included.

    Attributed like ModuleTotal: each storage to the module of its first save, so the root's figure
    equals report.reclaimable_with_bitpacking_bytes.
    """
    own: dict[str, int] = defaultdict(int)
    for storage_id, freed in freed_with_all_fixes(report).items():
        own[report.storages[storage_id].module] += freed
    return dict(roll_up(own))


def held_in_save_order(report: Report) -> list[tuple[SavedTensor, Storage]]:
    """Each storage autograd holds, once, with its first save, in the order autograd packed the saves (saves
    gradaudit did not pack, such as a 0-dim tensor made from a Python number, come last). Their sizes add up
    to ``report.saved_bytes``."""
    saves = sorted(counted(report.tensors), key=lambda t: (t.source_index < 0, t.source_index, t.index))
    seen: set[int] = set()
    held = []
    for t in saves:
        storage = report.storages[t.storage_id]
        if t.storage_id not in seen and storage.kind in HELD_KINDS:
            held.append((t, storage))
        seen.add(t.storage_id)
    return held


@dataclass(frozen=True)
class TimelinePoint:
    module: str  # module whose saves ended here (a run of consecutive saves in one module)
    saves: int  # saves packed so far
    held_bytes: int  # bytes autograd holds so far
    held_after_fixes_bytes: int  # what it would hold with every finding fixed (bit-packing included)


def timeline(report: Report) -> list[TimelinePoint]:
    """Bytes held by autograd as the forward proceeds, one point per run of saves in one module.

    Saves are taken in the order autograd packed them; each held storage counts once, at its first
    save, whole (the same rule as the report's saved_bytes, so the last point equals it).
    """
    freed = freed_with_all_fixes(report)
    saves = sorted((t for t in counted(report.tensors) if t.source_index >= 0), key=lambda t: t.source_index)
    seen: set[int] = set()
    points: list[TimelinePoint] = []
    total = after = 0
    current: Optional[str] = None
    for count, t in enumerate(saves, 1):
        storage = report.storages[t.storage_id]
        if t.storage_id not in seen:
            seen.add(t.storage_id)
            if storage.kind in HELD_KINDS:
                total += storage.nbytes
                after += storage.nbytes - freed.get(t.storage_id, 0)
        if points and current == t.module:
            points[-1] = TimelinePoint(t.module, count, total, after)
        else:
            points.append(TimelinePoint(t.module, count, total, after))
            current = t.module
    return points
