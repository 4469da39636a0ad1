"""An independent measurement of what autograd holds, for tests and benchmarks.

It shares nothing with the recorder: a TorchDispatchMode weak-references every storage that any op
produces during a plain forward (no saved-tensor hooks). After the forward, with the caller's
references to the outputs dropped, the storages still alive are held by the autograd graph.

One thing no op produces: a Python number passed where an op takes a tensor (``0.5 * x``) becomes a
0-dim "wrapped number" tensor before dispatch, and autograd may save it (8 bytes each). Those are
found by reading the graph's saved attributes plainly (no saved-tensor hooks are installed here).
"""

from __future__ import annotations

import contextlib
import copy
import gc
from typing import Any, Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import torchapi
from .tensors import iter_tensors, split_inputs, storage_key, strided_parts, unique
from .torchapi import TorchDispatchMode, storage_id, tree_flatten


class StorageTracker(TorchDispatchMode):
    """Weak-references every storage produced by an op while active."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        storages = self.storages
        for t in op_leaves(out):
            if isinstance(t, torch.Tensor):
                for part in strided_parts(t):
                    storage = part.untyped_storage()
                    key = storage_id(storage)  # a StorageWeakRef's cdata: made only for a new storage
                    if key not in storages:
                        storages[key] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self, exclude: set[int]) -> int:
        return sum(nbytes for cdata, (ref, nbytes) in self.storages.items()
                   if not ref.expired() and cdata not in exclude)


def op_leaves(out: Any) -> Any:
    """``tree_flatten(out)[0]`` for an op's output: a tensor, or a plain tuple or list of tensors
    (and numbers, None) as they are; anything nested through pytree."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if type(out) in (tuple, list) and not any(isinstance(v, _NESTED) for v in out):
        return out
    return tree_flatten(out)[0]


_NESTED = (tuple, list, dict)


def held_bytes_after_forward(model: torch.nn.Module, inputs: Any, *, young_only: bool = False) -> int:
    """Bytes the autograd graph keeps alive after ``model(inputs)``, measured without gradaudit.

    Parameters, buffers and the inputs are excluded (alive anyway). The outputs themselves are
    dropped first, so an output storage counts only if a backward node saved it.

    The outputs may sit in reference cycles, so a garbage collection runs after they are dropped.
    ``young_only``: it looks only at the objects made since the forward began (``gc.freeze()``
    sets the older ones aside), not at every object of the process: a full collection costs tens
    of milliseconds once a library like transformers is imported, more than a small forward. It
    misses only a garbage cycle that runs through an object older than the forward (one the
    forward made unreachable). Unused while the process has frozen objects of its own.
    """
    args, kwargs = split_inputs(inputs)
    exclude = {storage_key(t)  # a StorageWeakRef's cdata, without making one
               for t in [*model.parameters(), *model.buffers(), *iter_tensors((args, kwargs))]}
    tracker = StorageTracker()
    freeze = young_only and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        with tracker:
            output = model(*args, **kwargs)
        roots = [t.grad_fn for t in iter_tensors(output) if t.grad_fn is not None]
        del output
        gc.collect()
    finally:
        if freeze:
            gc.unfreeze()
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
        # the packed objects, never the unpacked values: unpacking a checkpointed slot would
        # recompute its block; a slot packed by anybody's hooks holds no plain tensor here
        for _, raw in torchapi.raw_saved_slots(node):
            value = raw.data
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.dim() == 0:
                    yield t


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


def forward_backward(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int]:
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
        tracker = PeakTracker({storage_key(t) for t in
                               [*model.parameters(), *model.buffers(), *iter_tensors((args, kwargs))]})
        tracker.__enter__()
    try:
        output = model(*args, **kwargs)
        outputs = unique([t for t in iter_tensors(output) if t.requires_grad and t.grad_fn is not None])
        del output
        gc.collect()
        output_bytes = sum(t.untyped_storage().nbytes() for t in
                           {storage_key(t): t for t in outputs}.values())
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




def measured_step_peak(model: torch.nn.Module, inputs: Any, make_optimizer: Callable[[Any], torch.optim.Optimizer],
                       loss_fn: Callable[[Any], torch.Tensor], autocast: Optional[torch.dtype] = None) -> int:
    """The peak bytes alive through one steady-state training step of ``model`` on ``inputs`` on the CPU,
    measured as a training loop runs it: a warm-up step (the optimizer's state exists afterwards),
    then forward, loss, backward and the optimizer step under a PeakTracker, plus what is alive
    throughout (parameters, buffers, the batch, the optimizer's state), counted by storage. It
    shares nothing with gradaudit.fit's own following of the step (fitting/). The model trains for
    real; its weights (and buffers) are put back afterwards."""
    args, kwargs = split_inputs(inputs)
    weights = copy.deepcopy(model.state_dict())
    # the parameters that train; where none does, the inputs that require grad (an adversarial loop)
    inputs_optimized = [t for t in iter_tensors((args, kwargs)) if t.is_leaf and t.requires_grad]
    optimized = [p for p in model.parameters() if p.requires_grad] or inputs_optimized
    originals = [t.detach().clone() for t in inputs_optimized]
    optimizer = make_optimizer(optimized)

    def forward() -> torch.Tensor:
        region = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with region:
            output = model(*args, **kwargs)
            loss = loss_fn(output)
        del output
        gc.collect()
        return loss

    loss = forward()  # warm-up: the optimizer's state exists afterwards
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del loss
    always = {}
    state = [t for values in optimizer.state.values() for t in iter_tensors(values)]
    for t in [*model.parameters(), *model.buffers(), *iter_tensors((args, kwargs)), *state]:
        always[storage_key(t)] = t.untyped_storage().nbytes()
    tracker = PeakTracker(set(always))
    with tracker:
        loss = forward()
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del loss
    model.load_state_dict(weights)
    with torch.no_grad():
        for t, original in zip(inputs_optimized, originals):
            t.copy_(original)
            t.grad = None
    return sum(always.values()) + tracker.peak
