"""The chain model of one audit (solve.py's ``Chain``): per storage of a held kind, which saves hold
it, inside which candidate block, whole or (under ``gradaudit.trim``) as a bit-packed copy; and the
selective option of the blocks with costly ops, from one more audit with all of them checkpointed
op by op.

Under trim the figures are what trim leaves: trim decides from the op knowledge the verdicts come
from, so a save it drops holds nothing, a save it bit-packs holds a packed copy of its view, and a
storage another save keeps whole costs its whole size (``saves_as_trimmed``). ``held_by_report``
is the same figure by the audit's own accounting, which the chain must agree with.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from torch import nn

from .. import torchapi
from ..accounting import Accountant, counted, packed_nbytes
from ..auditing import audit
from ..recorder import CHECKPOINT_INPUTS
from ..records import HELD_KINDS, NOT_NEEDED, StorageKind
from .apply import SELECTIVE_POLICY, PlanHandle
from .candidates import inside
from .solve import Block, Chain
from ..torchapi.checkpoint import mutated_cached

WHOLE = "whole"  # a save that holds its whole storage (see saves_as_trimmed)


def saves_as_trimmed(report: Any, bitpack: Optional[bool], masks: str = "bits") -> dict[int, Any]:
    """What holds each counted save's bytes, by ``SavedTensor.index``: ``WHOLE`` (its storage),
    ``None`` (nothing: trim drops it) or the key of its bit-packed view (trim bit-packs it: one bit
    per element, or with ``masks="bytes"`` one bool, and a bool save left as it is). Without trim
    (``bitpack`` None) every save is whole.

    Trim decides from the op knowledge the audit's verdicts come from, so it drops the saves the
    audit calls not needed and (with bitpack) bit-packs the bit-packable ones; a save that
    bypassed saved-tensor hooks (a wrapped Python number) it never sees. Only activations count as
    freed, as in the audit's own figure (``Accountant.freed_by_storage``: parameters, buffers and
    inputs are alive anyway, and so is a model output the caller holds)."""
    decided: dict[int, Any] = {}
    for t in counted(report.tensors):
        if bitpack is None or t.source_index < 0 or report.storages[t.storage_id].kind != StorageKind.ACTIVATION:
            decided[t.index] = WHOLE
        elif t.verdict == NOT_NEEDED:
            decided[t.index] = None
        elif bitpack and t.bitpackable and not (masks == "bytes" and t.dtype == "bool"):
            decided[t.index] = (t.storage_id, t.storage_offset, tuple(t.shape), tuple(t.stride))
        else:
            decided[t.index] = WHOLE
    return decided


def trim_changes(report: Any) -> bool:
    """Whether trim (bit-packing: it drops what it drops without, and packs too) would change a save of
    the audited forward in its steady steps, the ones a training loop runs and plan and fit measure:
    drop or pack one, other than a drop its steady plan leaves alone because it frees nothing (an
    empty save, or one whose storage a save trim keeps whole also holds: ``trimming.steady._slot``).
    Where it would not, a step with trim makes the tensors the same step without it makes. (A torch
    without per-save hooks has no steady plan: every forward decides, and drops, there.)"""
    if not torchapi.has("saved tensor hooks per save"):
        return True
    decided = saves_as_trimmed(report, True)
    saves = counted(report.tensors)
    # the storages trim's own boxes keep whole (a save that bypassed its hooks is none of them)
    whole = {t.storage_id for t in saves if decided[t.index] == WHOLE and t.source_index >= 0}
    return any(decided[t.index] != WHOLE and not (decided[t.index] is None and (t.numel == 0 or t.storage_id in whole))
               for t in saves)


def held_by_report(report: Any, bitpack: Optional[bool], masks: str = "bits") -> int:
    """What the audited forward holds (with trim where ``bitpack`` is not None, its masks as ``masks``),
    by the audit's own accounting: saved_bytes less what trim's drops and packing free
    (``Accountant.freed``)."""
    if bitpack is None:
        return report.saved_bytes
    decided = saves_as_trimmed(report, bitpack, masks)
    dropped = {i for i, how in decided.items() if how is None}
    packed = {i for i, how in decided.items() if how is not None and how != WHOLE}
    return report.saved_bytes - Accountant(report.tensors, report.storages).freed(dropped, packed, masks)


def build_chain(report: Any, ran: Sequence[str], calls: dict[str, list], costs: dict[str, tuple[int, int]],
                bitpack: Optional[bool], masks: str = "bits") -> Chain:
    """The planner's chain of the blocks ``ran`` (forward order) from one audit: per storage of a held
    kind, which saves hold it, inside which block, whole or (under trim) as a bit-packed copy.
    ``costs``: per block, what recomputing it costs and what an op-level checkpoint does not redo."""
    nbytes = {s.id: s.nbytes for s in report.storages if s.kind in HELD_KINDS}
    for call in report.module_calls:
        for sid, size, kind in call.inputs:
            if kind in HELD_KINDS:
                nbytes[sid] = size
    decided = saves_as_trimmed(report, bitpack, masks)
    copies: dict[tuple, int] = {}  # bit-packed view -> copy id
    bits: dict[int, tuple[int, int]] = {}
    # per block (None: outside every block), the storages held whole and the copies held
    whole: dict[Optional[str], set[int]] = {path: set() for path in [None, *ran]}
    packed: dict[Optional[str], set[int]] = {path: set() for path in [None, *ran]}
    tensors = {t.index: t for t in report.tensors}
    for index, how in decided.items():
        t = tensors[index]
        if t.storage_id not in nbytes or how is None:
            continue
        # a save that bypassed saved-tensor hooks (a wrapped Python number: autograd keeps those
        # plainly) stays held inside a checkpoint too: it is not the block's to drop
        block = next((p for p in ran if inside(t.module, p)), None) if t.source_index >= 0 else None
        if how == WHOLE:
            whole[block].add(t.storage_id)
        else:
            copy = copies.setdefault(how, len(copies))
            bits[copy] = (t.storage_id, packed_nbytes(t, masks))
            packed[block].add(copy)
    blocks = [Block(path, calls[path][0].module_class, len(calls[path]), costs[path][0], frozenset(whole[path]),
                    frozenset(sid for call in calls[path] for sid, _, kind in call.inputs if kind in HELD_KINDS),
                    kept_flops=costs[path][1], packed=frozenset(packed[path]))
              for path in ran]
    return Chain(blocks, nbytes, frozenset(whole[None]), bits=bits, outside_packed=frozenset(packed[None]))


def audited_with(model: nn.Module, inputs: Any, trainable: Any, frozen: Any, target: Optional[str],
                 watch: Sequence[str], checkpointed: dict[str, str], bitpack: Optional[bool],
                 masks: str = "bits") -> tuple[Any, set[str]]:
    """An audit with ``checkpointed`` applied (path -> policy), and the selectively checkpointed
    paths whose cache had an entry changed in place (backward would raise)."""
    with PlanHandle(model, tuple(checkpointed), policies=checkpointed, keep_caches=True, trim=bitpack,
                    masks=masks) as handle:
        report = audit(model, inputs, trainable=trainable, frozen=frozen, watch=watch, target=target)
        mutated = {path for path, caches in handle.caches.items()
                   if any(mutated_cached(cache) for cache in caches)}
    return report, mutated


def add_selective(chain: Chain, report: Any, audit_with: Callable[[dict[str, str]], Any],
                  held_of: Callable[[Any], int]) -> Optional[str]:
    """Give every block with costly ops the SELECTIVE option: one audit with all of them checkpointed
    selectively says which storages each one's cache holds. Those that are also tensors a block is
    passed or returns are matched to this report's storage ids by position in the call (the same
    calls, in the same order); the others belong to the cache alone. ``held_of``: what an audit
    says the forward holds (with trim, where the plan is). Returns a note when the option cannot be
    modelled exactly (then no block has it)."""
    capable = [b for b in chain.blocks if b.kept_flops]
    selective_report, mutated = audit_with({b.path: SELECTIVE_POLICY for b in capable})
    mine: dict[str, list] = {}
    theirs: dict[str, list] = {}
    for call in report.module_calls:
        mine.setdefault(call.path, []).append(call)
    for call in selective_report.module_calls:
        theirs.setdefault(call.path, []).append(call)
    same: dict[int, int] = {}  # the selective audit's storage id -> this report's
    sizes: dict[int, int] = {}
    for path, calls in mine.items():
        if len(theirs.get(path, ())) != len(calls):
            return "op-level checkpointing left out: the blocks were called differently when checkpointed"
        for call, other in zip(calls, theirs[path]):
            for ours, their in ((call.inputs, other.inputs), (call.outputs, other.outputs)):
                if len(ours) != len(their):
                    return "op-level checkpointing left out: the blocks were passed or returned other tensors"
                for (sid, size, _), (other_sid, _, _) in zip(ours, their):
                    if same.setdefault(other_sid, sid) != sid:
                        return "op-level checkpointing left out: the blocks' tensors could not be matched"
                    sizes[sid] = size
    fresh = max([*chain.nbytes, *same.values(), -1]) + 1
    cached: dict[str, set[int]] = {b.path: set() for b in capable}
    for t in counted(selective_report.tensors):
        node = selective_report.nodes[t.node_id] if t.node_id >= 0 else None
        if node is None or node.name != CHECKPOINT_INPUTS or not t.attr.startswith("cached["):
            continue
        storage = selective_report.storages[t.storage_id]
        if storage.kind not in HELD_KINDS or t.module not in cached:
            continue
        sid = same.get(storage.id)
        if sid is None:
            sid = fresh + storage.id
        chain.nbytes.setdefault(sid, sizes.get(sid, storage.nbytes))
        cached[t.module].add(sid)
    blocks = [dataclasses.replace(b, cached=frozenset(cached[b.path])) if b.path in cached else b
              for b in chain.blocks]
    everything = [i for i, b in enumerate(blocks) if b.cached is not None]
    trial = dataclasses.replace(chain, blocks=blocks)
    if trial.held(everything, everything) != held_of(selective_report):
        return (f"op-level checkpointing left out: its bytes could not be modelled exactly (the chain says "
                f"{trial.held(everything, everything)}, an audit {held_of(selective_report)})")
    # a block whose forward changes a kept output in place (an in-place activation after a matrix
    # product or a batch norm) cannot be checkpointed selectively: backward would raise
    blocks = [dataclasses.replace(b, cached=None) if b.path in mutated else b for b in blocks]
    chain.blocks = blocks
    return None
