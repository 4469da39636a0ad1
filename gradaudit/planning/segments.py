"""The sqrt(n) segments baseline: a stack of n blocks split into about sqrt(n) segments, each but
the last checkpointed as one region, as ``torch.utils.checkpoint.checkpoint_sequential`` does
(Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost": about sqrt(n) memory for one
extra forward). It applies where the blocks are the children of one ``nn.Sequential`` that runs them
with its own forward, and to a stack a model's loop runs (Hugging Face layers in an
``nn.ModuleList``) where each block is passed its predecessor's result and the same other tensors:
there the first block of a segment runs the segment (``loop_segmented``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import GradauditError
from .apply import Forwards, recomputed_as_run


def _stack(model: nn.Module, paths: Sequence[str], kind: type) -> Optional[tuple[str, nn.Module]]:
    """(its path, the container) of the ``kind`` container whose children are exactly ``paths``, in
    order; None when there is none."""
    if not paths:
        return None
    parent = paths[0].rpartition(".")[0]
    try:
        container = model.get_submodule(parent) if parent else model
    except AttributeError:
        return None
    prefix = f"{parent}." if parent else ""
    if not isinstance(container, kind) or [f"{prefix}{name}" for name, _ in container.named_children()] != list(paths):
        return None
    return parent, container


def sequential_parent(model: nn.Module, paths: Sequence[str]) -> Optional[str]:
    """The path of the ``nn.Sequential`` whose children are exactly ``paths``, in order, and which
    runs them with ``nn.Sequential.forward``; None when there is none."""
    found = _stack(model, paths, nn.Sequential)
    if found is None or type(found[1]).forward is not nn.Sequential.forward:
        return None
    return found[0]


def segment_ranges(n: int, segments: int) -> list[tuple[int, int]]:
    """(first, last) block of each segment, as checkpoint_sequential splits n functions: segments
    of n // segments blocks, the last one taking the rest."""
    size = n // segments
    ranges = [(start, start + size - 1) for start in range(0, size * (segments - 1), size)]
    ranges.append((ranges[-1][1] + 1 if ranges else 0, n - 1))
    return ranges


def square_root_segments(n: int) -> int:
    return max(1, round(math.sqrt(n)))


@contextlib.contextmanager
def segmented(container: nn.Sequential, segments: int) -> Iterator[list[tuple[int, int]]]:
    """``container`` runs its children in ``segments`` segments, each but the last under
    non-reentrant checkpoint (RNG preserved), as checkpoint_sequential would; restored afterwards.
    The regions are gradaudit's own (kept where the model's checkpointing is turned off)."""
    children = list(container.children())
    ranges = segment_ranges(len(children), segments)

    def run(first: int, last: int) -> Any:
        def segment(x: Any) -> Any:
            for child in children[first:last + 1]:
                x = child(x)
            return x

        return segment

    def forward(x: Any) -> Any:
        for first, last in ranges[:-1]:
            x = checkpoint(recomputed_as_run(run(first, last)), x, use_reentrant=False, preserve_rng_state=True)
        return run(*ranges[-1])(x)

    forwards = Forwards()
    forwards.replace(container, forward)
    try:
        yield ranges
    finally:
        forwards.restore()


# -- a stack a model's own loop runs (Hugging Face layers in an nn.ModuleList) ---------------------


def looped_stack(model: nn.Module, paths: Sequence[str], calls: Sequence[Any]) -> bool:
    """Whether ``paths`` are the children of one ``nn.ModuleList``, in order, each run once per
    forward in that order, each passed the first tensor its predecessor returned (first) and the
    same other tensors as its predecessor (a mask, position embeddings): the stack a loop such as
    ``for layer in self.layers: hidden = layer(hidden, mask, ...)`` runs. ``calls``: the audit's
    ``Report.module_calls`` of the paths."""
    if len(paths) < 2 or _stack(model, paths, nn.ModuleList) is None:
        return False
    if [c.path for c in calls] != list(paths):
        return False
    for before, after in zip(calls, calls[1:]):
        if not after.inputs or not before.outputs or after.inputs[0][0] != before.outputs[0][0]:
            return False
        if {s for s, _, _ in after.inputs[1:]} != {s for s, _, _ in before.inputs[1:]}:
            return False
    return True


class NotSegmentable(GradauditError):
    """A block of a looped stack was called with other tensors than its predecessor's result and
    arguments: the stack cannot run in segments."""


def _first_tensor(value: Any) -> Any:
    from ..tensors import iter_tensors

    return next(iter(iter_tensors(value)), None)


@contextlib.contextmanager
def loop_segmented(modules: Sequence[nn.Module], segments: int) -> Iterator[list[tuple[int, int]]]:
    """The blocks ``modules`` (a stack ``looped_stack`` accepted) run in ``segments`` segments, each
    but the last under one non-reentrant checkpoint, as checkpoint_sequential splits a stack: the
    first block of a segment runs the whole segment, passing each block the first tensor its
    predecessor returned and the first block's other arguments, and the others hand the model's
    loop the segment's result. A block called with other arguments than that raises (the figures
    would not be the stack's), so nothing is computed differently without a word. Restored
    afterwards."""
    from ..tensors import flatten

    ranges = segment_ranges(len(modules), segments)
    originals = [m.forward for m in modules]
    running: dict[int, tuple[Any, Any, list[Any]]] = {}  # segment -> (its result, that result's first tensor, the rest)

    def first_of(segment: int, first: int, last: int) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or not args:
                return originals[first](*args, **kwargs)
            tensors, fill, _ = flatten((args, kwargs))

            def run(*inputs: Any) -> Any:
                call_args, call_kwargs = fill(inputs)
                out = originals[first](*call_args, **call_kwargs)
                for k in range(first + 1, last + 1):
                    out = originals[k](_first_tensor(out), *call_args[1:], **call_kwargs)
                return out

            out = checkpoint(recomputed_as_run(run), *tensors, use_reentrant=False, preserve_rng_state=True)
            running[segment] = (out, _first_tensor(out), flatten((args[1:], kwargs))[0])
            return out

        return forward

    def handed_on(segment: int, k: int) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or not args:
                return originals[k](*args, **kwargs)
            out, hidden, rest = running.get(segment, (None, None, None))
            others = flatten((args[1:], kwargs))[0]
            if args[0] is not hidden or len(others) != len(rest) or any(a is not b for a, b in zip(others, rest)):
                raise NotSegmentable(f"block {k} of the stack was called with other tensors than the block before it "
                                     f"(or what that returned): this stack cannot be run in segments")
            return out

        return forward

    forwards = Forwards()
    for segment, (first, last) in enumerate(ranges[:-1]):
        forwards.replace(modules[first], first_of(segment, first, last))
        for k in range(first + 1, last + 1):
            forwards.replace(modules[k], handed_on(segment, k))
    try:
        yield ranges
    finally:
        forwards.restore()
