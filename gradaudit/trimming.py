"""``gradaudit.trim(model)``: while installed, each forward keeps only what backward can need.

Mechanism: during the model's forward, a saved-tensors hook boxes every save and a node-creation
hook lists the new autograd nodes. At every module boundary (Python level, no op in flight) the
nodes created since the last boundary are decided with the static op knowledge of
``gradaudit/rules/ops.py`` and their boxes rewritten:

- not needed: the box forgets the tensor. Backward gets an unfilled tensor of the same shape, dtype,
  device and strides, made when it reads them (a zero-stride ``torch.zeros(()).expand(shape)`` where
  only the shape is read, see _SHAPE_ONLY);
- one bit per element is enough (when ``bitpack``; ReLU results, dropout masks, see _PACKERS): the
  box keeps the bits and backward gets a tensor with the saved strides on which the op's backward
  computes exactly what it did before. Such a save waits one module boundary first: when the next
  op keeps the same tensor anyway (a trainable conv after a ReLU), packing would free nothing;
- otherwise the box keeps the tensor.

Deciding as the forward proceeds lowers the peak, not only what is held after the forward.
Saves packed by anybody else's hooks (``torch.utils.checkpoint``, ``save_on_cpu``, the user's
own ``saved_tensors_hooks`` inside the model) are never touched.
"""

from __future__ import annotations

import functools
import gc
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from . import rules as _rules  # noqa: F401  (registers the op knowledge)
from .auditing import ModelState, iter_tensors, split_inputs, unique
from .errors import GradauditError
from .measure import StorageTracker, storage_span
from .recorder import _names_of, _raw_saved_slots, node_scalars
from .records import NOT_NEEDED, GraphNode, SavedTensor
from .rules.registry import op_knowledge, op_scalars

try:
    import numpy
except ImportError:  # torch runs without numpy; bit-packing then uses torch ops only
    numpy = None

__all__ = ["trim", "TrimHandle", "compare"]

# Saves that one bit per element can stand for. A packer takes the saved values (in memory order)
# and returns (packed bits, value a set bit stands for; 0 elsewhere), or None when the values do
# not fit that form. Each is written so the unpacked tensor gives the backward the same results:
#   threshold_backward(grad, x, 0): x <= 0 ? 0 : grad   (ReLU result, Threshold with threshold 0)
#   leaky_relu_backward(grad, x, slope): x > 0 ? grad : grad * slope
# so the bit is that comparison itself (NaN, -0.0 included) and the unpacked value 1.0 or 0.0;
#   dropout (a multiplication by a mask of 0 and 1/(1-p)): grad * mask
# so the mask must be reproduced exactly: checked to hold only +0.0 and one positive value.


# numpy's elementwise comparisons run several times faster than torch's on CPU at these sizes
# (same IEEE comparisons: NaN and -0.0 give the same answers); what they write is still allocated
# by torch, so storage trackers see it
_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64})

# Elements compared per chunk: the chunk's bool mask (256 KiB) stays in cache between the
# comparison that writes it and the packing that reads it. A multiple of 8, so that every chunk
# starts on a byte of the packed bits.
_CHUNK = 1 << 18


def _numpy_ok(values: torch.Tensor) -> bool:
    return (numpy is not None and type(values) is torch.Tensor and values.device.type == "cpu"
            and values.dtype in _NUMPY_DTYPES)


def _compare_and_pack(values: torch.Tensor, compare: Any, inverted: bool) -> torch.Tensor:
    """Bits of ``compare(values, 0)`` (their complement when ``inverted``), chunk by chunk."""
    count = values.numel()
    packed = torch.empty(((count + 7) // 8,), dtype=torch.uint8)
    scratch = torch.empty((min(count, _CHUNK),), dtype=torch.bool)
    source, out, mask = values.numpy(), packed.numpy(), scratch.numpy()
    for start in range(0, count, _CHUNK):
        stop = min(count, start + _CHUNK)
        chunk = mask[:stop - start]
        compare(source[start:stop], 0, out=chunk)
        out[start // 8:(stop + 7) // 8] = numpy.packbits(chunk, bitorder="little")
    if inverted:
        numpy.invert(out, out=out)  # the padding bits become 1: never read (see _unpack_bits)
    return packed


def _passes_unless_le_zero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    # the bit is not(x <= 0) (NaN passes, as in threshold_backward): x <= 0 is packed and the
    # bytes flipped, one pass fewer than negating the mask
    if _numpy_ok(values):
        return _compare_and_pack(values, numpy.less_equal, inverted=True), 1.0
    return _pack_bits(values <= 0, inverted=True), 1.0


def _passes_if_gt_zero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    if _numpy_ok(values):
        return _compare_and_pack(values, numpy.greater, inverted=False), 1.0
    return _pack_bits(values > 0), 1.0


def _scaled_mask(values: torch.Tensor) -> Optional[tuple[torch.Tensor, float]]:
    if values.numel() == 0:
        return None
    scale = values.max()
    bits = values == scale
    exact = bool(torch.logical_or(bits, values == 0).all()) and not bool(torch.signbit(values).any())
    if not exact or not bool(scale > 0):
        return None
    return _pack_bits(bits), scale.item()


_Packer = Callable[[torch.Tensor], Optional[tuple[torch.Tensor, float]]]
_PACKERS: dict[tuple[str, str], _Packer] = {
    ("ReluBackward0", "result"): _passes_unless_le_zero,
    ("ThresholdBackward0", "self"): _passes_unless_le_zero,
    ("LeakyReluBackward0", "self"): _passes_if_gt_zero,
    ("MulBackward0", "other"): _scaled_mask,
}

_KEPT, _DROPPED, _PACKED = 0, 1, 2

# Saves backward reads only for their shape and memory format: a zero-stride placeholder suffices
# when the saved tensor had the standard layout (a zero-stride tensor suggests that format too).
# Every other dropped save gets, when backward reads it, a zero-filled tensor with the saved
# strides: CPU batch norm, for one, picks its reduction order from the input's contiguity, so a
# zero-stride input changes the bias gradient's last bit.
_SHAPE_ONLY = {
    ("MaxPool1DWithIndicesBackward0", "self"),
    ("MaxPool2DWithIndicesBackward0", "self"),
    ("MaxPool3DWithIndicesBackward0", "self"),
}


class _Box:
    """What autograd stores instead of a saved tensor while a model is trimmed."""

    __slots__ = ("session", "state", "payload", "shape", "dtype", "device", "version", "stride",
                 "offset", "scale", "zero_stride", "outer_unpack", "__weakref__")

    def __init__(self, session: Optional["_Session"], payload: Any, tensor: torch.Tensor,
                 outer_unpack: Optional[Callable[[Any], Any]]) -> None:
        self.session = session
        self.state = _KEPT
        self.payload = payload  # the tensor, the outer hook's packed object, or the packed bits
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.version = tensor._version
        # read when the box is dropped or packed (the tensor is still at hand then), except behind
        # an outer hook, whose packed object is not the tensor
        self.stride: tuple[int, ...] = () if outer_unpack is None or session is None else tensor.stride()
        self.offset = 0
        self.zero_stride = False  # dropped: a zero-stride placeholder is enough
        self.scale = 1.0  # bit-packed: the value a set bit stands for
        self.outer_unpack = outer_unpack


def _unpack(box: _Box) -> torch.Tensor:
    if box.state == _KEPT:
        return box.payload if box.outer_unpack is None else box.outer_unpack(box.payload)
    if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
        # backward(create_graph=True) differentiates the backward formulas themselves, which may
        # read values the first-order backward never reads
        raise GradauditError(
            "gradaudit.trim does not support double backward (create_graph=True): a save it "
            "dropped or bit-packed was read with grad mode on. Remove the trim handle for this model")
    if box.state == _DROPPED:
        if box.zero_stride:
            return torch.zeros((), dtype=box.dtype, device=box.device).expand(box.shape)
        return _unfilled_strided(box)
    return _unpack_bits(box)


def _pack_bits(mask: torch.Tensor, inverted: bool = False) -> torch.Tensor:
    """1-D bool -> uint8: bit i of byte k is element 8k+i (``inverted``: its complement).

    The packed bytes are allocated by torch, so storage trackers see them.
    """
    count = mask.numel()
    packed = torch.empty(((count + 7) // 8,), dtype=torch.uint8, device=mask.device)
    if mask.device.type == "cpu" and numpy is not None:
        # numpy's packbits is one C loop; the torch expression below takes several passes
        out = packed.numpy()
        out[:] = numpy.packbits(mask.numpy(), bitorder="little")
        if inverted:
            numpy.invert(out, out=out)  # the padding bits become 1: never read (see _unpack_bits)
        return packed
    padded = torch.zeros((packed.numel() * 8,), dtype=torch.uint8, device=mask.device)
    padded[:count] = mask.view(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    torch.sum(padded.view(-1, 8) * weights, dim=1, dtype=torch.uint8, out=packed)
    return packed.bitwise_not_() if inverted else packed


_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _bit_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Row b holds the 8 values (1.0 / 0.0) that byte b unpacks to, lowest bit first."""
    table = _TABLES.get((dtype, device))
    if table is None:
        byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        bits = (byte >> torch.arange(8, dtype=torch.int32)) & 1
        table = _TABLES[(dtype, device)] = bits.to(dtype=dtype, device=device)
    return table


def _unpack_bits(box: _Box) -> torch.Tensor:
    # one gather from a 256-row table writes the values directly: the fewest passes over memory
    packed = box.payload
    table = _bit_table(box.dtype, packed.device)
    if box.scale != 1.0:
        table = table * box.scale  # exact: 1.0 * scale and 0.0 * scale (scale > 0)
    if numpy is not None and type(packed) is torch.Tensor and packed.device.type == "cpu" \
            and box.dtype in _NUMPY_DTYPES:
        # numpy's take (every index is in range: mode="clip" skips its bounds buffer) is about
        # twice as fast as index_select; the values are allocated by torch
        values = torch.empty((packed.numel() * 8,), dtype=box.dtype)
        numpy.take(table.numpy(), packed.numpy(), axis=0, out=values.numpy().reshape(-1, 8), mode="clip")
    else:
        values = torch.index_select(table, 0, packed.int())
    # the bits were taken in memory order from a dense tensor: the saved strides put every value
    # back in place, and a kernel's choice of memory format (and so of algorithm) cannot change
    return values.as_strided(box.shape, box.stride)


_EMPTIES: dict[Any, torch.Tensor] = {}


def _unfilled_strided(box: _Box) -> torch.Tensor:
    """An unfilled tensor with the saved tensor's shape and strides (overlapping strides included)."""
    if box.shape.numel() == 0:
        # no element can be read or written: one tensor per layout serves every such save (eval-mode
        # batch norm saves two of them per layer)
        key = (box.shape, box.stride, box.dtype, box.device)
        empty = _EMPTIES.get(key)
        if empty is None:
            empty = torch.empty_strided(box.shape, box.stride, dtype=box.dtype, device=box.device)
            if len(_EMPTIES) < 256:
                _EMPTIES[key] = empty
        return empty
    span = storage_span(box.shape, box.stride)
    # Never filled: backward does not read these values (the op knowledge says so, verify=True
    # proves it, and the bit-identity tests would catch a read). Unfilled memory costs no pass over
    # it, and the pages of a large allocation that nobody touches are never even committed.
    return torch.empty((span,), dtype=box.dtype, device=box.device).as_strided(box.shape, box.stride)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive memory slots (dense, no overlap)."""
    if t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)):
        return True
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -d))
    return t.permute(order).is_contiguous()


class _PackedUse:
    """The bit boxes of one storage during one forward (the storage may be freed meanwhile:
    its weak reference tells a reused address from the original)."""

    __slots__ = ("ref", "boxes")

    def __init__(self, ref: StorageWeakRef) -> None:
        self.ref = ref
        self.boxes: list[weakref.ref] = []


class _Session:
    """Trimming state for one model; active between the root's forward pre-hook and forward hook."""

    def __init__(self, model: nn.Module, bitpack: bool) -> None:
        self.model_ref = weakref.ref(model)
        self.bitpack = bitpack
        self.active = False
        self.depth = 0
        self.pending: list[tuple[Any, tuple[str, str]]] = []  # (node, module) since the last boundary
        self.stack: list[tuple[str, str]] = [("", type(model).__name__)]  # (path, class) running now
        self.waiting: list[tuple[_Box, Callable]] = []  # saves to bit-pack at the next boundary
        self.protected: set[int] = set()  # storages alive anyway (parameters, buffers, inputs)
        self.alive_anyway: Optional[list[torch.Tensor]] = None  # parameters and buffers
        # storage -> a box keeping a save of it (alive box: alive storage, so the address is
        # not reused) and storage -> its bit boxes; bit-packing a kept storage frees nothing
        self.kept: dict[int, weakref.ref] = {}
        self.packed: dict[int, _PackedUse] = {}
        self.outer: Optional[tuple[Callable, Callable]] = None
        self.hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self.stats = {"kept": 0, "dropped": 0, "bitpacked": 0, "unpacked_again": 0}

    # -- hooks during the forward ---------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> _Box:
        # Sparse and other non-strided saves have no placeholder and no bits: kept as they are,
        # in a box of no session, which no decision looks at
        owner = self
        if tensor.layout != torch.strided:
            owner = None
            self.stats["kept"] += 1
        if self.outer is not None:
            return _Box(owner, self.outer[0](tensor), tensor, self.outer[1])
        return _Box(owner, tensor, tensor, None)

    def on_node(self, node: Any) -> None:
        self.pending.append((node, self.stack[-1]))

    def begin(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.active:
            self.depth += 1  # the model calls itself; the outer call's session covers it
            return
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        if not torch._C._autograd._saved_tensors_hooks_is_enabled():
            raise GradauditError(
                "gradaudit.trim cannot work here: saved-tensor hooks are disabled around this forward "
                "(torch.compile and some distributed wrappers do this). Remove the trim handle")
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if top is not None:
            owner = getattr(top[0], "__self__", None)
            home = getattr(top[0], "__module__", "") or ""
            if isinstance(owner, _Session) or home.startswith("gradaudit.") or \
                    home.startswith("torch.utils.checkpoint"):
                # another trim session covers this forward, gradaudit is auditing it, or
                # checkpoint holds nothing here and needs every pack it counted
                return
            self.outer = top
        else:
            self.outer = None
        if self.alive_anyway is None:
            # walking the module tree costs more than the storage look-ups: do it once. A parameter
            # replaced later is only treated like an activation (its unneeded saves dropped)
            self.alive_anyway = [*module.parameters(), *module.buffers()]
        self.protected = {t.untyped_storage()._cdata for t in [*self.alive_anyway, *iter_tensors((args, kwargs))]}
        self.kept = {}
        self.packed = {}
        self.pending = []
        self.waiting = []
        self.stack = self.stack[:1]
        self.active = True
        self.depth = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)
        self.hooks.__enter__()
        torch._C._autograd._push_node_creation_hook(self.on_node)

    def end(self) -> None:
        if not self.active:
            return
        if self.depth:
            self.depth -= 1
            return
        try:
            self.step(final=True)
        finally:
            self.active = False
            torch._C._autograd._pop_node_creation_hook()
            hooks, self.hooks = self.hooks, None
            hooks.__exit__(None, None, None)
            self.kept = {}
            self.packed = {}
            self.protected = set()
            self.pending = []
            self.waiting = []
            self.outer = None

    def enter(self, entry: tuple[str, str], *unused: Any) -> None:
        if self.active:
            if self.pending:
                self.step()
            self.stack.append(entry)

    def leave(self, *unused: Any) -> None:
        if self.active:
            if self.pending:
                self.step()
            if len(self.stack) > 1:
                self.stack.pop()

    # -- decisions ------------------------------------------------------------------------------
    def step(self, final: bool = False) -> None:
        nodes, self.pending = self.pending, []
        waiting, self.waiting = self.waiting, []
        if not nodes and not final:
            self.waiting = waiting
            return
        for node, module in nodes:
            self.decide(node, module)
        # Bit-packable saves wait one boundary before they are packed: the op that consumes
        # a ReLU result usually runs next, and when it keeps the tensor, packing would only
        # have cost time (the bits would be given back)
        if final:
            waiting, self.waiting = waiting + self.waiting, []
        if waiting:
            with torch.no_grad():
                for box, packer in waiting:
                    if self.packable(box):
                        self.pack_bits(box, packer)
                    else:
                        self.keep(box)

    def decide(self, node: Any, module: tuple[str, str]) -> None:
        kind = _KINDS.get(type(node)) or _kind_of(node)
        boxes = []
        if kind.slots is None:
            slots = _raw_saved_slots(node)
        else:
            slots = []
            for attr, getter in kind.slots:
                raw = getattr(node, getter)
                if raw is None:
                    continue
                if type(raw) is list or type(raw) is tuple:
                    slots.extend((f"{attr}[{i}]", item) for i, item in enumerate(raw) if item is not None)
                else:
                    slots.append((attr, raw))
        for attr, raw in slots:
            box = raw.data
            if type(box) is _Box and box.session is self:
                boxes.append((attr, box))
        if not boxes:
            return
        if kind.knowledge is None:
            for _, box in boxes:
                self.keep(box)
            return
        for (attr, box), action in zip(boxes, _plan(kind, node, module, boxes)):
            if action is _KEEP_ACTION:
                self.keep(box)
            elif type(action) is bool:  # dropped; True: a zero-stride placeholder may do
                if not self.droppable(box):
                    self.keep(box)
                    continue
                if box.outer_unpack is None:
                    box.stride = box.payload.stride()
                box.zero_stride = action and box.stride == _contiguous_strides(box.shape)
                box.payload, box.state = None, _DROPPED
                self.stats["dropped"] += 1
            elif self.packable(box):
                self.waiting.append((box, action))
            else:
                self.keep(box)

    def droppable(self, box: _Box) -> bool:
        if box.outer_unpack is not None:
            return True
        # parameters, buffers and inputs are alive anyway: replacing their saves frees nothing
        return box.payload.untyped_storage()._cdata not in self.protected

    def packable(self, box: _Box) -> bool:
        if not self.bitpack or box.outer_unpack is not None:
            return False
        tensor = box.payload
        if not tensor.is_floating_point() or tensor._version != box.version:
            return False  # modified in place since it was saved: leave it as autograd would
        key = tensor.untyped_storage()._cdata
        if key in self.protected:
            return False
        ref = self.kept.get(key)
        keeper = ref() if ref is not None else None
        return keeper is None or keeper.state != _KEPT

    def keep(self, box: _Box) -> None:
        self.stats["kept"] += 1
        if box.outer_unpack is not None or not self.bitpack:
            return
        tensor = box.payload
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.protected:
            return  # parameters are never bit-packed: nothing to give back
        self.kept[key] = weakref.ref(box)
        use = self.packed.pop(key, None)
        if use is None or use.ref.expired():
            return
        # a bit box of this storage frees nothing any more: give it back the tensor (unless the
        # tensor was modified in place since: then the bits hold what backward must see)
        for ref in use.boxes:
            packed_box = ref()
            if packed_box is not None and packed_box.state == _PACKED and tensor._version == packed_box.version:
                view = torch.empty((0,), dtype=packed_box.dtype, device=packed_box.device)
                view.set_(storage, packed_box.offset, packed_box.shape, packed_box.stride)
                packed_box.payload, packed_box.state = view, _KEPT
                self.stats["unpacked_again"] += 1

    def pack_bits(self, box: _Box, packer: _Packer) -> None:
        tensor = box.payload
        # dense: the values in memory order, whatever the layout (unpacking restores the strides)
        found = packer(tensor.as_strided((tensor.numel(),), (1,))) if _dense(tensor) else None
        if found is None:
            self.keep(box)
            return
        bits, box.scale = found
        box.stride, box.offset = tensor.stride(), tensor.storage_offset()
        storage = tensor.untyped_storage()
        use = self.packed.get(storage._cdata)
        if use is None or use.ref.expired():
            use = self.packed[storage._cdata] = _PackedUse(StorageWeakRef(storage))
        use.boxes.append(weakref.ref(box))
        box.payload, box.state = bits, _PACKED
        self.stats["bitpacked"] += 1


class _NodeKind:
    """What deciding needs about one autograd node type, found once per type."""

    __slots__ = ("name", "slots", "knowledge", "scalars", "plans")

    def __init__(self, node: Any) -> None:
        self.name = type(node).__name__
        # (attribute, getter) per tensor slot; None for custom Functions (their own listing)
        self.slots: Optional[tuple[tuple[str, str], ...]] = None
        if not isinstance(node, torch.autograd.function.BackwardCFunction):
            self.slots = tuple((attr, "_raw_saved_" + attr) for attr in _names_of(node)[0])
        self.knowledge = op_knowledge(self.name)
        # reading every scalar of every node costs more than the rest of a decision: read only
        # those the op knowledge declares it reads
        self.scalars = op_scalars(self.name)
        self.plans: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # see _plan


_KINDS: dict[type, _NodeKind] = {}


def _kind_of(node: Any) -> _NodeKind:
    kind = _KINDS[type(node)] = _NodeKind(node)
    return kind


_KEEP_ACTION = None


def _plan(kind: _NodeKind, node: Any, module: tuple[str, str], boxes: list[tuple[str, _Box]]) -> tuple[Any, ...]:
    """Per save of ``node``: _KEEP_ACTION, a bool (not needed; True when backward reads only its
    shape) or the packer of a bit-packable save. Cached: the op knowledge is a pure function of
    the node type, its edge mask, the scalars it declares, the module and the saves' attributes,
    shapes, dtypes and devices.
    """
    scalars = node_scalars(node, kind.scalars) if kind.scalars else {}
    key = (module, tuple([fn is not None for fn, _ in node.next_functions]),
           tuple([(k, tuple(v) if type(v) is list else v) for k, v in scalars.items()]),
           tuple([(attr, box.shape, box.dtype, box.device) for attr, box in boxes]))
    plan = kind.plans.get(key)
    if plan is not None:
        return plan
    graph_node = GraphNode(id=0, name=kind.name, module=module[0], next_ids=[], edge_mask=list(key[1]),
                           scalars=scalars)
    saved = {attr: _describe(i, kind.name, attr, module, box) for i, (attr, box) in enumerate(boxes)}
    verdicts = kind.knowledge(graph_node, saved)
    actions = []
    for attr, _ in boxes:
        verdict = verdicts.get(attr)
        if verdict is None:
            actions.append(_KEEP_ACTION)
        elif verdict.verdict == NOT_NEEDED:
            actions.append((kind.name, attr) in _SHAPE_ONLY)
        elif verdict.bitpackable and (kind.name, attr) in _PACKERS:
            actions.append(_PACKERS[(kind.name, attr)])
        else:
            actions.append(_KEEP_ACTION)
    if len(kind.plans) > 4096:
        kind.plans.clear()
    plan = kind.plans[key] = tuple(actions)
    return plan


def _describe(index: int, node: str, attr: str, module: tuple[str, str], box: _Box) -> SavedTensor:
    """The plain-data view of a save that the op knowledge functions take."""
    return SavedTensor(
        index=index, node_id=0, node=node, attr=attr, shape=tuple(box.shape),
        dtype=str(box.dtype).replace("torch.", ""), device=str(box.device), numel=box.shape.numel(),
        itemsize=box.dtype.itemsize, storage_id=-1, storage_kind="activation", module=module[0],
        module_class=module[1],
        source=None,
    )


_TRIMMED: "weakref.WeakKeyDictionary[nn.Module, TrimHandle]" = weakref.WeakKeyDictionary()


class TrimHandle:
    """Returned by ``trim``: ``remove()`` (or leaving the ``with`` block) restores the model."""

    def __init__(self, model: nn.Module, bitpack: bool) -> None:
        self._model_ref = weakref.ref(model)
        self._session = _Session(model, bitpack)
        self._handles: list[Any] = []
        session = self._session
        self._handles.append(model.register_forward_pre_hook(
            lambda module, args, kwargs: session.begin(module, args, kwargs), with_kwargs=True, prepend=True))
        for path, module in model.named_modules():
            if module is not model:
                entry = (path, type(module).__name__)
                self._handles.append(module.register_forward_pre_hook(functools.partial(session.enter, entry)))
                self._handles.append(module.register_forward_hook(session.leave, always_call=True))
        self._handles.append(model.register_forward_hook(
            lambda *unused: session.end(), always_call=True))

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    @property
    def stats(self) -> dict[str, int]:
        """Counts since ``trim``: saves kept, dropped, bit-packed, and bit-packed saves given their
        tensor back because a later save kept it (``unpacked_again``)."""
        return dict(self._session.stats)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        model = self._model_ref()
        if model is not None and _TRIMMED.get(model) is self:
            del _TRIMMED[model]

    def __enter__(self) -> "TrimHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        model = self._model_ref()
        name = type(model).__name__ if model is not None else "<gone>"
        return f"<gradaudit.TrimHandle {name} {'installed' if self.installed else 'removed'}>"


def trim(model: nn.Module, *, bitpack: bool = True) -> TrimHandle:
    """Make every forward of ``model`` keep only what backward can need; gradients stay bit-identical.

    Saves backward cannot read are forgotten (backward gets a placeholder of the same shape and strides, never read);
    saves one bit per element can stand for (ReLU results, dropout masks) become bits when
    ``bitpack``; everything else is kept. Decisions come from the static op knowledge
    (gradaudit/rules/ops.py) and are made at every module boundary of the forward, so the peak
    falls too.

    Composes with ``torch.utils.checkpoint`` and ``save_on_cpu``/saved-tensor hooks used inside the
    model (their saves are left alone), with hooks around the model call (unneeded saves are
    dropped before the outer hook's unpack would run; nothing is bit-packed), and with autocast.
    Refuses (GradauditError) when saved-tensor hooks are disabled and in double backward.

    Returns a handle: ``handle.remove()`` restores the model exactly; ``with trim(model): ...``.
    """
    if not isinstance(model, nn.Module):
        raise GradauditError(f"trim() needs a torch.nn.Module, got {type(model).__name__}")
    if model in _TRIMMED:
        raise GradauditError(f"{type(model).__name__} is already trimmed; remove the first handle first")
    handle = TrimHandle(model, bitpack)
    _TRIMMED[model] = handle
    return handle


# ----------------------------------------------------------------------------------------------
# Measuring the effect


class PeakTracker(StorageTracker):
    """StorageTracker that also follows the bytes alive after every op, and their maximum.

    ``exclude``: storages alive anyway (parameters, buffers, the caller's inputs), not counted
    when a view of them (a detach when autograd unpacks a saved parameter) passes by.
    """

    def __init__(self, exclude: set[int] = frozenset()) -> None:
        super().__init__()
        self.exclude = exclude
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for cdata in [c for c, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(cdata)[1]
        for cdata, (ref, nbytes) in self.storages.items():
            if cdata not in self.live and cdata not in self.exclude and not ref.expired():
                self.live[cdata] = (ref, nbytes)
                self.current += nbytes
        self.storages = {}  # the live table takes over; keep the per-op scan short
        self.peak = max(self.peak, self.current)
        return out

    def settle(self) -> int:
        for cdata in [c for c, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(cdata)[1]
        return self.current


def _forward_backward(model: nn.Module, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(bytes held after the forward, peak bytes through forward and backward), outputs excluded
    from the held figure. CPU: a PeakTracker; CUDA: the caching allocator's counters."""
    device = next((t.device for t in [*model.parameters(), *iter_tensors((args, kwargs))]), torch.device("cpu"))
    cuda = device.type == "cuda"
    tracker = None
    if cuda:
        torch.cuda.synchronize(device)
        gc.collect()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        tracker = PeakTracker({t.untyped_storage()._cdata for t in
                               [*model.parameters(), *model.buffers(), *iter_tensors((args, kwargs))]})
        tracker.__enter__()
    try:
        output = model(*args, **kwargs)
        outputs = unique([t for t in iter_tensors(output) if t.requires_grad and t.grad_fn is not None])
        del output
        gc.collect()
        output_bytes = sum(t.untyped_storage().nbytes() for t in
                           {t.untyped_storage()._cdata: t for t in outputs}.values())
        if cuda:
            held = torch.cuda.memory_allocated(device) - base - output_bytes
        else:
            held = tracker.settle() - output_bytes
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        del outputs
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = tracker.peak
    return held, peak


def compare(model: nn.Module, inputs: Any, *, bitpack: bool = True) -> dict[str, int]:
    """Held bytes after the forward and peak bytes through forward+backward, plain vs trimmed.

    Returns ``{"held_before", "held_after", "peak_before", "peak_after"}`` in bytes. Runs two
    forwards and backwards; the model (``.grad``, buffers, flags, RNG) and the inputs' ``.grad``
    are left as found.
    """
    if not isinstance(model, nn.Module):
        raise GradauditError(f"compare() needs a torch.nn.Module, got {type(model).__name__}")
    if model in _TRIMMED:
        raise GradauditError("compare() measures the model with and without trimming; remove its trim handle first")
    args, kwargs = split_inputs(inputs)
    leaves = [t for t in unique(list(iter_tensors((args, kwargs)))) if t.requires_grad and t.is_leaf]
    input_grads = [(t, t.grad) for t in leaves]
    state = ModelState(model)
    try:
        measured = []
        for trimmed in (False, True):
            # each run starts from the same state: same BN statistics, same dropout masks, and no
            # accumulation into the caller's .grad tensors
            state.restore()
            for t in [*model.parameters(), *leaves]:
                t.grad = None
            if trimmed:
                with trim(model, bitpack=bitpack):
                    measured.append(_forward_backward(model, args, kwargs))
            else:
                measured.append(_forward_backward(model, args, kwargs))
    finally:
        state.restore()
        for t, grad in input_grads:
            t.grad = grad
    (held_before, peak_before), (held_after, peak_after) = measured
    return {"held_before": held_before, "held_after": held_after,
            "peak_before": peak_before, "peak_after": peak_after}

