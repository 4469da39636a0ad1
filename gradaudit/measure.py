"""An independent measurement of what autograd holds, for tests and benchmarks.

It shares nothing with the recorder: a TorchDispatchMode weak-references every storage that any op
produces during a plain forward (no saved-tensor hooks). After the forward, with the caller's
references to the outputs dropped, the storages still alive are held by the autograd graph.

One thing no op produces: a Python number passed where an op takes a tensor (``0.5 * x``) becomes a
0-dim "wrapped number" tensor before dispatch, and autograd may save it (8 bytes each). Those are
found by reading the graph's saved attributes plainly (no saved-tensor hooks are installed here).
"""

from __future__ import annotations

import gc
from typing import Any, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


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
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    return []


class StorageTracker(TorchDispatchMode):
    """Weak-references every storage produced by an op while active."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for part in strided_parts(t):
                    storage = part.untyped_storage()
                    ref = StorageWeakRef(storage)
                    self.storages.setdefault(ref.cdata, (ref, storage.nbytes()))
        return out

    def live_bytes(self, exclude: set[int]) -> int:
        return sum(nbytes for cdata, (ref, nbytes) in self.storages.items()
                   if not ref.expired() and cdata not in exclude)


def held_bytes_after_forward(model: torch.nn.Module, inputs: Any) -> int:
    """Bytes the autograd graph keeps alive after ``model(inputs)``, measured without gradaudit.

    Parameters, buffers and the inputs are excluded (alive anyway). The outputs themselves are
    dropped first, so an output storage counts only if a backward node saved it.
    """
    from .auditing import iter_tensors, split_inputs

    args, kwargs = split_inputs(inputs)
    exclude = {StorageWeakRef(t.untyped_storage()).cdata
               for t in [*model.parameters(), *model.buffers(), *iter_tensors((args, kwargs))]}
    tracker = StorageTracker()
    with tracker:
        output = model(*args, **kwargs)
    roots = [t.grad_fn for t in iter_tensors(output) if t.grad_fn is not None]
    del output
    gc.collect()
    held = tracker.live_bytes(exclude)
    seen = set(tracker.storages) | exclude
    for t in _saved_scalars(roots):
        ref = StorageWeakRef(t.untyped_storage())
        if ref.cdata not in seen:
            seen.add(ref.cdata)
            held += t.untyped_storage().nbytes()
    del roots
    return held


def _saved_scalars(roots: list[Any]) -> Any:
    """0-dim tensors saved by the graph under ``roots`` (wrapped Python numbers among them)."""
    stack, visited = list(roots), set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        stack.extend(fn for fn, _ in node.next_functions)
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except Exception:  # released or unreadable slots hold nothing
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.dim() == 0:
                    yield t
