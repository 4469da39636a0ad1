"""The steady plan of ``trim``: after a forward decided fully (``session``), the next forwards touch only
the saves it changed.

Each changed save is found again from a forward hook on the module whose call made its node: from
that call's output tensor, a recorded path of ``next_functions`` indices leads to the node. What
the decision rests on is checked on the node found (its type, which inputs need a gradient, the
scalars the op knowledge reads; the pack hooks check the tensor itself: a float, dense, the dtype a
dropout mask was planned for), so a forward that differs from the
planned one (a data-dependent branch, a hook that replaced an output, a module called more or fewer
times) can only leave a save as autograd made it, never change the wrong one. The save is then
handed its own pack and unpack hooks (``SavedTensor.register_hooks``): autograd lets go of the
tensor and keeps what the pack hook returns, the stock op ran forward and the stock node runs
backward, so gradients stay bit-identical. A save whose hooks are set already (inside
``torch.utils.checkpoint``, ``save_on_cpu`` or the user's own ``saved_tensors_hooks``) refuses, and
stays as it is.

Modules and saves the plan does not name cost nothing: they have no hook.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..errors import GradauditError
from ..tensors import iter_tensors
from ..torchapi.autograd import in_backward, node_scalars, node_sequence_number, raw_slot_attribute, sequence_number
from ..torchapi.storages import version_counter
from ..tensors import contiguous_strides
from .codec import (BYTES, FUSED, PACKERS, dense, dropout_mask, scaled_mask, shape_stand_in,
                    unpack_bits)
from .plan import kind_of
from .session import modified_since_saved

# the torch.nn dropout classes whose keep-mask is two-valued by construction (ATen's Dropout.cpp)
STOCK_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


def _refuse_double_backward() -> None:
    if torch.is_grad_enabled() and in_backward():
        # backward(create_graph=True) differentiates the backward formulas themselves, which may
        # read values the first-order backward never reads
        raise GradauditError(
            "gradaudit.trim does not support double backward (create_graph=True): a save it "
            "dropped or bit-packed was read with grad mode on. Remove the trim handle for this model")


class _Kept:
    """A save the pack hook found it could not change (not dense, not exactly two-valued): kept."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _Bits:
    """A bit-packed save (the attributes ``codec.unpack_bits`` reads)."""

    __slots__ = ("payload", "scale", "shape", "stride", "dtype")

    def __init__(self, payload: torch.Tensor, scale: Any, tensor: torch.Tensor) -> None:
        self.payload, self.scale = payload, scale
        self.shape, self.stride, self.dtype = tensor.shape, tensor.stride(), tensor.dtype


def _drop_shape_only(t: torch.Tensor) -> Any:
    # backward reads the shape alone: a zero-stride stand-in where the saved layout is the
    # contiguous one (the kernel's choice of memory format cannot change), else an unfilled one
    if t.stride() == contiguous_strides(t.shape) and t.layout == torch.strided:
        return (t.shape, None, t.dtype, t.device)
    return (t.shape, t.stride(), t.dtype, t.device)


def _drop(t: torch.Tensor) -> Any:
    return (t.shape, t.stride(), t.dtype, t.device)


def _unpack_dropped(saved: tuple) -> torch.Tensor:
    _refuse_double_backward()
    shape, stride, dtype, device = saved
    if stride is None:
        return shape_stand_in(shape, dtype, device)
    # unfilled, in the saved layout (codec.unfilled_strided's one operation, without its record)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _bit_packer(packer: Callable, version: Optional[int] = None) -> Callable[[torch.Tensor], Any]:
    """The pack hook of a bit- or byte-packable save; ``version``: the version the save had in the forward
    that planned it (``_Modified`` where it differs), None for a pack hook that does not check."""
    # a byte packer's comparison is elementwise: on the dense tensor itself its bools come in its own
    # layout (one dispatch fewer to pack, and to unpack: codec.unpack_bytes); bits are packed from the
    # values in memory order
    flat = packer not in _BYTE_PACKERS

    def pack(t: torch.Tensor) -> Any:
        if version is not None and version_counter(t) != version:
            return _Modified(t, version)
        if not (t.is_floating_point() or t.dtype == torch.bool) or t.numel() == 0 or not dense(t):
            return _Kept(t)
        # (grad mode is off here: autograd runs a pack hook set by register_hooks under its own guard)
        found = packer(t.as_strided((t.numel(),), (1,)) if flat else t)
        if found is None:
            return _Kept(t)
        return _Bits(found[0], found[1], t)

    return pack


class _Modified:
    """A save modified in place between the op that saved it and its module's end: kept, and reading
    it raises autograd's error, as a save with no hooks would (autograd checks only those)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor, self.version = tensor, version


def _kept(saved: Any) -> torch.Tensor:
    """The tensor of a save its pack hook kept (``_Kept``, ``_Modified``: autograd's error)."""
    if type(saved) is _Modified:
        raise modified_since_saved(saved.tensor, saved.version)
    return saved.tensor


def _unpack_bits(saved: Any) -> torch.Tensor:
    if type(saved) is not _Bits:
        return _kept(saved)
    _refuse_double_backward()
    return unpack_bits(saved)


def _unpack_fused(saved: Any) -> torch.Tensor:
    if type(saved) is not _Bits:
        return _kept(saved)
    _refuse_double_backward()
    return unpack_bits(saved, fused_kernels=True)


_BYTE_PACKERS = frozenset(BYTES.values())
# one pack function per packer, made once (the steady state's saves share them)
_PACK_BITS = {packer: _bit_packer(packer)
              for packer in [*PACKERS.values(), scaled_mask, *BYTES.values(), *FUSED.values()]}
_FUSED_PACKERS = frozenset(FUSED.values())
# the pack hooks of a checked two-valued mask, and the form each keeps it in
_CHECKED_MASKS = {_PACK_BITS[scaled_mask]: "bits", _PACK_BITS[BYTES[scaled_mask]]: "bytes",
                  _PACK_BITS[FUSED[scaled_mask]]: "fused"}


def _dropout_packer(scale: float, dtype: torch.dtype, form: str, version: int) -> Callable[[torch.Tensor], Any]:
    """The pack hook of a stock dropout module's keep-mask of ``dtype``, whose set value is ``scale``
    (``form``: "bytes", a bool per element; "bits"; "fused", bits packed by one Triton kernel), and
    whose version when saved was ``version`` (``_bit_packer``)."""
    def pack(t: torch.Tensor) -> Any:
        if version_counter(t) != version:
            return _Modified(t, version)
        if t.dtype != dtype or t.numel() == 0 or not dense(t):
            return _Kept(t)
        if form == "bytes":
            return _Bits(t != 0, scale, t)
        flat = t.as_strided((t.numel(),), (1,))
        return _Bits(dropout_mask(flat, scale, fused_kernels=form == "fused"), scale, t)

    return pack


class Slot:
    """One save of a planned node: where it is (``attr``, ``item`` of a saved list or -1) and the
    pack and unpack hooks it gets."""

    __slots__ = ("attr", "item", "pack", "unpack", "dropped", "stat", "box")

    def __init__(self, attr: str, item: int, pack: Callable, unpack: Callable, dropped: bool,
                 box: Any = None) -> None:
        self.attr, self.item, self.pack, self.unpack, self.dropped = attr, item, pack, unpack, dropped
        self.stat = "dropped" if dropped else "bitpacked"  # the handle's count it adds to
        self.box = box  # the full forward's box, while the plan is built


class Entry:
    """A node the plan changes: found from output tensor ``out`` of its module's call by ``path``, and
    changed only where it is still what was decided on (``kind``, ``edges``, ``scalars``; the pack
    hooks check the tensor itself)."""

    __slots__ = ("out", "path", "kind", "edges", "scalars", "slots", "fresh")

    def __init__(self, out: int, path: tuple[int, ...], node: Any, slots: list[Slot],
                 fresh: Optional[float]) -> None:
        self.out, self.path, self.kind = out, path, type(node)
        self.edges = [fn is not None for fn, _ in node.next_functions]
        names = kind_of(node).scalars
        self.scalars = (names, node_scalars(node, names)) if names else None
        self.slots = slots
        # a dropout keep-mask packed with no look at its values: the module's p when it was planned
        # (the mask's value follows from it); the node must have been made by this very call
        # (SteadyPlan._pre notes where the call's nodes start) and the module's p be the same
        self.fresh = fresh

    def check(self, node: Any, start: int) -> Any:
        """The node this entry changes, from the node of its module call's output tensor ``node``, or
        None where what is found is not what was decided on."""
        for i in self.path:
            if node is None:
                return None
            nexts = node.next_functions
            if i >= len(nexts):
                return None
            node = nexts[i][0]
        if type(node) is not self.kind:  # (None too)
            return None
        if [fn is not None for fn, _ in node.next_functions] != self.edges:
            return None
        if self.scalars is not None and node_scalars(node, self.scalars[0]) != self.scalars[1]:
            return None
        if self.fresh is not None and node_sequence_number(node) < start:
            return None
        return node


class SteadyPlan:
    """Per module, per call in a forward, the entries to apply; installed as hooks on those modules."""

    def __init__(self, key: Any, stats: dict[str, int]) -> None:
        self.key = key  # what the decisions depend on (``handle.conditions``), when they were made
        self.modules: dict[int, tuple[weakref.ref, list[list[Entry]]]] = {}
        self.root: list[Entry] = []  # nodes made by the model's own forward, outside any submodule
        self.unreached = 0  # changed nodes no path from their module's output reaches: left alone
        self.handles: list[Any] = []
        self.active = False
        self.counts: dict[int, int] = {}
        self.starts: dict[int, int] = {}
        self.stats = stats  # the handle's counts: "dropped" and "bitpacked" go on in steady forwards

    # -- use ------------------------------------------------------------------------------------
    def install(self) -> None:
        for key, (ref, calls) in self.modules.items():
            module = ref()
            if module is None:
                continue
            if any(e.fresh is not None for entries in calls for e in entries):
                self.handles.append(module.register_forward_pre_hook(self._pre, prepend=True))
            self.handles.append(module.register_forward_hook(self._make_post(calls), prepend=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.active = False

    def begin(self) -> None:
        self.counts.clear()
        self.active = True

    def end(self, output: Any) -> None:
        if self.active and self.root and output is not None:
            self.apply(self.root, output, 0)
        self.active = False

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self.active:
            self.starts[id(module)] = sequence_number()

    def _make_post(self, calls: list[list[Entry]]) -> Callable:
        counts = self.counts

        def post(module: nn.Module, args: Any, output: Any) -> None:
            if not self.active:
                return
            key = id(module)
            index = counts.get(key, 0)
            counts[key] = index + 1
            if index < len(calls) and calls[index]:
                self.apply(calls[index], output, self.starts.get(key, 0), module)

        return post

    def apply(self, entries: list[Entry], output: Any, start: int, module: Optional[nn.Module] = None) -> None:
        single = type(output) is torch.Tensor
        tensors = None
        stats = self.stats
        for entry in entries:
            # (a dropout's p read only for its entry: a missing attribute costs nn.Module's __getattr__ a raise)
            if entry.fresh is not None and entry.fresh != getattr(module, "p", None):
                continue
            if single and entry.out == 0:
                node = output.grad_fn
            else:
                if tensors is None:
                    tensors = [output] if single else list(iter_tensors(output))
                if entry.out >= len(tensors):
                    continue
                t = tensors[entry.out]
                node = t.grad_fn if isinstance(t, torch.Tensor) else None
            node = entry.check(node, start)
            if node is None:
                continue
            for slot in entry.slots:
                raw = getattr(node, slot.attr)
                if slot.item >= 0:
                    raw = raw[slot.item] if slot.item < len(raw) else None
                if raw is None:
                    continue
                try:
                    raw.register_hooks(slot.pack, slot.unpack)
                except RuntimeError:
                    # its hooks are set already (a checkpoint, save_on_cpu, the user's own
                    # saved_tensors_hooks packed it) or it was freed: autograd's, left alone
                    continue
                stats[slot.stat] += 1


def _slot(attr: str, box: Any, dropped: int, packed: int) -> Optional[Slot]:
    """The steady slot for a box in its final state (None: left alone, as a kept box, or a drop
    that frees nothing: an empty tensor, or a storage another save kept whole, ``box.storage``)."""
    if box.state == dropped and (box.shape.numel() == 0 or box.storage is True):
        return None
    name, item = attr, -1
    if attr.endswith("]") and "[" in attr:
        name, item = attr[:attr.index("[")], int(attr[attr.index("[") + 1:-1])
    raw = raw_slot_attribute(name)
    if box.state == dropped:
        return Slot(raw, item, _drop_shape_only if box.zero_stride else _drop, _unpack_dropped, True)
    if box.state == packed and box.packer is not None:
        unpack = _unpack_fused if box.packer in _FUSED_PACKERS else _unpack_bits
        return Slot(raw, item, _PACK_BITS[box.packer], unpack, False, box)
    return None


def _paths(call: Any, wanted: dict[int, Any]) -> dict[int, tuple[int, tuple[int, ...]]]:
    """(output index, path) from ``call``'s output tensors to each node of ``wanted`` (id -> node),
    through nodes the call made (breadth first: the shortest path)."""
    start, end = call.start, call.end
    found: dict[int, tuple[int, tuple[int, ...]]] = {}
    queue = [(i, node, ()) for i, node in enumerate(call.outputs)
             if node is not None and start <= node_sequence_number(node) < end]
    seen: set[int] = set()
    head = 0
    while head < len(queue) and len(found) < len(wanted):
        out, node, path = queue[head]
        head += 1
        if id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in wanted:
            found[id(node)] = (out, path)
        for i, (fn, _) in enumerate(node.next_functions):
            if fn is not None and start <= node_sequence_number(fn) < end and id(fn) not in seen:
                queue.append((out, fn, path + (i,)))
    return found


def build(session: Any, key: Any, dropped: int, packed: int) -> SteadyPlan:
    """The steady plan from a forward ``session`` decided fully, with ``record`` on."""
    plan = SteadyPlan(key, session.stats)
    by_call: dict[int, list[tuple[Any, list[Slot]]]] = {}
    calls = {id(call): call for call in session.calls}
    for node, call, boxes in session.changed:
        slots = [slot for slot in (_slot(attr, box, dropped, packed) for attr, box in boxes)
                 if slot is not None]
        if slots and id(call) in calls:
            by_call.setdefault(id(call), []).append((node, slots))
        elif slots:
            plan.unreached += 1
    model = session.model_ref()
    for call_id, nodes in by_call.items():
        call = calls[call_id]
        found = _paths(call, {id(node): node for node, _ in nodes})
        fresh_allowed = type(call.module) in STOCK_DROPOUTS and "forward" not in vars(call.module)
        entries = []
        for node, slots in nodes:
            where = found.get(id(node))
            if where is None:
                plan.unreached += 1
                continue
            fresh = None
            if fresh_allowed and where[1] == () and any(slot.pack in _CHECKED_MASKS for slot in slots):
                fresh = call.module.p
            # a packed save's pack hook checks its version is the one this forward saw when it was saved
            # (a tensor the forward makes: no parameter, buffer or input is ever packed, so its version
            # counter starts afresh each forward and the same ops bump it alike)
            for slot in slots:
                if fresh is not None and slot.pack in _CHECKED_MASKS:
                    slot.pack = _dropout_packer(slot.box.scale, slot.box.dtype, _CHECKED_MASKS[slot.pack],
                                                slot.box.version)
                elif not slot.dropped:
                    # elsewhere a mask keeps the packer that checks its values
                    slot.pack = _bit_packer(slot.box.packer, slot.box.version)
                slot.box = None
            entries.append(Entry(where[0], where[1], node, slots, fresh))
        if not entries:
            continue
        if call.module is model and call.path == "":
            plan.root.extend(entries)
            continue
        ref, per_call = plan.modules.setdefault(id(call.module), (weakref.ref(call.module), []))
        while len(per_call) <= call.index:
            per_call.append([])
        per_call[call.index].extend(entries)
    return plan
