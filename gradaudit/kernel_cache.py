"""Meta kernels run once per distinct call.

On the meta device an op computes nothing: its kernel only works out the outputs' sizes, strides and
dtype from the arguments' (for most elementwise ops and reductions, in Python: ``torch._refs`` and
``torch._meta_registrations``, 300-400 us a call on the build machine, where making the outputs takes
a few). Those are functions of the arguments' metadata and nothing else, and a model repeats the same
call with the same metadata in every one of its layers and every run the planner and ``fit`` make. So
the first call of an op with given arguments runs its kernel and remembers the outputs' metadata, and
a later identical call makes fresh outputs with that metadata without running it (20 layers of the
80-layer probe, forward and backward on plain meta: 0.65 s, 0.32 s with the cache cold, 0.20 s warm).

What makes a call identical, and which calls are never reused:

- The key is the op overload, every argument (a tensor by its dtype, sizes, strides, storage offset
  and negative/conjugate bits; a list by its items; a number by its type and value; a dtype, device,
  layout, memory format or string as it is) and the default dtype (type promotion of Python floats).
- Only ops of the ``aten`` namespace whose schema says they write and alias nothing (no in-place op,
  no ``out=`` op, no view) and return tensors only (a tensor, an optional one, a list of them), and
  that carry none of the tags ``dynamic_output_shape``, ``data_dependent_output``,
  ``nondeterministic_seeded`` and ``inplace_view``.
- Only calls whose tensors are all plain strided tensors on meta (no subclass, no CPU tensor: a CPU
  op computes values), with at least one tensor argument.
- Only outputs that are a fresh meta storage each, starting at offset 0 and exactly as large as their
  sizes and strides need: the first call's outputs are checked, and a call whose outputs share a
  storage with an argument or with each other, or whose storage is larger, is remembered as one to
  run every time. (gradaudit counts bytes by storage: a remade output must have the storage the
  kernel would have made.)
- Only where no other dispatch mode is below the caller: an op answered here is seen by every mode
  above it, as the kernel's outputs would be, and by none below (there is none).

``checking()`` runs every kernel anyway and compares (the tests run models under it).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .torchapi.dispatch import dispatch_modes_below, op_schema, without_function_modes
from .tensors import storage_span
from .torchapi.storages import storage_key

MAX_ENTRIES = 100_000  # distinct calls remembered before the cache starts afresh (bounds what it keeps)

_UNCACHEABLE_TAGS = frozenset(getattr(torch.Tag, name) for name in (
    "dynamic_output_shape", "data_dependent_output", "nondeterministic_seeded", "inplace_view")
    if hasattr(torch.Tag, name))
_TENSOR_RETURNS = frozenset({"Tensor", "Tensor?", "Optional[Tensor]", "List[Tensor]", "Tensor[]"})
_ATOMS = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_META = torch.device("meta")
_RUN = object()  # a key whose call runs its kernel every time


class _Uncacheable(Exception):
    """An argument the key cannot stand for (a CPU tensor, a subclass, a symbolic size)."""


class _State:
    def __init__(self) -> None:
        self.entries: dict[Any, Any] = {}
        self.ops: dict[Any, bool] = {}  # op overload -> whether its calls may be reused
        self.hits = 0
        self.misses = 0
        self.checking = False
        self.enabled = True


_state = _State()


def call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` for a dispatch mode at the bottom of the stack: its outputs remade from
    the first identical call's where that is known to be exact (the module's docstring), else run."""
    if not _state.enabled or dispatch_modes_below() or not _reusable(func):
        return func(*args, **kwargs)
    tensors: list[torch.Tensor] = []
    try:
        key = (func, torch.get_default_dtype(), _key_of(args, tensors), _key_of(kwargs, tensors) if kwargs else None)
    except _Uncacheable:
        return func(*args, **kwargs)
    if not tensors:  # a factory: cheap, and its device may be the default one
        return func(*args, **kwargs)
    entry = _state.entries.get(key)
    if entry is _RUN:
        return func(*args, **kwargs)
    if entry is not None:
        _state.hits += 1
        out = _remade(entry)
        if _state.checking:
            _check(func, args, kwargs, tensors, entry)
        return out
    out = func(*args, **kwargs)
    _state.misses += 1
    if len(_state.entries) >= MAX_ENTRIES:
        _state.entries.clear()
    _state.entries[key] = _entry_of(out, tensors)
    return out


def clear() -> None:
    """Forget every call remembered (the counters too)."""
    _state.entries.clear()
    _state.hits = _state.misses = 0


def counts() -> tuple[int, int]:
    """(calls answered from the cache, calls that ran their kernel and were remembered) since ``clear``."""
    return _state.hits, _state.misses


@contextlib.contextmanager
def checking() -> Iterator[None]:
    """Every call answered from the cache also runs its kernel; outputs that differ in sizes, strides,
    dtype or storage bytes raise AssertionError (tests run models under it)."""
    before, _state.checking = _state.checking, True
    try:
        yield
    finally:
        _state.checking = before


def is_checking() -> bool:
    """Whether ``checking`` is in force (other memories of gradaudit check their answers under it too)."""
    return _state.checking


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Every call runs its kernel (to compare figures with and without the cache)."""
    before, _state.enabled = _state.enabled, False
    try:
        yield
    finally:
        _state.enabled = before


def _reusable(func: Any) -> bool:
    known = _state.ops.get(func)
    if known is None:
        known = _state.ops[func] = _reusable_op(func)
    return known


def _reusable_op(func: Any) -> bool:
    if getattr(func, "namespace", None) != "aten" or _UNCACHEABLE_TAGS.intersection(getattr(func, "tags", ())):
        return False
    try:
        schema = op_schema(func)
    except AttributeError:
        return False
    if any(argument.alias_info is not None for argument in schema.arguments):
        return False
    return bool(schema.returns) and all(r.alias_info is None and str(r.type) in _TENSOR_RETURNS
                                        for r in schema.returns)


def _key_of(value: Any, tensors: list) -> Any:
    """The key part for ``value``; its tensors are appended to ``tensors``."""
    if isinstance(value, torch.Tensor):
        if type(value) not in _PLAIN or not value.is_meta or value.layout != torch.strided:
            raise _Uncacheable
        tensors.append(value)
        return (value.dtype, value.shape, value.stride(), value.storage_offset(), value.is_neg(),
                value.is_complex() and value.is_conj())
    if isinstance(value, _ATOMS):
        return (type(value), value)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple([_key_of(item, tensors) for item in value]))
    if isinstance(value, dict):
        return tuple([(name, _key_of(item, tensors)) for name, item in value.items()])
    raise _Uncacheable


def _entry_of(out: Any, arguments: list) -> Any:
    """What remakes ``out``: (its container or None for one tensor, (sizes, strides, dtype) of each
    output, None for an absent optional one); _RUN where remade outputs would not be the kernel's."""
    outputs = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (tuple, list)) else None
    if outputs is None:
        return _RUN
    tensors = [t for t in outputs if t is not None]
    if not tensors or not all(isinstance(t, torch.Tensor) and type(t) in _PLAIN and t.is_meta
                              and t.layout == torch.strided for t in tensors):
        return _RUN
    keys = [storage_key(t) for t in tensors]
    inputs = {storage_key(t) for t in arguments}
    if len(set(keys)) != len(keys) or inputs.intersection(keys):
        return _RUN
    if any(t.storage_offset() != 0
           or t.untyped_storage().nbytes() != storage_span(t.shape, t.stride()) * t.element_size() for t in tensors):
        return _RUN
    container = None if isinstance(out, torch.Tensor) else type(out)
    return container, tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype) for t in outputs)


def _remade(entry: Any) -> Any:
    container, specs = entry
    with without_function_modes():  # made as the kernel makes them: no function mode sees them
        outputs = [None if spec is None else torch.empty_strided(spec[0], spec[1], dtype=spec[2], device=_META)
                   for spec in specs]
    return outputs[0] if container is None else container(outputs)


def _check(func: Any, args: tuple, kwargs: dict, tensors: list, entry: Any) -> None:
    expected = _entry_of(func(*args, **kwargs), tensors)
    if expected != entry:
        raise AssertionError(f"kernel_cache: {func} remade {entry}, its kernel gives {expected}")
