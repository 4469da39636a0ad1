"""Autograd nodes (their saved slots, sequence numbers, the node-creation hook) and saved-tensor
hooks (the ones in force, and whose a pack hook is)."""

from __future__ import annotations

import sys
from itertools import repeat
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from ..records import Manager
from .features import AUTOGRAD, require


NO_SEQUENCE = (1 << 64) - 1  # AccumulateGrad nodes report this sequence number


def sequence_number() -> int:
    """The sequence number the next autograd node created on this thread will get."""
    return int(AUTOGRAD._get_sequence_nr())


def node_sequence_number(node: Any) -> int:
    return node._sequence_nr()


def input_metadata(node: Any) -> Any:
    """Shape, dtype and device of the gradients ``node`` receives, one entry per output."""
    return node._input_metadata


def node_type_exists(name: str) -> bool:
    """Whether the installed torch defines a built-in autograd node type of this name."""
    return hasattr(torch._C._functions, name)


def is_custom_function(node: Any) -> bool:
    """Whether ``node`` is the backward of a Python ``torch.autograd.Function``."""
    return isinstance(node, torch.autograd.function.BackwardCFunction)


_slot_names: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def slot_names(node: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tensor slot names, scalar attribute names) of a built-in node type, cached per type."""
    kind = type(node)
    names = _slot_names.get(kind)
    if names is None:
        listing = dir(node)
        tensors = tuple(n[len("_raw_saved_"):] for n in listing if n.startswith("_raw_saved_"))
        scalars = tuple(
            n[len("_saved_"):] for n in listing
            if n.startswith("_saved_") and n[len("_saved_"):] not in tensors
        )
        names = _slot_names[kind] = (tensors, scalars)
    return names


_slot_attributes: dict[type, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]] = {}


def _slot_attributes_of(node: Any) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """``slot_names(node)`` with the node attribute each is read from: ((name, "_raw_saved_" +
    name), ...) for the tensor slots, ((name, "_saved_" + name), ...) for the scalars; per type."""
    kind = type(node)
    found = _slot_attributes.get(kind)
    if found is None:
        tensors, scalars = slot_names(node)
        found = _slot_attributes[kind] = (tuple((n, "_raw_saved_" + n) for n in tensors),
                                          tuple((n, "_saved_" + n) for n in scalars))
    return found


def raw_slot_attribute(attr: str) -> str:
    """The node attribute that holds tensor slot ``attr``'s raw SavedVariable (``getattr`` it)."""
    return "_raw_saved_" + attr


def raw_slot(node: Any, attr: str) -> Any:
    """The raw SavedVariable (or list of them) behind tensor slot ``attr`` (reading it unpacks nothing)."""
    return getattr(node, raw_slot_attribute(attr))


def graph_nodes(roots: Iterable[Any]) -> Iterator[Any]:
    """Every node of the graph under ``roots`` (nodes or None), once each, depth first."""
    stack, visited = list(roots), set()
    while stack:
        node = stack.pop()
        if node is not None and node not in visited:
            visited.add(node)
            yield node
            stack.extend(fn for fn, _ in node.next_functions)


def raw_saved_slots(node: Any) -> Iterator[tuple[str, Any]]:
    """Yield (attribute name, raw SavedTensor) for every tensor slot a node saved."""
    if is_custom_function(node):
        raws = node._raw_saved_tensors or ()
        for i, raw in enumerate(raws):
            if raw is not None:
                yield f"saved_tensors[{i}]", raw
        return
    for attr, name in _slot_attributes_of(node)[0]:
        raw = getattr(node, name)  # raw_slot(node, attr)
        if isinstance(raw, (list, tuple)):
            for i, item in enumerate(raw):
                if item is not None:
                    yield f"{attr}[{i}]", item
        elif raw is not None:
            yield attr, raw


_SCALAR_TYPES = (bool, int, float, str)


def node_scalars(node: Any, names: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """The node's non-tensor saved values (BN's ``training``, threshold values, strides...).

    ``names``: read only these (a caller on a hot path that knows which ones matter).
    Reading these never runs an unpack hook: only tensor slots are packed.
    """
    if is_custom_function(node):
        return {}
    values: dict[str, Any] = {}
    scalars = (_slot_attributes_of(node)[1] if names is None
               else [(attr, "_saved_" + attr) for attr in names])
    for attr, name in scalars:
        try:
            value = getattr(node, name)
        except Exception:  # some symbolic-size attributes cannot be read on every device
            continue
        if isinstance(value, _SCALAR_TYPES) or value is None:
            values[attr] = value
        elif isinstance(value, (tuple, list)) and all(map(isinstance, value, repeat(_SCALAR_TYPES))):
            values[attr] = list(value)
    return values


def called_from_autograd(callback: Callable[..., Any]) -> Callable[..., Any]:
    """``callback`` as a hook autograd calls from C++ (saved-tensor pack/unpack, node creation):
    never compiled. Inside a torch.compile'd region TorchDynamo would otherwise compile each call of
    it as a frame of its own, recompiling on every guard it fails (the count of saves so far) until
    its cache limit, with a warning each time. Costs about 0.2 us per call."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:
        return callback
    wrapped = disable(callback)
    code = getattr(wrapped, "__code__", None)
    if code is not None and code is not getattr(callback, "__code__", None):
        _WRAPPER_CODES.add(code)
    return wrapped


_WRAPPER_CODES: set[Any] = set()


def caller_frame(depth: int = 1) -> Any:
    """The frame ``depth`` levels above the caller, not counting ``called_from_autograd``'s wrapper."""
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_code in _WRAPPER_CODES:
        frame = frame.f_back
    return frame


def push_node_creation_hook(callback: Callable[[Any], None], who: str) -> None:
    require("node creation hook", who)
    AUTOGRAD._push_node_creation_hook(callback)


def pop_node_creation_hook() -> None:
    AUTOGRAD._pop_node_creation_hook()


def current_node() -> Any:
    """The autograd node whose backward runs on this thread, or None."""
    return torch._C._current_autograd_node()


def in_backward() -> bool:
    """Whether an autograd graph task is running on this thread."""
    return torch._C._current_graph_task_id() != -1


def saved_tensors_hooks_enabled() -> bool:
    return bool(AUTOGRAD._saved_tensors_hooks_is_enabled())


def top_saved_tensors_hooks() -> Optional[tuple[Callable, Callable]]:
    """The innermost (pack, unpack) pair of ``saved_tensors_hooks`` in force, or None."""
    return AUTOGRAD._top_saved_tensors_default_hooks(True)


def code_objects(function: Any) -> set[Any]:
    code = getattr(function, "__code__", None)
    return {c for c in (code.co_consts if code else ()) if hasattr(c, "co_code")}


# save_on_cpu's unpack hook is a closure made in its __init__: recognised by its code object
_OFFLOAD_CODES = code_objects(torch.autograd.graph.save_on_cpu.__init__)


_CHECKPOINT_MODULE = "torch.utils.checkpoint"


def manager_of(unpack_hook: Any) -> Manager:
    """Who manages a save packed by someone else's hooks: "checkpoint" (torch.utils.checkpoint),
    "offload" (torch.autograd.graph.save_on_cpu) or "hooks" (anybody else's)."""
    if (getattr(unpack_hook, "__module__", "") or "") == _CHECKPOINT_MODULE:
        return Manager.CHECKPOINT
    if getattr(unpack_hook, "__code__", None) in _OFFLOAD_CODES:
        return Manager.OFFLOAD
    return Manager.HOOKS


def packed_by_checkpoint(pack_hook: Any) -> bool:
    return (getattr(pack_hook, "__module__", "") or "") == _CHECKPOINT_MODULE
