"""Byte accounting by storage: what autograd holds, and what dropping or bit-packing saves frees.

Rules (autograd-facts.md, "Counting bytes honestly"):
- bytes are counted once per storage, whole storage (a saved view keeps its whole base alive);
- parameters, buffers and the caller's inputs are alive anyway and cost nothing;
- a storage is freed only when *every* save referencing it is dropped (or bit-packed), and it is
  not a parameter, buffer, input or model output;
- the report's figures count the fixes of its findings only (``Accountant.scope``): with
  select/ignore, a save whose rule is not selected stays as it is, and a storage it shares is not
  freed.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional

from .records import HELD_KINDS, NOT_NEEDED, Finding, ModuleTotal, Report, SavedTensor, Storage, StorageKind


def counted(tensors: Iterable[SavedTensor]) -> list[SavedTensor]:
    """The held saves (``SavedTensor.held``) whose storage is known: the ones byte figures count."""
    return [t for t in tensors if t.held and t.storage_id >= 0]


def packed_bits_nbytes(t: SavedTensor) -> int:
    """Bytes of a 1-bit-per-element copy of a save: ceil(numel / 8)."""
    return (t.numel + 7) // 8


def packed_nbytes(t: SavedTensor, masks: str = "bits") -> int:
    """Bytes of the copy ``gradaudit.trim`` keeps of a bit-packable save: ``masks="bits"``, one bit per
    element (``packed_bits_nbytes``); ``"bytes"``, one bool per element."""
    return t.numel if masks == "bytes" else packed_bits_nbytes(t)


def fix_scope(findings: Iterable[Finding]) -> set[int]:
    """The saves whose fix (drop or bit-pack) these findings name: the tensors of every finding
    that is not a code change (``Finding.rewrite``: those free what their rule states)."""
    return {i for f in findings if not f.rewrite for i in f.tensors}


class Accountant:
    """Answers "how many bytes would this set of fixes free" for one report's saves.

    ``scope``: the saves whose fixes the figures about "every fix" count (``not_needed``,
    ``bitpackable``, ``all_fixes`` and what derives from them); None counts every save. A report
    scopes them to its (selected) findings: ``Accountant.for_report``.
    """

    def __init__(self, tensors: list[SavedTensor], storages: list[Storage],
                 scope: Optional[Iterable[int]] = None) -> None:
        self.tensors = tensors
        self.storages = storages
        self.scope = None if scope is None else set(scope)
        self.refs: dict[int, list[SavedTensor]] = defaultdict(list)
        # which saves count is fixed with the refs (held and storage known); verdicts are read per call
        self._counted = counted(tensors)
        for t in self._counted:
            self.refs[t.storage_id].append(t)

    @classmethod
    def for_report(cls, report: Report) -> "Accountant":
        """The accountant behind the report's figures: scoped to its findings' saves."""
        return cls(report.tensors, report.storages, fix_scope(report.findings))

    def _in_scope(self, indices: set[int]) -> set[int]:
        return indices if self.scope is None else indices & self.scope

    def saved_bytes(self) -> int:
        return sum(self.storages[s].nbytes for s in self.refs if self.storages[s].kind in HELD_KINDS)

    def freed(self, dropped: set[int], bitpacked: set[int] = frozenset(), masks: str = "bits") -> int:
        """Bytes freed when saves in ``dropped`` are replaced by nothing and those in ``bitpacked``
        by 1 bit per element (``SavedTensor.index`` values; with ``masks="bytes"`` one bool)."""
        return sum(self.freed_by_storage(dropped, bitpacked, masks).values())

    def freed_by_storage(self, dropped: set[int], bitpacked: set[int] = frozenset(),
                         masks: str = "bits") -> dict[int, int]:
        result: dict[int, int] = {}
        touched = {self.tensors[i].storage_id for i in (dropped | bitpacked) if self.tensors[i].storage_id >= 0}
        for storage_id in touched:
            storage = self.storages[storage_id]
            refs = self.refs.get(storage_id, [])
            if storage.kind != StorageKind.ACTIVATION or not refs:
                continue
            if not all(t.index in dropped or t.index in bitpacked for t in refs):
                continue
            # one packed copy per distinct view that is bit-packed rather than dropped
            views = {(t.storage_offset, t.shape, t.stride): t for t in refs
                     if t.index in bitpacked and t.index not in dropped}
            kept = sum(packed_nbytes(t, masks) for t in views.values())
            if storage.nbytes > kept:
                result[storage_id] = storage.nbytes - kept
        return result

    def not_needed(self) -> set[int]:
        return self._in_scope({t.index for t in self._counted if t.verdict == NOT_NEEDED})

    def bitpackable(self) -> set[int]:
        # the flag, not the verdict: a proven sign-only save whose values take three signs
        # (-, 0, +) needs more than one bit, and the proof clears the flag for it
        return self._in_scope({t.index for t in self._counted if t.bitpackable})

    def reclaimable_bytes(self) -> int:
        return self.freed(self.not_needed())

    def fixes_of(self, indices: Iterable[int]) -> tuple[set[int], set[int]]:
        """(dropped, bit-packed) among these saves when their fixes apply."""
        indices = set(indices)
        dropped = {i for i in indices if self.tensors[i].verdict == NOT_NEEDED}
        packed = {t.index for t in counted(self.tensors[i] for i in indices) if t.bitpackable}
        return dropped, packed - dropped

    def all_fixes(self) -> tuple[set[int], set[int]]:
        """(dropped, bit-packed) saves when every fix applies: unneeded saves are dropped, saves
        backward reads as one bit per element are packed."""
        dropped = self.not_needed()
        return dropped, self.bitpackable() - dropped

    def freed_by_all_fixes(self) -> dict[int, int]:
        """Storage id -> bytes freed when every fix applies."""
        return self.freed_by_storage(*self.all_fixes())

    def reclaimable_with_bitpacking_bytes(self) -> int:
        return sum(self.freed_by_all_fixes().values())


def roll_up(own: dict[str, int]) -> dict[str, int]:
    """Per-module figures including children: each module path's value added to every ancestor
    ("" is the root)."""
    totals: dict[str, int] = defaultdict(int)
    for path, value in own.items():
        parts = path.split(".") if path else []
        for i in range(len(parts) + 1):
            totals[".".join(parts[:i])] += value
    return totals


def module_totals(tensors: list[SavedTensor], storages: list[Storage], accountant: Accountant,
                  module_classes: dict[str, str], reclaimable: Optional[dict[int, int]] = None) -> list[ModuleTotal]:
    """Held and reclaimable bytes per module, own and including children.

    Each storage counts once, for the module of the first save that referenced it, so the root's
    total equals the report's saved_bytes. ``reclaimable``: ``accountant.freed_by_storage(
    accountant.not_needed())`` when the caller has it.
    """
    own: dict[str, int] = defaultdict(int)
    own_reclaimable: dict[str, int] = defaultdict(int)
    if reclaimable is None:
        reclaimable = accountant.freed_by_storage(accountant.not_needed())
    for storage_id in accountant.refs:
        storage = storages[storage_id]
        if storage.kind not in HELD_KINDS:
            continue
        own[storage.module] += storage.nbytes
        own_reclaimable[storage.module] += reclaimable.get(storage_id, 0)
    # roll_up(own) and roll_up(own_reclaimable) in one pass (both have the same paths); every
    # ancestor gets a row, the root ("") always
    totals: dict[str, int] = defaultdict(int)
    totals_reclaimable: dict[str, int] = defaultdict(int)
    for path, held in own.items():
        freed = own_reclaimable[path]
        parts = path.split(".") if path else []
        for i in range(len(parts) + 1):
            ancestor = ".".join(parts[:i])
            totals[ancestor] += held
            totals_reclaimable[ancestor] += freed
    paths = set(totals)
    paths.add("")
    return [
        ModuleTotal(path, module_classes.get(path, ""), own.get(path, 0), totals.get(path, 0),
                    own_reclaimable.get(path, 0), totals_reclaimable.get(path, 0))
        for path in sorted(paths)  # the root ("") first
    ]

