"""Small tensor and storage helpers every stage may import (below them only gradaudit.torchapi).

Inputs as the caller gives them (a tensor, a tuple, a dict), tensors nested in outputs, and the
identity and extent of storages: the recorder, the analysis, the proof, the measurements and
``trim`` all count bytes by storage, with one key and one span formula.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from .torchapi import sparse_coo_parts, storage_key

__all__ = ["split_inputs", "iter_tensors", "flatten", "holds_tensors", "unique", "storage_key", "storage_span", "strided_parts",
           "dtype_name", "itemsize", "tensor_attributes"]


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Tensor -> one positional argument; tuple -> positional arguments; dict -> keyword arguments.

    Anything else (a list, a custom object) is passed as one positional argument.
    """
    if isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):
        return inputs, {}
    if isinstance(inputs, dict):
        return (), dict(inputs)
    return (inputs,), {}


def iter_tensors(value: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts, dataclasses and ModelOutput objects."""
    if _depth > 20:
        return
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):  # includes transformers' ModelOutput (an OrderedDict)
        for v in value.values():
            yield from iter_tensors(v, _depth + 1)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_tensors(v, _depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from iter_tensors(getattr(value, f.name, None), _depth + 1)
    elif hasattr(value, "to_tuple") and callable(value.to_tuple):
        yield from iter_tensors(value.to_tuple(), _depth + 1)


class _Slot:
    """Where the n-th tensor goes back into the arguments."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


def flatten(value: Any) -> tuple[list[torch.Tensor], Callable[[tuple], Any], list[Any]]:
    """The tensors inside ``value`` (through tuples, named tuples, lists and plain dicts), a function
    that puts new tensors back in their places, and the other objects in it that hold tensors
    (``holds_tensors``: a cache object, a dataclass, a dict subclass), which are left as they are."""
    tensors: list[torch.Tensor] = []
    opaque: list[Any] = []

    def strip(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return _Slot(len(tensors) - 1)
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            return type(v)(*[strip(x) for x in v])
        if type(v) in (tuple, list):
            return type(v)(strip(x) for x in v)
        if type(v) is dict:
            return {k: strip(x) for k, x in v.items()}
        if holds_tensors(v):
            opaque.append(v)
        return v

    skeleton = strip(value)

    def fill(new: tuple, v: Any = skeleton) -> Any:
        if isinstance(v, _Slot):
            return new[v.n]
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            return type(v)(*[fill(new, x) for x in v])
        if type(v) in (tuple, list):
            return type(v)(fill(new, x) for x in v)
        if type(v) is dict:
            return {k: fill(new, x) for k, x in v.items()}
        return v

    return tensors, fill, opaque


def holds_tensors(value: Any, _depth: int = 0) -> bool:
    """Whether tensors are reachable from ``value`` through containers and object attributes (a
    few levels deep; modules, whose tensors are parameters and buffers, do not count)."""
    if _depth > 4 or isinstance(value, (torch.nn.Module, type)):
        return False
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(holds_tensors(v, _depth + 1) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(holds_tensors(v, _depth + 1) for v in value)
    attributes = getattr(value, "__dict__", None)
    return isinstance(attributes, dict) and any(holds_tensors(v, _depth + 1) for v in attributes.values())


def unique(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in order, each object once."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def storage_span(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements a strided layout reaches, from its first element to its last (0 when empty)."""
    if any(size == 0 for size in shape):
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride))


def strided_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors holding a tensor's memory: itself, or a sparse tensor's index and
    value tensors."""
    if t.layout == torch.strided:
        return [t]
    if t.layout == torch.sparse_coo:
        return sparse_coo_parts(t)
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    """``torch.float32`` -> ``"float32"`` (``"unknown"`` for None)."""
    return str(dtype).replace("torch.", "") if dtype is not None else "unknown"


def itemsize(dtype: Optional[torch.dtype]) -> int:
    return dtype.itemsize if dtype is not None else 0


_NOT_ATTRIBUTES = frozenset({"_parameters", "_buffers", "_modules"})  # registered state and submodules


def tensor_attributes(model: "torch.nn.Module") -> list[tuple[str, torch.Tensor]]:
    """(``module.attribute``, tensor) for the plain tensor attributes of the model's modules (also
    inside a list, tuple or dict)."""
    found = []
    tensor, containers = torch.Tensor, (list, tuple, dict)
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            # cheap type tests first: most attributes are neither tensors nor containers, and most
            # containers (the hook dicts) are empty
            if isinstance(value, tensor):
                found.append((f"{path}.{name}" if path else name, value))
            elif isinstance(value, containers) and value and name not in _NOT_ATTRIBUTES:
                items = value.values() if isinstance(value, dict) else value
                held = [v for v in items if isinstance(v, tensor)]
                if held:
                    where = f"{path}.{name}" if path else name
                    found.extend((where, v) for v in held)
    return found
