"""Turn a live Recording into a plain-data Report: verdicts, byte accounting, findings."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from . import rules as _rules  # noqa: F401  (registers the catalogue)
from .knowledge import Declaration, Outcome, declaration, hidden_by
from .accounting import Accountant, counted, module_totals
from .compiled import compiled_reason, static_verdict
from .recorder import Recording
from .records import (
    HELD_KINDS, NOT_NEEDED, UNKNOWN, CheckpointRegion, Finding, GraphNode, Manager, Report, SavedTensor, Severity, Storage,
    StorageKind, ModuleCall,
)
from .rules.registry import Flag, RuleContext, all_rules, selected
from .tensors import ModelTree, dtype_name, first_meta_parameter, itemsize, storage_key, tensor_attributes
from .torchapi.compiler import original_path
from .torchapi.distributed import local_of
from .torchapi.fsdp import fsdp_unsharded_storages
from .torchapi.storages import storage_id, version_counter


class KnownStorages:
    """Storages that are alive anyway: parameters, buffers, the caller's inputs; plus outputs."""

    def __init__(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor],
                 outputs: Sequence[torch.Tensor], attributes_before: set[int] = frozenset(),
                 tree: Optional[ModelTree] = None) -> None:
        tree = tree or ModelTree(model)
        self.kind: dict[int, str] = {}
        # an unregistered tensor kept on a module lives with the module: one that was there before
        # the forward (``self.mask = ...`` in __init__) is like a buffer; one the forward stored
        # (``self.cache = h``) is an activation the module keeps (StorageKind.MODULE)
        self.module_attributes: dict[int, tuple[str, torch.Tensor]] = {}
        attributes = tensor_attributes(model, tree.modules)
        strided = torch.strided
        for path, t in attributes:
            if t.layout == strided:
                key = storage_key(t)
                if key not in attributes_before:
                    self.module_attributes.setdefault(key, (path, t))
        # (sparse and other non-strided tensors have no single storage: not classified)
        kind = self.kind
        for label, tensors in [(StorageKind.OUTPUT, outputs), (StorageKind.INPUT, inputs),
                               (StorageKind.BUFFER, tree.buffers),
                               (StorageKind.BUFFER, [t for _, t in attributes]),
                               (StorageKind.MODULE, [t for _, t in self.module_attributes.values()]),
                               (StorageKind.PARAMETER, [p for _, p in tree.parameters])]:
            for t in tensors:
                if t.layout == strided:
                    kind[storage_key(t)] = label
        # FSDP2's gathered parameters that are not the registered ones now (resharded after the forward)
        self.gathered = fsdp_unsharded_storages(model)
        for key in self.gathered:
            kind.setdefault(key, StorageKind.RESHARDED)

    def kept_on_modules(self) -> tuple[int, list[str]]:
        """Bytes of the storages the forward stored on modules, and where (module.attribute)."""
        return (sum(local_of(t).untyped_storage().nbytes() for _, t in self.module_attributes.values()),
                sorted({path for path, _ in self.module_attributes.values()}))

    def classify(self, key: int) -> str:
        return self.kind.get(key, StorageKind.ACTIVATION)


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
    target: Optional[str] = None,
    tree: Optional[ModelTree] = None,
) -> Report:
    """The Report of one recorded forward. ``target``: the device type the audit stands for
    (default: the device it ran on, CPU for meta). ``tree``: the model's ModelTree as the forward
    left it, when the caller has one (default: one taken here)."""
    tree = tree or ModelTree(model)
    alive = KnownStorages(model, inputs, recording.outputs, recording.attributes_before, tree)
    nodes = _plain_nodes(recording)
    saves = _saved_tensors(recording, nodes, alive)
    tensors, storages = saves.tensors, saves.storages
    _attach_fused_keeps(nodes, recording, saves.storage_ids)
    module_calls = _module_calls(recording, saves, alive)
    _static_verdicts(nodes, tensors, saves.preset)
    disagreements = []
    if verify and prove is not None:
        disagreements = list(prove(recording=recording, nodes=nodes, tensors=tensors,
                                 live_tensors=saves.live_tensors))
    accountant = Accountant(tensors, storages)
    params = {name: p.requires_grad for name, p in tree.parameters}
    classes = {path: type(m).__name__ for path, m in tree.modules}
    # a compiled module's saves are attributed to its original's paths, without _orig_mod
    classes.update({original_path(path): name for path, name in list(classes.items())
                    if "_orig_mod" in path.split(".")})
    ctx = RuleContext(tensors=tensors, nodes=nodes, storages=storages, parameter_names=params,
                      training=model.training, accountant=accountant, measured=dict(measured or {}),
                      module_classes=classes, checkpoints=checkpoint_regions(model, recording, tree))
    findings, scoped = _findings(ctx, accountant, select, ignore)
    # every figure counts the fixes of the (selected) findings
    reclaimable = scoped.freed_by_storage(scoped.not_needed())  # scoped.reclaimable_bytes(), by storage
    kept_bytes, kept_where = alive.kept_on_modules()
    notes = (list(notes) + _unreported(accountant, scoped.scope, ctx.covered, select, ignore)
             + _notes(tensors, disagreements, kept_bytes, kept_where))
    regathered = sum(alive.gathered[key][1] for key, sid in saves.storage_ids.items()
                     if key in alive.gathered and storages[sid].kind == StorageKind.RESHARDED)
    device = _device_of(tree, inputs)
    if target is None:
        target = "cpu" if device == "meta" else torch.device(device).type
    return Report(
        model=type(model).__name__, torch_version=torch.__version__, device=device, target=target,
        training=model.training, verified=bool(verify), tensors=tensors, storages=storages, nodes=nodes,
        modules=module_totals(tensors, storages, scoped, classes, reclaimable), findings=findings,
        saved_bytes=accountant.saved_bytes(), reclaimable_bytes=sum(reclaimable.values()),
        reclaimable_with_bitpacking_bytes=scoped.reclaimable_with_bitpacking_bytes(),
        rewrite_bytes=sum(f.bytes_together for f in findings if f.rewrite and f.severity == Severity.WASTE),
        select=tuple(select), ignore=tuple(ignore),
        recomputed_bytes=sum(t.view_nbytes for t in tensors if t.managed_by == Manager.CHECKPOINT and t.node_id >= 0),
        offloaded_bytes=sum(t.view_nbytes for t in tensors if t.managed_by == Manager.OFFLOAD and t.node_id >= 0),
        kept_on_modules_bytes=kept_bytes,
        parameters_requiring_grad=sum(1 for v in params.values() if v),
        inputs_requiring_grad=sum(1 for t in inputs if t.requires_grad),
        unexplained=blind_spots(tensors, storages), notes=notes, disagreements=disagreements,
        module_calls=module_calls, regathered_bytes=regathered,
    )


def _plain_nodes(recording: Recording) -> list[GraphNode]:
    """The recorded autograd nodes as plain data, in the recording's order."""
    return [
        GraphNode(id=i, name=live.name, module=live.site.module, next_ids=list(live.next_positions),
                  edge_mask=list(live.edge_mask), variable=live.variable, scalars=dict(live.scalars),
                  created_here=live.created_here, attention=live.attention)
        for i, live in enumerate(recording.nodes)
    ]


@dataclass
class _Saves:
    """The recording's saves as plain data (``_saved_tensors``), with what the later steps need."""

    tensors: list[SavedTensor] = field(default_factory=list)
    storages: list[Storage] = field(default_factory=list)
    storage_ids: dict[int, int] = field(default_factory=dict)  # storage key -> this report's storage id
    live_tensors: list[Optional[torch.Tensor]] = field(default_factory=list)  # for the proof, by index
    preset: dict[int, Outcome] = field(default_factory=dict)  # verdicts known from what holds the save


def _saved_tensors(recording: Recording, nodes: list[GraphNode], alive: KnownStorages) -> _Saves:
    """Saved tensors and their storages, in the order autograd saved them; each save is listed on
    its node and its storage."""
    order = [k for _, _, k in sorted([(s.index < 0, s.index, k) for k, s in enumerate(recording.saves)])]
    found = _Saves()
    tensors, storages, storage_ids, preset = found.tensors, found.storages, found.storage_ids, found.preset
    strided, device_names = torch.strided, {}  # device -> str(device): one per device, not per save
    plain = (torch.Tensor, torch.nn.Parameter)
    gathered = recording.gathered
    for k in order:
        save = recording.saves[k]
        t = save.tensor
        if t is not None and type(t) not in plain:
            t = local_of(t)  # a DTensor: what this rank holds is its local shard, of the local shape
        if t is not None and t.layout != strided:
            # a sparse (or other non-strided) save holds several storages: its bytes are unknown
            sid, shape, dtype = -1, tuple(t.shape), t.dtype
            offset, stride, device = 0, (), str(t.device)
        elif t is not None:
            storage = t.untyped_storage()
            key = storage_id(storage)  # storage_key(t)
            sid = storage_ids.get(key)
            if sid is None:
                sid = storage_ids[key] = len(storages)
                storages.append(Storage(id=sid, nbytes=storage.nbytes(), kind=alive.classify(key),
                                        module=save.site.module, gathered_over=gathered.get(key, 0)))
            shape, dtype = tuple(t.shape), t.dtype
            device = t.device
            name = device_names.get(device)
            if name is None:
                name = device_names[device] = str(device)
            offset, stride, device = t.storage_offset(), tuple(t.stride()), name
        else:
            sid, shape, dtype = -1, save.shape or (), save.dtype
            offset, stride, device = 0, (), "unknown"
        numel = math.prod(shape)
        if t is None and save.shape is None:
            numel = 0
        saved = SavedTensor(
            index=len(tensors), node_id=save.node_pos, node=recording.nodes[save.node_pos].name,
            attr=save.attr, shape=shape, dtype=dtype_name(dtype), device=device, numel=numel,
            itemsize=itemsize(dtype), storage_id=sid,
            storage_kind=storages[sid].kind if sid >= 0 else StorageKind.ACTIVATION,
            module=save.site.module, module_class=save.site.module_class, source=save.site.source,
            managed_by=save.managed_by, source_index=save.index, storage_offset=offset, stride=stride,
            copy_of=save.copy_of,
        )
        if save.verdict is not None:
            preset[saved.index] = Outcome(save.verdict, save.reason)
        elif save.origin is not None:
            kind = saved.storage_kind
            itself = kind.value if kind in (StorageKind.PARAMETER, StorageKind.BUFFER, StorageKind.INPUT) else None
            judged = static_verdict(save.origin, isinstance(dtype, torch.dtype) and dtype.is_floating_point)
            if judged is None:
                preset[saved.index] = Outcome(UNKNOWN, compiled_reason(save.origin, itself, save.copy_of))
            else:
                why = compiled_reason(save.origin, itself, save.copy_of, judged.reason)
                preset[saved.index] = dataclasses.replace(judged, reason=why)
        elif save.function is not None and (inner := hidden_by(save.function)):
            # hidden inside CopySlices by an in-place op on a view: the op knowledge of the nodes that
            # op may create says what their backward reads. trim cannot reach such saves (no node lists
            # them), so they get the verdict but are neither dropped nor bit-packed in any figure
            preset.update(_hidden_verdict(saved, save.function, inner))
        if sid >= 0:
            storages[sid].tensors.append(saved.index)
        nodes[save.node_pos].saved.append(saved.index)
        tensors.append(saved)
        found.live_tensors.append(t)
    return found


def _attach_fused_keeps(nodes: list[GraphNode], recording: Recording, storage_ids: dict[int, int]) -> None:
    """What fused attention would keep, in this report's storage ids, on each attention node."""
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


def _module_calls(recording: Recording, saves: _Saves, alive: KnownStorages) -> list[ModuleCall]:
    """The watched modules' calls, the storages they are passed and return in this report's storage
    ids (a storage no save holds gets an id after the saved ones)."""
    others: dict[int, int] = {}
    return [ModuleCall(path, cls, *_call_storages(passed, saves, others, alive), tuple(opaque),
                       _call_storages(returned, saves, others, alive)[0],
                       any(version_counter(t) != v for t, v in zip(passed, versions)))
            for path, cls, passed, opaque, returned, versions in recording.calls]


def _call_storages(tensors: list[torch.Tensor], saves: _Saves, others: dict[int, int],
                   alive: KnownStorages) -> tuple[tuple[tuple[int, int, StorageKind], ...], int]:
    """(storage id, bytes, kind) of each storage among ``tensors``, and how many have no single
    storage (sparse: not counted, but said)."""
    found, uncounted = {}, 0
    for t in tensors:
        if t.layout != torch.strided:
            uncounted += 1
            continue
        t = local_of(t)
        key = storage_key(t)
        sid = saves.storage_ids.get(key)
        if sid is None:
            sid = others.setdefault(key, len(saves.storages) + len(others))
        found[sid] = (sid, t.untyped_storage().nbytes(), alive.classify(key))
    return tuple(found.values()), uncounted


def _static_verdicts(nodes: list[GraphNode], tensors: list[SavedTensor], preset: dict[int, Outcome]) -> None:
    """Each save's verdict from the op knowledge of its node; a save it has none for takes the
    verdict known from what holds it (``preset``)."""
    # an outcome depends on its arguments only, and most saves repeat another's (every ReLU's
    # result): each is worked out once per report
    outcomes: dict[tuple, Any] = {}
    for node in nodes:
        if not node.saved:
            continue
        known = declaration(node.name, node.scalars)
        if known is None:
            continue
        mask = tuple(node.edge_mask)
        for i in node.saved:
            t = tensors[i]
            asked = (id(known), t.attr, mask, t.module_class, t.dtype)
            if asked in outcomes:
                outcome = outcomes[asked]
            else:
                outcome = outcomes[asked] = known.outcome(t.attr, node.edge_mask, t.module_class, t.dtype)
            if outcome is not None:
                t.verdict, t.reason, t.bitpackable = outcome.verdict, outcome.reason, outcome.bitpackable
                t.explained_by = outcome.rule
    for i, outcome in preset.items():
        t = tensors[i]
        if t.verdict == UNKNOWN:
            t.verdict, t.reason = outcome.verdict, outcome.reason
            t.bitpackable = outcome.bitpackable
            if outcome.rule is not None:
                t.explained_by = outcome.rule


def _findings(ctx: RuleContext, accountant: Accountant, select: Sequence[str],
              ignore: Sequence[str]) -> tuple[list[Finding], Accountant]:
    """``run_rules``' findings and scoped accountant; each save names the first finding's code."""
    findings, scoped = run_rules(ctx, accountant, select, ignore)
    for finding in findings:
        for i in finding.tensors:
            if ctx.tensors[i].rule is None:
                ctx.tensors[i].rule = finding.code
    return findings, scoped


def _notes(tensors: list[SavedTensor], disagreements: Sequence[Any], kept_bytes: int,
           kept_where: list[str]) -> list[str]:
    """What the figures leave out: the proof's disagreements, activations kept on modules, and
    saves torch.utils.checkpoint manages."""
    notes = [d.message() for d in disagreements]
    if kept_bytes:
        notes.append(f"{kept_bytes} bytes of activations this forward made are kept "
                     f"on modules as attributes ({', '.join(kept_where[:4])}{', ...' if len(kept_where) > 4 else ''}): "
                     f"the modules hold them, after backward too, so they are not in the held figure "
                     f"(kept_on_modules_bytes) and no fix of autograd's saves frees them")
    if any(t.managed_by == Manager.CHECKPOINT for t in tensors):
        notes.append("some saves are managed by torch.utils.checkpoint: they are recomputed in backward, "
                     "not held, and their sizes are not known without recomputing (gradaudit does not)")
    return notes


def _hidden_verdict(saved: SavedTensor, function: str,
                    inner: Sequence[tuple[Declaration, Sequence[str]]]) -> dict[int, Outcome]:
    """The verdict on a save that an in-place ``function`` on a view hid inside CopySlices, from
    the declarations of the nodes it may hide there. Which node it is (``x[mask] = v`` makes
    IndexPutBackward0 or, on torch 2.15, MaskedFillBackward0) and which of its attributes (``mul_``
    saves self or other, by which factor needs a gradient) is not known, so all of them must give
    one verdict; nor is which of the node's inputs want a gradient, so every edge counts as wanting
    one (which can only make a read needed) and "not needed" is never given. No verdict: an empty
    dict."""
    outcomes = [node.outcome(attr, [True] * max(1, len(node.edges)), saved.module_class, saved.dtype)
                for node, attrs in inner for attr in attrs]
    verdicts = {o.verdict if o is not None else None for o in outcomes}
    if len(verdicts) != 1 or None in verdicts or NOT_NEEDED in verdicts:
        return {}
    named = " or ".join(f"{node.name}.{attr}" for node, attrs in inner for attr in attrs)
    reasons = "; ".join(dict.fromkeys(o.reason for o in outcomes))
    return {saved.index: Outcome(outcomes[0].verdict, f"in-place {function} on a view, hidden inside CopySlices as "
                                                      f"{named}: {reasons} (trim cannot reach it)")}


def _unreported(accountant: Accountant, scope: set[int], covered: set[int], select: Sequence[str],
                ignore: Sequence[str]) -> list[str]:
    """A note for unneeded or bit-packable saves that no rule reports (a gap in the rules, or a
    declaration naming GA000 in a static audit): no figure counts them, since no finding says how
    to free them, but they are not silently lost either."""
    dropped, packed = accountant.all_fixes()
    orphans = {i for i in dropped | packed if i not in covered
               and selected(accountant.tensors[i].explained_by or "GA000", select, ignore)}
    if not orphans:
        return []
    wider = accountant.freed_by_storage(dropped & (scope | orphans), packed & (scope | orphans))
    more = sum(wider.values()) - accountant.freed(dropped & scope, packed & scope)
    if more <= 0:
        return []
    named = sorted({t.explained_by for t in (accountant.tensors[i] for i in orphans)
                    if t.explained_by and t.storage_id in wider})
    return [f"{more} bytes more would be freed by dropping or bit-packing saves no finding reports "
            f"(the op knowledge names {', '.join(named) or 'no rule'} for them): no figure counts them"]


def checkpoint_regions(model: torch.nn.Module, recording: Recording,
                       tree: Optional[ModelTree] = None) -> list[CheckpointRegion]:
    """The recording's checkpoint calls as plain data; a reentrant one lists the trainable
    parameters of the modules that ran inside it (recursively) or that its function names."""
    if not recording.regions:
        return []
    names = {id(p): name for name, p in (tree.parameters if tree is not None else model.named_parameters())}
    regions = []
    for region in recording.regions:
        parameters: set[str] = set()
        if region.reentrant:
            named = [*region.run_modules, *region.closure_modules]
            # the modules that ran inside, whole; of those its function names only their own
            # parameters (a closure over ``self`` must not cover every module) unless none ran
            for paths, recurse in [(region.entered, True), (named, not region.entered)]:
                for path, _ in paths:
                    try:
                        module = model.get_submodule(path)
                    except AttributeError:  # a module replaced during the forward
                        continue
                    parameters.update(names[id(p)] for p in module.parameters(recurse=recurse)
                                      if id(p) in names and p.requires_grad)
        path, cls = region.module
        regions.append(CheckpointRegion(
            reentrant=region.reentrant, node_id=region.node_pos if region.node_pos is not None else -1,
            module=path, module_class=cls, source=region.source, parameters=tuple(sorted(parameters))))
    return regions


def _device_of(tree: ModelTree, inputs: Sequence[torch.Tensor]) -> str:
    # the first meta parameter if any (a model built on meta may keep a stray CPU parameter)
    first = first_meta_parameter(p for _, p in tree.parameters)
    if first is None:
        first = next(iter(inputs), None)
    return str(first.device) if first is not None else "cpu"


def run_rules(ctx: RuleContext, accountant: Accountant, select: Sequence[str] = (),
              ignore: Sequence[str] = ()) -> tuple[list[Finding], Accountant]:
    """Run the rules, keep the selected ones' flags and attach storage-aware bytes to each.
    Returns the findings and the accountant scoped to their fixes (``fix_scope`` of the findings),
    which the report's figures come from.

    Every rule runs, selected or not: the catch-all (GA000) reports only what no rule covered, and
    a save an ignored rule explains is not "unexplained". The byte figures count the selected
    flags' fixes only: a save whose rule is ignored stays as it is, so a storage it shares with a
    selected finding's save is not freed ("all fixes" means all selected fixes).
    """
    flagged: list[tuple[Any, Flag]] = []
    # the catch-all rule (GA000) runs last: it reports what no other rule covered
    for r in sorted(all_rules(), key=lambda r: (r.catch_all, r.code)):
        keep = selected(r.code, select, ignore)
        for flag in r.check(ctx) or ():
            if keep:
                flagged.append((r, flag))
            ctx.covered.update(t.index for t in flag.tensors)
    # a flag with its own bytes is a code change (fused attention, a clone, a detached input): it
    # frees what its rule states, not what dropping or bit-packing its saves would
    scoped = Accountant(ctx.tensors, ctx.storages,
                        {t.index for _, flag in flagged if flag.bytes is None for t in flag.tensors})
    if not flagged:  # nothing to attach bytes to
        return [], scoped
    together = scoped.freed_by_all_fixes()
    unselected = None  # every save's fix, selected or not: accountant.freed_by_all_fixes(), when asked
    shares = _shares(ctx, flagged, together)
    findings: list[Finding] = []
    for k, (r, flag) in enumerate(flagged):
        indices = {t.index for t in flag.tensors}
        alone = accountant.freed(*accountant.fixes_of(indices))
        first = flag.tensors[0] if flag.tensors else None
        node = flag.node
        severity, message = flag.severity or r.severity, flag.message
        freed = flag.bytes if flag.bytes is not None else alone
        sids = {ctx.tensors[i].storage_id for i in indices}
        if severity == Severity.WASTE and freed == 0 and not sids & together.keys():
            # True, but no combination of the selected fixes frees a byte of it: keep it visible as
            # information, never as waste that fails a check.
            severity = Severity.INFO
            if unselected is None:
                unselected = accountant.freed_by_all_fixes()
            if sids & unselected.keys():
                message += ("; nothing would be freed by the selected rules: a save of a rule not selected "
                            "(select/ignore) shares its storage")
            else:
                message += "; nothing would be freed: a save that backward needs shares its storage"
        findings.append(Finding(
            code=r.code, name=r.name, severity=severity, message=message,
            module=flag.module if flag.module is not None else (first.module if first else (node.module if node else "")),
            module_class=flag.module_class if flag.module_class is not None else (first.module_class if first else ""),
            node=node.name if node else "", attrs=tuple(t.attr for t in flag.tensors),
            source=flag.source if flag.source is not None else (first.source if first else None),
            tensors=tuple(sorted(indices)),
            bytes=freed, bytes_together=shares[k],
            fix=flag.fix or r.fix, fix_code=flag.fix_code or r.fix_code,
            fix_safe=r.fix_safe, proven=bool(flag.tensors) and all(t.proven for t in flag.tensors),
            rewrite=flag.bytes is not None,
        ))
    return findings, scoped


def _shares(ctx: RuleContext, flagged: list[tuple[Any, Flag]], together: dict[int, int]) -> list[int]:
    """Each flag's share of the bytes every selected fix frees together; the shares add up to it.

    A storage freed by dropping or bit-packing is shared equally by the flags that name one of its
    saves (the first, in rule order, takes the remainder of the division): freeing it takes all of
    their fixes (a max-pool's unneeded input is the ReLU's result, freed only when the ReLU's save
    is bit-packed too), so none of them shows 0 bytes of a storage it helps free. A code change (a flag with its own ``bytes``) adds what it states minus what
    the storages it names already count, biggest first, so no storage is counted twice.
    """
    shares = [0] * len(flagged)
    counted_bytes: dict[int, int] = {}
    naming: dict[int, list[int]] = {}  # storage id -> the flags that name one of its saves, in order
    for k, (_, flag) in enumerate(flagged):
        if flag.bytes is not None:
            continue
        for sid in sorted({t.storage_id for t in flag.tensors}):
            if sid in together:
                naming.setdefault(sid, []).append(k)
    for sid, ks in naming.items():
        counted_bytes[sid] = together[sid]
        part, remainder = divmod(together[sid], len(ks))
        for position, k in enumerate(ks):
            shares[k] += part + (remainder if position == 0 else 0)
    rewrites = [k for k, (r, flag) in enumerate(flagged)
                if flag.bytes is not None and (flag.severity or r.severity) == Severity.WASTE]
    for k in sorted(rewrites, key=lambda k: -flagged[k][1].bytes):
        sids = {t.storage_id for t in flagged[k][1].tensors if t.storage_id >= 0}
        shares[k] = max(0, flagged[k][1].bytes - sum(counted_bytes.get(sid, 0) for sid in sids))
        for sid in sids:
            counted_bytes[sid] = ctx.storages[sid].nbytes
    return shares


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
