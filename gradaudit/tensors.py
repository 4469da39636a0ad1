"""Small tensor and storage helpers every stage may import (below them only gradaudit.torchapi).

Inputs as the caller gives them (a tensor, a tuple, a dict, ``Args``), tensors nested in outputs, and the
identity and extent of storages: the recorder, the analysis, the proof, the measurements and
``trim`` all count bytes by storage, with one key and one span formula.
"""

from __future__ import annotations

import dataclasses
from itertools import repeat
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from .errors import GradauditError
from .torchapi.dispatch import register_pytree_node
from .torchapi.distributed import local_of
from .torchapi.modules import module_slots
from .torchapi.storages import sparse_coo_parts, storage_key

_PLAIN = (torch.Tensor, torch.nn.Parameter)

__all__ = ["Args", "split_inputs", "iter_tensors", "flatten", "holds_tensors", "unique", "storage_key", "storage_span", "strided_parts",
           "dtype_name", "itemsize", "tensor_attributes", "ModelTree"]


class Args:
    """Positional and keyword arguments together, for a call that takes both:
    ``gradaudit.Args(batch, target=labels)`` stands for ``model(batch, target=labels)`` (or, given with a
    pipeline schedule, ``schedule.step(batch, target=labels)``: the rank of a V-shaped schedule runs the
    first stage and the last). A tuple alone is positional arguments, a dict alone keyword arguments."""

    __slots__ = ("args", "kwargs")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __repr__(self) -> str:
        return f"Args({', '.join([*map(repr, self.args), *(f'{k}={v!r}' for k, v in self.kwargs.items())])})"


# what maps over inputs (to meta, scaled, ...) maps over an Args' arguments
register_pytree_node(Args, lambda a: ([a.args, a.kwargs], None), lambda children, _: Args(*children[0], **children[1]))


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Tensor -> one positional argument; tuple -> positional arguments; dict -> keyword arguments;
    ``Args`` -> its positional and keyword arguments.

    Anything else (a list, a custom object) is passed as one positional argument.
    """
    if isinstance(inputs, Args):
        return inputs.args, dict(inputs.kwargs)
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
    elif isinstance(value, Args):
        yield from iter_tensors((value.args, value.kwargs), _depth + 1)
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
    value tensors; for a DTensor, its local shard's."""
    if type(t) not in _PLAIN:
        t = local_of(t)
    if t.layout == torch.strided:
        return [t]
    if t.layout == torch.sparse_coo:
        return sparse_coo_parts(t)
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    """``torch.float32`` -> ``"float32"`` (``"unknown"`` for None)."""
    if dtype is None:
        return "unknown"
    name = _DTYPE_NAMES.get(dtype)
    if name is None:  # a few dtypes exist: each is named once
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def itemsize(dtype: Optional[torch.dtype]) -> int:
    return dtype.itemsize if dtype is not None else 0


_NOT_ATTRIBUTES = frozenset({"_parameters", "_buffers", "_modules"})  # registered state and submodules
_PLAIN = frozenset({int, float, bool, str, type(None)})  # attribute values that hold no tensor
_module_internals: Optional[frozenset] = None


def _internal_attributes() -> frozenset:
    """The attributes ``nn.Module.__init__`` sets that never hold a tensor attribute: the flags and
    the hook dictionaries (whose values are hooks), and the registered state (``_NOT_ATTRIBUTES``).
    Most of every module's ``__dict__``; skipping them by one set difference is what makes
    ``tensor_attributes`` cheap."""
    global _module_internals
    if _module_internals is None:
        bare = vars(torch.nn.Module())
        _module_internals = frozenset(name for name, value in bare.items()
                                      if not isinstance(value, (torch.Tensor, list, tuple))) | _NOT_ATTRIBUTES
    return _module_internals


def tensor_attributes(model: "torch.nn.Module", modules: Optional[Sequence[tuple[str, "torch.nn.Module"]]] = None
                      ) -> list[tuple[str, torch.Tensor]]:
    """(``module.attribute``, tensor) for the plain tensor attributes of the model's modules (also
    inside a list, tuple or dict), module by module and, within a module, in attribute order.

    ``modules``: ``list(model.named_modules())`` when the caller has it already (``ModelTree``).
    """
    found = []
    tensor, plain, internal = torch.Tensor, _PLAIN, _internal_attributes()
    for path, module in (model.named_modules() if modules is None else modules):
        attributes = vars(module)
        hits = None
        # the module's own attributes only (a set: their order is restored below when it matters)
        for name in attributes.keys() - internal:
            value = attributes[name]
            if type(value) in plain:  # cheap type tests first: most attributes are numbers and flags
                continue
            if isinstance(value, tensor):
                held = (value,)
            elif isinstance(value, (list, tuple, dict)) and value:
                items = value.values() if isinstance(value, dict) else value
                if not any(map(isinstance, items, repeat(tensor))):
                    continue
                held = [v for v in items if isinstance(v, tensor)]
            else:
                continue
            if hits is None:
                hits = []
            hits.append((name, held))
        if hits is None:
            continue
        if len(hits) > 1:  # attribute order, as vars() lists them
            order = {name: i for i, name in enumerate(attributes)}
            hits.sort(key=lambda hit: order[hit[0]])
        for name, held in hits:
            where = f"{path}.{name}" if path else name
            found.extend((where, v) for v in held)
    return found


# the methods whose default behaviour ModelTree reproduces from one named_modules() walk
_WALK_METHODS = ("modules", "named_parameters", "parameters", "_named_members", "named_buffers", "buffers")


class ModelTree:
    """One walk of a model's module tree: ``named_modules()``, ``modules()``, ``named_parameters()``
    and ``buffers()`` as lists, as they are when it is taken.

    An audit takes one before the forward and one after it (a forward may replace a submodule or
    materialise a lazy parameter), and its stages read those instead of walking the tree again.
    Parameters and buffers come from the modules' own dictionaries in the order and with the
    de-duplication of ``nn.Module._named_members``; a model class that overrides one of those
    methods gets its own methods called instead.
    """

    def __init__(self, model: "torch.nn.Module") -> None:
        self.modules: list[tuple[str, torch.nn.Module]] = list(model.named_modules())
        cls, base = type(model), torch.nn.Module
        if all(getattr(cls, name, None) is getattr(base, name) for name in _WALK_METHODS):
            self.module_list: list[torch.nn.Module] = [m for _, m in self.modules]
            self.parameters: list[tuple[str, torch.nn.Parameter]] = self._members(0)
            self.buffers: list[torch.Tensor] = [b for _, b in self._members(1)]
        else:
            self.module_list = list(model.modules())
            self.parameters = list(model.named_parameters())
            self.buffers = list(model.buffers())

    def _members(self, slot: int) -> list[tuple[str, Any]]:
        """(name, tensor) from every module's parameters (slot 0) or buffers (slot 1), each object
        once (torch compares them by identity too)."""
        seen: set[int] = set()
        found = []
        for prefix, module in self.modules:
            for name, value in module_slots(module)[slot].items():
                if value is None or id(value) in seen:
                    continue
                seen.add(id(value))
                found.append((f"{prefix}.{name}" if prefix else name, value))
        return found


def first_meta_parameter(parameters: Any) -> Optional[torch.Tensor]:
    """The first meta parameter, else the first parameter (None without any): a model built on meta
    may keep a stray parameter on the CPU."""
    first = None
    for p in parameters:
        if p.is_meta:
            return p
        if first is None:
            first = p
    return first


def default_loss(output: Any) -> torch.Tensor:
    """The loss a training loop takes from a model's output when none is given: the output's ``loss``
    (Hugging Face models given labels) when it has one, else the sum of its first tensor."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = next(iter_tensors(output), None)
    if first is None:
        raise GradauditError("the model's output holds no tensor to take a loss from: pass loss=fn(output) -> scalar")
    return first.sum()


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
