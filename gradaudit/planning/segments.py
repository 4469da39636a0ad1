"""The sqrt(n) segments baseline: a stack of n blocks split into about sqrt(n) segments, each but
the last checkpointed as one region, as ``torch.utils.checkpoint.checkpoint_sequential`` does
(Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost": about sqrt(n) memory for one
extra forward). It applies where the blocks are the children of one ``nn.Sequential`` that runs them
with its own forward; a stack called by a model's loop (Hugging Face layers) has no such lever.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional, Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import torchapi


def sequential_parent(model: nn.Module, paths: Sequence[str]) -> Optional[str]:
    """The path of the ``nn.Sequential`` whose children are exactly ``paths``, in order, and which
    runs them with ``nn.Sequential.forward``; None when there is none."""
    if not paths:
        return None
    parent = paths[0].rpartition(".")[0]
    try:
        container = model.get_submodule(parent) if parent else model
    except AttributeError:
        return None
    if not isinstance(container, nn.Sequential) or type(container).forward is not nn.Sequential.forward:
        return None
    prefix = f"{parent}." if parent else ""
    if [f"{prefix}{name}" for name, _ in container.named_children()] != list(paths):
        return None
    return parent


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

        setattr(segment, torchapi.KEEP_CHECKPOINTING, True)
        return segment

    def forward(x: Any) -> Any:
        for first, last in ranges[:-1]:
            x = checkpoint(run(first, last), x, use_reentrant=False, preserve_rng_state=True)
        return run(*ranges[-1])(x)

    own = container.__dict__.get("forward")
    container.forward = forward
    try:
        yield ranges
    finally:
        if own is None:
            container.__dict__.pop("forward", None)
        else:
            container.forward = own
