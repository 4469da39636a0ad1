"""What recomputing a block costs, counted: each candidate block's forward FLOPs (and of those, the
FLOPs a selective checkpoint does not redo) and one whole step's, as
``torch.utils.flop_counter.FlopCounterMode`` counts them with one FLOP per element for the ops torch has
no formula for (by its formulas, in a mode of gradaudit's that hooks the candidate blocks alone where
torch's module tracker hooks every module call and its tensors' gradients: an 80-layer Llama's counted
step +0.12 s over a plain one, +0.28 s with torch's mode; torch's mode itself where a block sits at two
paths or a higher-order op runs);
``Costs`` holds them per chain block (with ``cost="time"`` beside the forward times
timing.py measures) and prices any plan in FLOPs and seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from ..conditions import as_audited
from ..torchapi.dispatch import SIZE_QUERIES, TorchDispatchMode, first_overload_schema, is_higher_order, overload_packet
from .apply import kept_by_selective


@dataclass(frozen=True)
class Costs:
    """Each chain block's forward FLOPs (and of those, the FLOPs an op-level checkpoint does not
    redo) and, with cost="time", its measured forward nanoseconds: the figures of any plan,
    whichever of the two the solver minimised."""

    flops: tuple[int, ...]
    kept: tuple[int, ...]
    nanoseconds: Optional[tuple[int, ...]] = None

    @classmethod
    def of(cls, paths: Sequence[str], flops: dict[str, tuple[int, int]],
           nanoseconds: Optional[dict[str, int]]) -> "Costs":
        """The costs of the blocks ``paths`` (the chain's, in order) from ``count_flops``'s figures and,
        with cost="time", timing.measure's (None otherwise)."""
        return cls(tuple(flops.get(path, (0, 0))[0] for path in paths),
                   tuple(flops.get(path, (0, 0))[1] for path in paths),
                   tuple(nanoseconds.get(path, 0) for path in paths) if nanoseconds is not None else None)

    def extra_flops(self, chosen: Iterable[int], selective: Iterable[int] = ()) -> int:
        selective = set(selective)
        return sum(self.flops[i] - (self.kept[i] if i in selective else 0) for i in set(chosen))

    def extra_seconds(self, chosen: Iterable[int]) -> Optional[float]:
        if self.nanoseconds is None:
            return None
        return sum(self.nanoseconds[i] for i in set(chosen)) / 1e9

    def extra(self, chosen: Iterable[int], selective: Iterable[int] = ()) -> Union[int, float]:
        """In the cost's units: FLOPs, or seconds with cost="time" (whole blocks only)."""
        seconds = self.extra_seconds(chosen)
        return self.extra_flops(chosen, selective) if seconds is None else seconds


# ops that allocate without computing (their outputs are written by the next op) or only reinterpret
# an existing storage without saying so in their schema
_NO_WORK = frozenset(getattr(torch.ops.aten, name) for name in (
    "_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
    "_reshape_alias", "set_", "resize_") if hasattr(torch.ops.aten, name))


def _writes_nothing(op: Any) -> bool:
    """Whether ``op`` (an overload packet) makes no new elements: a view or an allocation only."""
    if op in _NO_WORK:
        return True
    schema = first_overload_schema(op)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _elements(*_: Any, out_val: Any = None, **__: Any) -> int:
    from ..tensors import iter_tensors

    return sum(t.numel() for t in iter_tensors(out_val))


def _none(*_: Any, **__: Any) -> int:
    return 0


class _EveryOp(dict):
    """FlopCounterMode's formula table, answering for every op: torch's formula where it has one
    (matrix products, convolutions, attention), else one FLOP per element the op writes. Torch
    counts those ops (activations, norms, softmax, elementwise arithmetic) as 0, which would make
    recomputing them look free; they are memory-bound, and the elements they write are the
    nearest FLOP-like measure of their cost."""

    def __contains__(self, op: object) -> bool:
        return True

    def __missing__(self, op: Any) -> Any:
        formula = _none if _writes_nothing(op) else _elements
        self[op] = formula
        return formula


def counting() -> Any:
    """A FlopCounterMode that counts every op (``_EveryOp``), displaying nothing."""
    from torch.utils.flop_counter import FlopCounterMode

    mode = FlopCounterMode(display=False)
    registry = _EveryOp(mode.flop_registry)
    for op, formula in list(registry.items()):
        if "scaled_dot_product" in str(op):
            registry[op] = _query_heads_for_grouped(formula)
    mode.flop_registry = registry
    return mode


def _query_heads_for_grouped(formula: Callable[..., int]) -> Callable[..., int]:
    """An attention op's FLOP formula that counts grouped-query attention (fewer key/value heads than
    query heads, as the kernels take them with ``enable_gqa``) as the kernel computes it, every
    key/value head broadcast to its query heads: torch 2.11's formulas refuse the shapes (later ones
    count them so). Its tensors are laid out (batch, heads, sequence, features)."""

    def count(*args: Any, **kwargs: Any) -> int:
        try:
            return formula(*args, **kwargs)
        except AssertionError:
            shaped = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
            heads = max((a.shape[1] for a in shaped), default=0)
            if not shaped or any(heads % a.shape[1] for a in shaped):
                raise
            return formula(*(torch.empty(a.shape[0], heads, *a.shape[2:], dtype=a.dtype, device="meta")
                             if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args), **kwargs)

    return count


class _Fallback(Exception):
    """A higher-order operator reached the counter: torch's FlopCounterMode counts the step instead."""


class _Counting(TorchDispatchMode):
    """Counts what ``counting()``'s FlopCounterMode counts, without its module tracker: each op's FLOPs by
    the same formulas (``_EveryOp``), in all and for each of the modules ``paths`` names whose forward
    is running (forward hooks on those modules alone, where the tracker hooks every module's call and
    its inputs' and outputs' gradients; the same set of names, entered and left as it enters and leaves
    them). A higher-order operator raises ``_Fallback``: torch's mode handles those differently by release."""

    supports_higher_order_operators = True  # (they reach the handler, which hands them to torch's mode)

    def __init__(self, model: Optional[nn.Module] = None, paths: Sequence[str] = ()) -> None:
        super().__init__()
        self.registry = counting().flop_registry
        self.total = 0
        self.per_path: dict[str, dict[Any, int]] = {path: {} for path in paths}
        self._running: set[str] = set()
        self._inside: tuple[dict[Any, int], ...] = ()
        self._handles: list[Any] = []
        self._model, self._paths = model, tuple(paths)

    def __enter__(self) -> "_Counting":
        modules = dict(self._model.named_modules()) if self._model is not None else {}
        for path in self._paths:
            if path in modules:
                self._watch(modules[path], path)
        return super().__enter__()

    def _watch(self, module: nn.Module, path: str) -> None:
        # (first among the module's own hooks, as the tracker's global hooks come before them)
        def enter(*_: Any) -> None:
            self._running.add(path)
            self._inside = tuple(self.per_path[p] for p in self._running)

        def leave(*_: Any) -> None:
            self._running.discard(path)
            self._inside = tuple(self.per_path[p] for p in self._running)

        self._handles += [module.register_forward_pre_hook(enter, prepend=True),
                          module.register_forward_hook(leave, prepend=True, always_call=True)]

    def __exit__(self, *exc: Any) -> Any:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._running.clear()
        self._inside = ()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func in SIZE_QUERIES:
            return NotImplemented
        if is_higher_order(func):
            raise _Fallback(str(func))
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = overload_packet(func)
        flops = self.registry[packet](*args, **kwargs, out_val=out)
        self.total += flops
        for counts in self._inside:
            counts[packet] = counts.get(packet, 0) + flops
        return out


def _shared(model: nn.Module, paths: Sequence[str]) -> bool:
    """Whether one of the modules ``paths`` names sits at more than one path (the tracker names it by
    one of them: torch's mode counts those)."""
    seen: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        seen[id(module)] = seen.get(id(module), 0) + 1
    modules = dict(model.named_modules())
    return any(seen.get(id(modules[p]), 0) > 1 for p in paths if p in modules)


def count_flops(model: nn.Module, inputs: Any, trainable: Any, frozen: Any, target: str,
                paths: Sequence[str], loss: Optional[Callable[[Any], torch.Tensor]] = None,
                step: Optional[Callable[[Callable[[str], Any]], Any]] = None) -> tuple[dict[str, tuple[int, int]], int]:
    """(forward FLOPs, of which in ops a selective checkpoint keeps) of each module in ``paths`` (all its calls) and the
    FLOPs of one whole step as a training loop runs it (the forward, ``loss`` of its output, or the
    default loss, and that loss's backward), as torch.utils.flop_counter counts them plus one per
    element for the ops it has no formula for; the model is left as found.

    ``step(watch)``: where given, runs that step itself (the planner's unplanned peak probe, which
    measures its peak in the same run), with ``watch(phase)`` in force around its forward ("forward")
    and its loss and backward ("backward"); the loss's FLOPs count in the step's either way."""
    if not _shared(model, paths):
        try:
            forward, backward = _Counting(model, paths), _Counting()
            _count_step(model, inputs, trainable, frozen, target, loss, step, forward, backward)
            return ({path: (sum(ops.values()), sum(n for op, n in ops.items() if kept_by_selective(op)))
                     for path, ops in forward.per_path.items()}, forward.total + backward.total)
        except _Fallback:
            pass  # (the step runs again, counted by torch's mode)
    forward, backward = counting(), counting()
    _count_step(model, inputs, trainable, frozen, target, loss, step, forward, backward)
    counts = forward.get_flop_counts()
    root = type(model).__name__
    per_module = {}
    for path in paths:
        ops = counts.get(f"{root}.{path}", {})
        per_module[path] = (sum(ops.values()), sum(n for op, n in ops.items() if kept_by_selective(op)))
    step_flops = forward.get_total_flops() + backward.get_total_flops()
    return per_module, step_flops


def _count_step(model: nn.Module, inputs: Any, trainable: Any, frozen: Any, target: str, loss: Any, step: Any,
                forward: Any, backward: Any) -> None:
    """Run the step ``count_flops`` counts, ``forward`` and ``backward`` (counting modes) in force around
    its two phases."""
    from ..tensors import default_loss, split_inputs

    if step is not None:
        step(lambda phase: forward if phase == "forward" else backward)
        return
    args, kwargs = split_inputs(inputs)
    with as_audited(model, inputs, trainable, frozen, target):
        with forward:
            value = (loss or default_loss)(model(*args, **kwargs))
        with backward:
            if value.requires_grad:
                value.backward()
        del value
