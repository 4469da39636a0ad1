"""Turn a live Recording into a plain-data Report: verdicts, byte accounting, findings."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import torch

from . import rules as _rules  # noqa: F401  (registers the catalogue)
from .knowledge import declaration
from .accounting import Accountant, counted, module_totals
from .recorder import Recording
from .records import (
    HELD_KINDS, UNKNOWN, Finding, GraphNode, Manager, Report, SavedTensor, Severity, Storage, StorageKind,
)
from .rules.registry import Flag, RuleContext, all_rules, selected
from .tensors import dtype_name, itemsize, storage_key


class KnownStorages:
    """Storages that are alive anyway: parameters, buffers, the caller's inputs; plus outputs."""

    def __init__(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor],
                 outputs: Sequence[torch.Tensor]) -> None:
        self.kind: dict[int, str] = {}
        # (sparse and other non-strided tensors have no single storage: not classified)
        for kind, tensors in [(StorageKind.OUTPUT, outputs), (StorageKind.INPUT, inputs),
                              (StorageKind.BUFFER, model.buffers()),
                              # an unregistered tensor kept on a module (``self.mask = ...``) lives
                              # with the module like a buffer: saving it costs autograd nothing
                              (StorageKind.BUFFER, _tensor_attributes(model)),
                              (StorageKind.PARAMETER, model.parameters())]:
            for t in tensors:
                if t.layout == torch.strided:
                    self.kind[storage_key(t)] = kind

    def classify(self, key: int) -> str:
        return self.kind.get(key, StorageKind.ACTIVATION)


def _tensor_attributes(model: torch.nn.Module) -> list[torch.Tensor]:
    """Plain tensor attributes of the model's modules (also inside a list, tuple or dict)."""
    found = []
    for module in model.modules():
        for name, value in vars(module).items():
            if name in ("_parameters", "_buffers"):
                continue
            if isinstance(value, dict):
                value = list(value.values())
            items = value if isinstance(value, (list, tuple)) else (value,)
            found.extend(v for v in items if isinstance(v, torch.Tensor))
    return found


def build_report(
    model: torch.nn.Module,
    recording: Recording,
    *,
    inputs: Sequence[torch.Tensor],
    verify: bool = False,
    select: Sequence[str] = (),
    ignore: Sequence[str] = (),
    prove: Optional[Callable[..., Any]] = None,
    notes: Sequence[str] = (),
    measured: Optional[dict[str, int]] = None,
) -> Report:
    known = KnownStorages(model, inputs, recording.outputs)

    # -- plain-data nodes ---------------------------------------------------------------------
    nodes = [
        GraphNode(id=i, name=live.name, module=live.site.module, next_ids=list(live.next_positions),
                  edge_mask=list(live.edge_mask), variable=live.variable, scalars=dict(live.scalars),
                  created_here=live.created_here, attention=live.attention)
        for i, live in enumerate(recording.nodes)
    ]

    # -- saved tensors and storages, in the order autograd saved them -------------------------
    order = sorted(range(len(recording.saves)),
                   key=lambda k: (recording.saves[k].index < 0, recording.saves[k].index, k))
    tensors: list[SavedTensor] = []
    storages: list[Storage] = []
    storage_ids: dict[int, int] = {}
    live_tensors: list[Optional[torch.Tensor]] = []
    for k in order:
        save = recording.saves[k]
        t = save.tensor
        if t is not None and t.layout != torch.strided:
            # a sparse (or other non-strided) save holds several storages: its bytes are unknown
            sid, shape, dtype = -1, tuple(t.shape), t.dtype
            offset, stride, device = 0, (), str(t.device)
        elif t is not None:
            key = storage_key(t)
            sid = storage_ids.get(key)
            if sid is None:
                sid = storage_ids[key] = len(storages)
                storages.append(Storage(id=sid, nbytes=t.untyped_storage().nbytes(),
                                        kind=known.classify(key), module=save.site.module))
            shape, dtype = tuple(t.shape), t.dtype
            offset, stride, device = t.storage_offset(), tuple(t.stride()), str(t.device)
        else:
            sid, shape, dtype = -1, save.shape or (), save.dtype
            offset, stride, device = 0, (), "unknown"
        numel = 1
        for d in shape:
            numel *= d
        if t is None and save.shape is None:
            numel = 0
        saved = SavedTensor(
            index=len(tensors), node_id=save.node_pos, node=recording.nodes[save.node_pos].name,
            attr=save.attr, shape=shape, dtype=dtype_name(dtype), device=device, numel=numel,
            itemsize=itemsize(dtype), storage_id=sid,
            storage_kind=storages[sid].kind if sid >= 0 else StorageKind.ACTIVATION,
            module=save.site.module, module_class=save.site.module_class, source=save.site.source,
            managed_by=save.managed_by, source_index=save.index, storage_offset=offset, stride=stride,
        )
        if sid >= 0:
            storages[sid].tensors.append(saved.index)
        nodes[save.node_pos].saved.append(saved.index)
        tensors.append(saved)
        live_tensors.append(t)

    # -- what fused attention would keep, in this report's storage ids ---------------------------
    calls: dict[int, Any] = {}
    for node in nodes:
        call = node.attention
        if call is None:
            continue
        if call.index not in calls:
            keeps = tuple((storage_ids.get(ref.cdata, -1) if not ref.expired() else -1, nbytes)
                          for ref, nbytes in recording.attention_tensors[call.index])
            calls[call.index] = dataclasses.replace(call, fused_keeps=keeps)
        node.attention = calls[call.index]

    # -- verdicts from op knowledge -----------------------------------------------------------
    for node in nodes:
        if not node.saved:
            continue
        known = declaration(node.name, node.scalars)
        if known is None:
            continue
        for i in node.saved:
            t = tensors[i]
            outcome = known.outcome(t.attr, node.edge_mask, t.module_class, t.dtype)
            if outcome is not None:
                t.verdict, t.reason, t.bitpackable = outcome.verdict, outcome.reason, outcome.bitpackable
                t.explained_by = outcome.rule

    disagreements = []
    if verify and prove is not None:
        disagreements = list(prove(recording=recording, nodes=nodes, tensors=tensors,
                                 live_tensors=live_tensors))

    # -- accounting -----------------------------------------------------------------------------
    accountant = Accountant(tensors, storages)
    classes = {path: type(m).__name__ for path, m in model.named_modules()}
    modules = module_totals(tensors, storages, accountant, classes)

    # -- findings -------------------------------------------------------------------------------
    params = {name: p.requires_grad for name, p in model.named_parameters()}
    ctx = RuleContext(tensors=tensors, nodes=nodes, storages=storages, parameter_names=params,
                      training=model.training, accountant=accountant, measured=dict(measured or {}))
    findings = run_rules(ctx, accountant, select, ignore)
    for finding in findings:
        for i in finding.tensors:
            if tensors[i].rule is None:
                tensors[i].rule = finding.code

    unexplained = blind_spots(tensors, storages)
    offloaded = sum(t.view_nbytes for t in tensors if t.managed_by == Manager.OFFLOAD and t.node_id >= 0)
    recomputed = sum(t.view_nbytes for t in tensors if t.managed_by == Manager.CHECKPOINT and t.node_id >= 0)
    notes = list(notes) + [d.message() for d in disagreements]
    if any(t.managed_by == Manager.CHECKPOINT for t in tensors):
        notes.append("some saves are managed by torch.utils.checkpoint: they are recomputed in backward, "
                     "not held, and their sizes are not known without recomputing (gradaudit does not)")
    return Report(
        model=type(model).__name__, torch_version=torch.__version__, device=_device_of(model, inputs),
        training=model.training, verified=bool(verify), tensors=tensors, storages=storages, nodes=nodes,
        modules=modules, findings=findings, saved_bytes=accountant.saved_bytes(),
        reclaimable_bytes=accountant.reclaimable_bytes(),
        reclaimable_with_bitpacking_bytes=accountant.reclaimable_with_bitpacking_bytes(),
        recomputed_bytes=recomputed, offloaded_bytes=offloaded,
        parameters_requiring_grad=sum(1 for v in params.values() if v),
        inputs_requiring_grad=sum(1 for t in inputs if t.requires_grad),
        unexplained=unexplained, notes=notes, disagreements=disagreements,
    )


def _device_of(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> str:
    for t in list(model.parameters())[:1] + list(inputs)[:1]:
        return str(t.device)
    return "cpu"


def run_rules(ctx: RuleContext, accountant: Accountant, select: Sequence[str] = (),
              ignore: Sequence[str] = ()) -> list[Finding]:
    """Run every selected rule; attach storage-aware bytes to each flag."""
    flagged: list[tuple[Any, Flag]] = []
    # the catch-all rule (GA000) runs last: it reports what no other rule covered
    for r in sorted(all_rules(), key=lambda r: (r.catch_all, r.code)):
        if not selected(r.code, select, ignore):
            continue
        for flag in r.check(ctx) or ():
            flagged.append((r, flag))
            ctx.covered.update(t.index for t in flag.tensors)
    together = accountant.freed_by_all_fixes()
    claimed: set[int] = set()
    findings: list[Finding] = []
    for r, flag in flagged:
        indices = {t.index for t in flag.tensors}
        alone = accountant.freed(*accountant.fixes_of(indices))
        share = 0
        for sid in {ctx.tensors[i].storage_id for i in indices}:
            if sid in together and sid not in claimed:
                claimed.add(sid)
                share += together[sid]
        first = flag.tensors[0] if flag.tensors else None
        node = flag.node
        severity, message = flag.severity or r.severity, flag.message
        freed = flag.bytes if flag.bytes is not None else alone
        contributes = any(ctx.tensors[i].storage_id in together for i in indices)
        if severity == Severity.WASTE and freed == 0 and not contributes:
            # True, but no combination of fixes frees a byte of it (a needed save shares the
            # storage): keep it visible as information, never as waste that fails a check.
            severity = Severity.INFO
            message += "; nothing would be freed: a save that backward needs shares its storage"
        findings.append(Finding(
            code=r.code, name=r.name, severity=severity, message=message,
            module=flag.module if flag.module is not None else (first.module if first else (node.module if node else "")),
            module_class=first.module_class if first else "",
            node=node.name if node else "", attrs=tuple(t.attr for t in flag.tensors),
            source=first.source if first else None, tensors=tuple(sorted(indices)),
            bytes=freed, bytes_together=share, fix=flag.fix or r.fix, fix_code=flag.fix_code or r.fix_code,
            fix_safe=r.fix_safe, proven=bool(flag.tensors) and all(t.proven for t in flag.tensors),
        ))
    return findings


def blind_spots(tensors: list[SavedTensor], storages: list[Storage]) -> list[dict[str, Any]]:
    """Node types whose held saves no rule understood: the tool's own blind spots."""
    groups: dict[str, dict[str, Any]] = defaultdict(lambda: {"tensors": 0, "view_bytes": 0, "attrs": set()})
    for t in counted(tensors):
        if t.verdict != UNKNOWN or storages[t.storage_id].kind not in HELD_KINDS:
            continue
        g = groups[t.node]
        g["tensors"] += 1
        g["view_bytes"] += t.view_nbytes
        g["attrs"].add(t.attr)
    return [{"node": name, "tensors": g["tensors"], "view_bytes": g["view_bytes"], "attrs": sorted(g["attrs"])}
            for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["view_bytes"])]
