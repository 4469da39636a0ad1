"""Dispatch and function modes, operator overloads and their schemas, pytrees."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (the storage trackers' base)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass  # noqa: F401  (measure's wrappers)
from torch.utils._pytree import register_pytree_node, tree_flatten, tree_map  # noqa: F401


def without_dispatch_modes() -> Any:
    """A context in which no TorchDispatchMode sees the ops run (gradaudit's own bookkeeping tensors,
    which storage trackers must not count)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


# dispatch_modes_below(): inside a TorchDispatchMode's handler, how many dispatch modes are still in force
# (those below it: the handler's own mode is set aside while it runs); 0 when it is the bottom one. The
# builtin itself: it is asked on every op on meta.
dispatch_modes_below = torch._C._len_torch_dispatch_stack


def top_dispatch_mode() -> Optional[Any]:
    """The TorchDispatchMode that would see the next op first (the last entered), or None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def without_function_modes() -> Any:
    """A context in which no TorchFunctionMode (and no tensor subclass's ``__torch_function__``) sees the
    torch functions called (tensors a dispatch mode makes as a kernel would)."""
    return torch._C.DisableTorchFunction()


def function_modes() -> list[Any]:
    """The TorchFunctionModes in force, outermost first."""
    return list(torch.overrides._get_current_function_mode_stack())


@contextlib.contextmanager
def function_modes_entered(modes: Sequence[Any]) -> Iterator[None]:
    """Enter those of ``modes`` not in force now, in order (a torch function being handled runs with
    the mode stack set aside: a backward called through ``torch.autograd.backward`` does)."""
    active = {id(m) for m in function_modes()}
    with contextlib.ExitStack() as stack:
        for mode in modes:
            if id(mode) not in active:
                stack.enter_context(mode)
        yield


def op_namespaces() -> tuple[Any, ...]:
    """torch's C namespaces of functions (F's builtins, the _VF ops) as a TorchFunctionMode gets them."""
    return tuple(space for space in (getattr(torch._C, "_nn", None), getattr(torch._C, "_VariableFunctions", None))
                 if space is not None)


def overload_packet(op: Any) -> Any:
    """The overload packet of an operator overload (``aten.mm.default`` -> ``aten.mm``); a packet as it is."""
    return getattr(op, "_overloadpacket", op)


def op_schema(op: Any) -> Any:
    """An operator overload's schema (its arguments' alias information says which it writes)."""
    return op._schema


def first_overload_schema(packet: Any) -> Optional[Any]:
    """The schema of an overload packet's first overload (its ``returns`` say which alias an input);
    None where the packet has no overload or schema to read."""
    try:
        return getattr(packet, packet.overloads()[0])._schema
    except (AttributeError, IndexError, RuntimeError):
        return None


def is_higher_order(func: Any) -> bool:
    """Whether a dispatch mode's ``func`` is a higher-order operator (``torch.cond``, flex attention...),
    not an aten op."""
    return isinstance(func, torch._ops.HigherOrderOperator)


# the ops that ask a tensor's sizes, strides or layout, which torch.utils.flop_counter hands on uncounted
# (NotImplemented: a tensor subclass with its own sizes policy answers them)
_SIZE_QUERY_NAMES = {torch.ops.aten: ("sym_is_contiguous", "is_contiguous", "is_strides_like_format",
                                      "is_non_overlapping_and_dense", "size", "sym_size", "stride", "sym_stride",
                                      "storage_offset", "sym_storage_offset", "numel", "sym_numel", "dim"),
                     torch.ops.prim: ("layout",)}
SIZE_QUERIES = frozenset(getattr(space, name).default for space, names in _SIZE_QUERY_NAMES.items()
                         for name in names if hasattr(space, name)) | (
    {torch.ops.aten.is_contiguous.memory_format} if hasattr(torch.ops.aten, "is_contiguous") else set())
