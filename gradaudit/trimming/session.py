"""The hook session of ``trim``: boxes every save during a forward and rewrites them at module
boundaries as the plan says (drop, bit-pack or keep)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .. import torchapi
from ..errors import GradauditError
from ..tensors import iter_tensors, storage_key
from ..torchapi.modules import add_forward_hooks, remove_forward_hooks
from ..tensors import contiguous_strides
from .codec import BYTES, FUSED, Packer, dense, mask_form, shape_stand_in, unfilled_strided, unpack_bits
from .plan import KEEP, kind_of, plan_for
from ..torchapi.autograd import (NO_SEQUENCE, called_from_autograd, caller_frame, in_backward,
                                 node_sequence_number, pop_node_creation_hook, push_node_creation_hook,
                                 raw_saved_slots, raw_slot, sequence_number)
from ..torchapi.checkpoint import saving_checkpoint_inputs
from ..torchapi.storages import storage_id, version_counter

KEPT, DROPPED, PACKED = 0, 1, 2  # what a box holds: the tensor, nothing, its bits

class Box:
    """What autograd stores instead of a saved tensor while a model is trimmed."""

    __slots__ = ("session", "state", "payload", "shape", "dtype", "device", "version", "stride",
                 "offset", "scale", "zero_stride", "outer_unpack", "module", "packer", "storage", "__weakref__")

    def __init__(self, session: Optional["Session"], payload: Any, tensor: torch.Tensor,
                 outer_unpack: Optional[Callable[[Any], Any]], module: Optional["Call"] = None) -> None:
        self.session = session
        self.module = module  # the module call running when it was saved
        self.state = KEPT
        self.payload = payload  # the tensor, the outer hook's packed object, or the packed bits
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self.device = tensor.device
        self.version = version_counter(tensor)
        # read when the box is dropped or packed (the tensor is still at hand then), except behind
        # an outer hook, whose packed object is not the tensor
        self.stride: tuple[int, ...] = () if outer_unpack is None or session is None else tensor.stride()
        self.offset = 0
        self.zero_stride = False  # dropped: a zero-stride placeholder is enough
        self.scale = 1.0  # bit-packed: the value a set bit stands for
        self.packer: Optional[Packer] = None  # bit-packed: the packer that made the bits
        # dropped in a recorded forward: (its storage, that storage's key); when the forward ends,
        # whether another save kept that storage whole (the drop freed nothing)
        self.storage: Any = None
        self.outer_unpack = outer_unpack


def unpack(box: Box) -> torch.Tensor:
    if box.state == KEPT:
        if box.outer_unpack is not None:
            return box.outer_unpack(box.payload)
        if version_counter(box.payload) != box.version:
            # autograd checks a saved tensor's version only where no hook packed it: with trim's
            # hooks a save modified in place since would give backward the new values, silently
            raise modified_since_saved(box.payload, box.version)
        return box.payload
    if torch.is_grad_enabled() and in_backward():
        # backward(create_graph=True) differentiates the backward formulas themselves, which may
        # read values the first-order backward never reads
        raise GradauditError(
            "gradaudit.trim does not support double backward (create_graph=True): a save it "
            "dropped or bit-packed was read with grad mode on. Remove the trim handle for this model")
    if box.state == DROPPED:
        if box.zero_stride:
            return shape_stand_in(box.shape, box.dtype, box.device)
        return unfilled_strided(box)
    return unpack_bits(box, fused_kernels=box.packer in _FUSED_PACKERS)


_FUSED_PACKERS = frozenset(FUSED.values())


def modified_since_saved(tensor: torch.Tensor, version: int) -> RuntimeError:
    """The error autograd raises when backward reads a saved tensor modified in place since its save."""
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{tensor.dtype} {list(tensor.shape)}] is at version {version_counter(tensor)}; expected version {version} "
        f"instead (autograd's own check, made by gradaudit.trim, whose saved-tensor hooks autograd does not check). "
        f"Clone the tensor before modifying it, or modify a copy")




class _PackedUse:
    """The bit boxes of one storage during one forward (the storage may be freed meanwhile:
    its weak reference tells a reused address from the original)."""

    __slots__ = ("ref", "boxes")

    def __init__(self, ref: StorageWeakRef) -> None:
        self.ref = ref
        self.boxes: list[weakref.ref] = []


class Call:
    """One call of a module during a forward trim decides fully: what it ran, which autograd nodes it
    made (sequence numbers ``start`` to ``end``) and the nodes its output tensors lead back to (where
    the steady plan finds the nodes it changes, see ``steady``)."""

    __slots__ = ("path", "cls", "module", "index", "start", "end", "outputs")

    def __init__(self, path: str, module: nn.Module, index: int, start: int) -> None:
        self.path = path
        self.cls = type(module).__name__
        self.module = module
        self.index = index  # how many calls of this module came before it in this forward
        self.start = start
        self.end = start
        self.outputs: list[Any] = []  # per output tensor (iter_tensors order), its grad_fn or None

    def close(self, output: Any) -> None:
        self.end = sequence_number()
        self.outputs = [t.grad_fn if isinstance(t, torch.Tensor) else None for t in iter_tensors(output)]

    def release(self) -> None:
        """Let go of the graph and the module once the forward is over: the boxes of this call's saves
        point here, and autograd's nodes hold the boxes (a cycle through C++ no collector sees)."""
        self.outputs = []
        self.module = None


class Session:
    """Trimming state for one model in a forward it decides fully: every save boxed by a
    saved-tensor hook, every new node decided at the next module boundary (a hook on every module).
    ``trim`` runs such a forward first and whenever the steady plan does not apply; the forward also
    records what the steady plan needs (``changed``, ``calls``)."""

    def __init__(self, model: nn.Module, bitpack: bool, masks: str = "auto", kernels: str = "torch") -> None:
        self.model_ref = weakref.ref(model)
        self.bitpack = bitpack
        self.masks = masks  # codec.MASK_FORMATS: what a bit-packable save becomes (codec.mask_form)
        self.kernels = kernels  # codec.KERNELS: what packs and unpacks bits
        self.active = False
        self.pending: list[tuple[Any, Optional[Call]]] = []  # (node, module call) since the last boundary
        # Without torch's node-creation hook (torch < 2.14) the nodes are found by walking the graph
        # back from the tensors at each boundary, down to the nodes decided or made before the
        # forward (sequence numbers: no strong reference keeps a dead branch alive), and each node
        # is attributed to the module that ran when its saves were packed
        self.node_hook = torchapi.has("node creation hook")
        self.first_sequence = 0
        self.walked: set[int] = set()
        # the module calls running now (the root's first); every boundary decides the pending nodes
        self.stack: list[Call] = []
        self.module_hooks: list[tuple] = []
        self.call_counts: dict[int, int] = {}
        # what the steady plan is made of: every call that ended, and per node trim changed the
        # call that made it and its boxes (their final state is read when the forward ends)
        self.record = False
        self.calls: list[Call] = []
        self.changed: list[tuple[Any, Call, list[tuple[str, Box]]]] = []
        self.waiting: list[tuple[Box, Callable]] = []  # saves to bit-pack at the next boundary
        self.protected: set[int] = set()  # storages alive anyway (parameters, buffers, inputs)
        self.alive_anyway: Optional[list[torch.Tensor]] = None  # parameters and buffers
        # storage -> a box keeping a save of it (alive box: alive storage, so the address is
        # not reused) and storage -> its bit boxes; bit-packing a kept storage frees nothing
        self.kept: dict[int, weakref.ref] = {}
        self.packed: dict[int, _PackedUse] = {}
        self.outer: Optional[tuple[Callable, Callable]] = None
        self.hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self.stats = {"kept": 0, "dropped": 0, "bitpacked": 0, "unpacked_again": 0}

    # -- module boundaries ----------------------------------------------------------------------
    def _hook_modules(self, model: nn.Module) -> None:
        post = self._post
        for path, module in model.named_modules():
            if module is not model:
                self.module_hooks.append(add_forward_hooks(module, self._make_pre(path), post, post_first=True))

    def _unhook_modules(self) -> None:
        for added in self.module_hooks:
            remove_forward_hooks(added)
        self.module_hooks = []

    def _make_pre(self, path: str) -> Callable:
        def pre(module: nn.Module, args: Any) -> None:
            if not self.active:
                return
            self.boundary(args)
            counts = self.call_counts
            index = counts.get(id(module), 0)
            counts[id(module)] = index + 1
            self.stack.append(Call(path, module, index, sequence_number()))

        return pre

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.active:
            return
        self.boundary(output)
        if len(self.stack) > 1 and self.stack[-1].module is module:
            call = self.stack.pop()
            if self.record:
                call.close(output)
                self.calls.append(call)

    # -- hooks during the forward ---------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Box:
        # Sparse and other non-strided saves have no placeholder and no bits: kept as they are,
        # in a box of no session, which no decision looks at
        owner = self
        if tensor.layout != torch.strided:
            owner = None
            self.stats["kept"] += 1
        if self.outer is not None:
            return Box(owner, self.outer[0](tensor), tensor, self.outer[1], self.stack[-1])
        # a detached alias (same storage, strides, version counter), never ``tensor`` itself: a
        # save of the node's own output would otherwise close the cycle tensor -> grad_fn -> saved
        # slot -> box -> tensor through C++, and a graph dropped without backward would never be
        # freed (see Recorder._pack)
        box = Box(owner, tensor.detach(), tensor, None, self.stack[-1])
        if owner is self and saving_checkpoint_inputs(caller_frame(1)):
            # a non-reentrant checkpoint saving its region's inputs (a plan's, or the model's own):
            # held until backward recomputes the region, on no node, so no decision ever sees it.
            # It keeps the tensor: bit-packing another save of that storage would free nothing
            self.keep(box)
        return box

    def on_node(self, node: Any) -> None:
        self.pending.append((node, self.stack[-1]))

    def walk_from(self, values: Any) -> None:
        """Add to ``pending`` the nodes made in this forward that ``values`` lead back to and no
        boundary has seen yet (the stand-in for the node-creation hook)."""
        first, walked = self.first_sequence, self.walked
        todo = [t.grad_fn for t in iter_tensors(values) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            number = node_sequence_number(node)
            if number < first or number == NO_SEQUENCE or number in walked:
                continue
            walked.add(number)
            self.pending.append((node, None))  # the module: its saves' (see decide)
            todo.extend(fn for fn, _ in node.next_functions if fn is not None)

    def begin(self, module: nn.Module, args: Any, kwargs: Any, outer: Optional[tuple[Callable, Callable]],
              record: bool) -> None:
        """Start deciding fully (``outer``: saved-tensor hooks in force around the model, whose
        packing the boxes wrap; ``record``: note what the steady plan needs)."""
        self.outer = outer
        self.record = record
        if self.alive_anyway is None:
            # walking the module tree costs more than the storage look-ups: do it once. A parameter
            # replaced later is only treated like an activation (its unneeded saves dropped)
            self.alive_anyway = [*module.parameters(), *module.buffers()]
        self.protected = {storage_key(t) for t in [*self.alive_anyway, *iter_tensors((args, kwargs))]}
        self.kept = {}
        self.packed = {}
        self.pending = []
        self.waiting = []
        self.calls = []
        self.changed = []
        self.call_counts = {}
        self.walked = set()
        self.first_sequence = sequence_number()
        self.stack = [Call("", module, 0, self.first_sequence)]
        self.active = True
        self._hook_modules(module)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(called_from_autograd(self.pack),
                                                             called_from_autograd(unpack))
        self.hooks.__enter__()
        if self.node_hook:
            push_node_creation_hook(called_from_autograd(self.on_node), "gradaudit.trim")

    def end(self, output: Any = None) -> None:
        """Decide what is left when the forward ends (``output``: the model's, None when unknown)."""
        if not self.active:
            return
        try:
            if not self.node_hook:
                self.walk_from(output)
            self.step(final=True)
            if self.record and self.stack:
                root = self.stack[0]
                root.close(output)
                self.calls.append(root)
                # storages a save keeps whole when the forward ends: dropping another save of one
                # frees nothing (known where bit-packing is on: ``keep`` follows them then)
                kept_whole = {key for key, ref in self.kept.items()
                              if (box := ref()) is not None and box.state == KEPT}
                for _, _, boxes in self.changed:
                    for _, box in boxes:
                        if box.storage is not None:  # alive and kept by another save: freed nothing
                            ref, key = box.storage
                            box.storage = not ref.expired() and key in kept_whole
        finally:
            self.active = False
            self._unhook_modules()
            self.stack = []
            if self.node_hook:
                pop_node_creation_hook()
            hooks, self.hooks = self.hooks, None
            hooks.__exit__(None, None, None)
            self.kept = {}
            self.packed = {}
            self.protected = set()
            self.pending = []
            self.waiting = []
            self.walked = set()
            self.outer = None

    def boundary(self, values: Any = None) -> None:
        if self.active and not self.node_hook:
            self.walk_from(values)
        if self.active and self.pending:
            self.step()

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

    def decide(self, node: Any, module: Optional[Call]) -> None:
        kind = kind_of(node)
        boxes = []
        if kind.slots is None:
            slots = raw_saved_slots(node)
        else:
            slots = []
            for attr in kind.slots:
                raw = raw_slot(node, attr)
                if raw is None:
                    continue
                if type(raw) is list or type(raw) is tuple:
                    slots.extend((f"{attr}[{i}]", item) for i, item in enumerate(raw) if item is not None)
                else:
                    slots.append((attr, raw))
        for attr, raw in slots:
            box = raw.data
            if type(box) is Box and box.session is self:
                boxes.append((attr, box))
        if not boxes:
            return
        if module is None:  # found by a walk: the module that ran when the op saved these
            module = boxes[0][1].module
        if not kind.declared:
            for _, box in boxes:
                self.keep(box)
            return
        actions = plan_for(kind, node, module.cls, boxes)
        if self.record and any(action is not KEEP for action in actions):
            self.changed.append((node, module, boxes))
        for (attr, box), action in zip(boxes, actions):
            if action is KEEP:
                self.keep(box)
            elif type(action) is bool:  # dropped; True: a zero-stride placeholder may do
                if not self.droppable(box):
                    self.keep(box)
                    continue
                if box.outer_unpack is None:
                    box.stride = box.payload.stride()
                    if self.record:
                        storage = box.payload.untyped_storage()
                        box.storage = (StorageWeakRef(storage), storage_id(storage))
                box.zero_stride = action and box.stride == contiguous_strides(box.shape)
                box.payload, box.state = None, DROPPED
                self.stats["dropped"] += 1
            elif self.packable(box):
                self.waiting.append((box, action))
            else:
                self.keep(box)

    def droppable(self, box: Box) -> bool:
        if box.outer_unpack is not None:
            return True
        # parameters, buffers and inputs are alive anyway: replacing their saves frees nothing
        return storage_key(box.payload) not in self.protected

    def packable(self, box: Box) -> bool:
        if not self.bitpack or box.outer_unpack is not None:
            return False
        tensor = box.payload
        if not (tensor.is_floating_point() or tensor.dtype == torch.bool) or version_counter(tensor) != box.version:
            return False  # modified in place since it was saved: leave it as autograd would
        key = storage_key(tensor)
        if key in self.protected:
            return False
        ref = self.kept.get(key)
        keeper = ref() if ref is not None else None
        return keeper is None or keeper.state != KEPT

    def keep(self, box: Box) -> None:
        self.stats["kept"] += 1
        if box.outer_unpack is not None or not self.bitpack:
            return
        tensor = box.payload
        storage = tensor.untyped_storage()
        key = storage_id(storage)
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
            if packed_box is not None and packed_box.state == PACKED \
                    and version_counter(tensor) == packed_box.version:
                view = torch.empty((0,), dtype=packed_box.dtype, device=packed_box.device)
                view.set_(storage, packed_box.offset, packed_box.shape, packed_box.stride)
                # (a tensor of its own, with a version counter of its own: unmodified now)
                packed_box.payload, packed_box.state = view, KEPT
                packed_box.version = version_counter(view)
                self.stats["unpacked_again"] += 1

    def pack_bits(self, box: Box, packer: Packer) -> None:
        if mask_form(self.masks, box.device.type, self.kernels) == "bytes":
            packer = BYTES[packer]
        elif self.kernels == "triton":
            packer = FUSED[packer]
        tensor = box.payload
        # dense: the values in memory order, whatever the layout (unpacking restores the strides)
        found = packer(tensor.as_strided((tensor.numel(),), (1,))) if dense(tensor) else None
        if found is None:
            self.keep(box)
            return
        bits, box.scale = found
        box.packer = packer
        box.stride, box.offset = tensor.stride(), tensor.storage_offset()
        storage = tensor.untyped_storage()
        use = self.packed.get(storage_id(storage))
        if use is None or use.ref.expired():
            use = self.packed[storage_id(storage)] = _PackedUse(StorageWeakRef(storage))
        use.boxes.append(weakref.ref(box))
        box.payload, box.state = bits, PACKED
        self.stats["bitpacked"] += 1

