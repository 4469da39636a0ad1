"""The largest batch (or sequence length) whose step fits: the batch scaled along one dimension (its
rows repeated in turn, so a padded batch stays padded alike; for a pipeline stage, its micro-batch, their
count or their sequence, the schedule rebuilt at each: fitting/pipeline.py), the step's peak measured at two sizes,
the affine guess between them and its neighbour, then the line through the two sizes either side of the
answer, halving where that does not halve the range, until n fits and n+1 does not. On meta nothing is
computed, so each measurement costs a forward and backward of shapes only.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..errors import GradauditError
from ..tensors import iter_tensors
from ..torchapi.dispatch import tree_map
from ..torchapi.storages import storage_key
from ..collecting import collecting_only_new

DIMENSIONS = {"batch": 0, "seq": 1}
MOST_STEPS = 40  # measurements before giving up on the search (halving 2 ** 24 takes 24)
MOST_SIZE = 2 ** 24  # the largest batch or sequence searched: a memory that holds more does not bound it


def scaled(inputs: Any, dimension: int, size: int, new: int) -> Any:
    """``inputs`` with every tensor whose ``dimension`` has ``size`` entries resized to ``new``
    along it, by repeating its entries in turn (values kept, on meta too). Tensors that are one tensor
    (``{"input_ids": ids, "labels": ids}``, as causal-LM batches often are), or views of one storage
    alike in offset, shape and strides, stay one tensor: their bytes are counted once, as the batch's
    were. Views of one storage that differ (``ids`` and ``ids[:, 1:]``) become tensors of their own."""
    from ..values import knowing_values

    made: dict[tuple, torch.Tensor] = {}

    def resize(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() <= dimension or t.shape[dimension] != size:
            return t
        key = (storage_key(t), t.storage_offset(), t.shape, t.stride(), t.dtype, t.requires_grad)
        if key not in made:
            index = torch.arange(new, device=t.device) % size
            out = t.detach().index_select(dimension, index)
            made[key] = out.requires_grad_(t.requires_grad) if t.requires_grad else out
        return made[key]

    with knowing_values():
        return tree_map(resize, inputs)


def size_of(inputs: Any, dimension: int) -> int:
    sizes = {t.shape[dimension] for t in iter_tensors(inputs) if t.dim() > dimension}
    if not sizes:
        raise GradauditError(f"no input tensor has a dimension {dimension} to scale")
    # the batch's own size: that of the first tensor (ids, images) along the dimension
    return next(t.shape[dimension] for t in iter_tensors(inputs) if t.dim() > dimension)


class InputSizes:
    """What ``Fit.largest`` scales for a module's step: its inputs along the batch (dimension 0) or the
    sequence (dimension 1), each size measured by ``peak_of_inputs`` (the step's peak and headroom)."""

    dimensions = ("batch", "seq")

    def __init__(self, peak_of_inputs: Callable[[Any], tuple[int, int]], inputs: Any,
                 floor: Optional[int] = None) -> None:
        self.peak_of_inputs, self.inputs = peak_of_inputs, inputs
        # what the step of every size holds at its peak at least, where known (None): the parameters,
        # buffers, optimizer state and gradients, none of which scales with the inputs when no input
        # requires grad (Figures.floor_bytes)
        self.floor = floor if not any(t.requires_grad for t in iter_tensors(inputs)) else None

    def size(self, dimension: str) -> int:
        return size_of(self.inputs, DIMENSIONS[dimension])

    def most(self, dimension: str) -> Optional[int]:
        return None

    def named(self, dimension: str, n: int) -> str:
        """``n`` along ``dimension`` in words, where the number alone does not say it (here it does)."""
        return ""

    def measure(self, dimension: str, n: int) -> tuple[int, int]:
        axis = DIMENSIONS[dimension]
        try:
            return self.peak_of_inputs(scaled(self.inputs, axis, size_of(self.inputs, axis), n))
        except RuntimeError as error:  # torch.OutOfMemoryError is one too
            if "memory" not in str(error):
                raise
            raise GradauditError(f"the step at {dimension} {n} ran out of this machine's memory "
                                 f"({str(error).splitlines()[0][:160]}): fit on the meta device (--device meta, "
                                 f"gradaudit.meta_device()) to search sizes this machine cannot run") from None


class Unbounded(GradauditError):
    """The step's peak does not bound the size: it does not grow with it, or fits at the most searched."""


@collecting_only_new()  # (its steps' garbage collections look at what it made, not at the model)
def largest(fit: Any, dimension: str, progress: Optional[Callable[[str], None]] = None) -> int:
    """The largest size along ``dimension`` whose step peaks within ``fit.memory`` (0 when even 1 does not);
    every answer is measured: n fits and n+1 does not (0 where what no size changes passes the memory
    alone, ``InputSizes.floor``, with no step run). A module's step scales "batch" and "seq", a pipeline
    stage's "batch" (its micro-batch), "seq" and "micro_batches" (fitting/pipeline.py)."""
    return search(fit, dimension, progress)[0]


def search(fit: Any, dimension: str, progress: Optional[Callable[[str], None]] = None
           ) -> tuple[int, Optional[int], int]:
    """(the largest size that fits, its step's peak (None for 0), the size fitted); ``progress`` is told
    each size measured."""
    sizes = fit.live.size_search
    if sizes is None:
        raise GradauditError("this Fit cannot search sizes: its model is gone; fit again")
    if dimension not in sizes.dimensions:
        raise GradauditError(f"largest() scales {' or '.join(repr(d) for d in sizes.dimensions)} here, not "
                             f"{dimension!r}")
    size = sizes.size(dimension)
    steps = Steps(fit, sizes, dimension, size, progress)
    if not steps.fits(size):
        if getattr(sizes, "floor", None) is not None and sizes.floor > fit.memory:
            return 0, None, size  # what no size changes passes the memory alone: no step is run
        low, high = 0, size  # 0: "nothing fits" until 1 is measured
    else:
        low, high = _bracket(steps, size)
    low = _narrow(steps, low, high)
    return low, steps.measured[low][0] if low in steps.measured else None, size


class Steps:
    """The steps measured for one search, by size: their peaks and what they need with the headroom."""

    def __init__(self, fit: Any, sizes: Any, dimension: str, size: int,
                 progress: Optional[Callable[[str], None]] = None) -> None:
        self.sizes, self.dimension, self.memory = sizes, dimension, fit.memory
        self.progress = progress
        most = sizes.most(dimension)
        self.most = MOST_SIZE if most is None else most
        self.measured: dict[int, tuple[int, int]] = {size: (fit.peak_bytes, fit.peak_bytes + fit.headroom)}

    def need(self, n: int) -> int:
        """What the step of size ``n`` needs: its peak and its headroom."""
        if n not in self.measured:
            if len(self.measured) > MOST_STEPS:
                raise GradauditError(f"the largest {self.dimension} was not found in {MOST_STEPS} steps: the "
                                     f"peak is far from affine in it")
            if self.progress is not None:
                self.progress(f"searching the largest {self.dimension}: measuring a step at {n:,} "
                              f"({len(self.measured)} measured, at most {MOST_STEPS + 1})")
            step_peak, headroom = self.sizes.measure(self.dimension, n)
            self.measured[n] = (step_peak, step_peak + headroom)
        return self.measured[n][1]

    def fits(self, n: int) -> bool:
        if n > self.most:
            if self.fits(self.most):
                raise Unbounded(f"{self.most}, the most searched, fits: the memory does not bound the "
                                f"{self.dimension} below that")
            return False
        return self.need(n) <= self.memory


def _bracket(steps: Steps, size: int) -> tuple[int, int]:
    """(a size that fits, a larger one that does not), from ``size``, which fits: the step measured at a
    larger size (16 times larger each time while what it needs does not grow: the allocator's rounding),
    the affine guess through the two and its neighbour (where the peak is affine, they are the answer)."""
    other = size
    while other < steps.most:
        other = min(size * 2 if other == size else other * 16, steps.most)
        if not steps.fits(other):
            return size, other
        if steps.need(other) > steps.need(size):
            break
    else:
        steps.fits(steps.most + 1)  # the most searched fits: raises Unbounded
    slope = (steps.need(other) - steps.need(size)) / (other - size)
    guess = min(max(other + 1, int((steps.memory - steps.need(size)) / slope) + size), steps.most + 1)
    if not steps.fits(guess):
        return (guess - 1, guess) if steps.fits(guess - 1) else (other, guess - 1)
    low, high = guess, guess + 1
    while steps.fits(high):
        low, high = high, high * 2
    return low, high


def _narrow(steps: Steps, low: int, high: int) -> int:
    """The largest size that fits between ``low`` (fits, or 0) and ``high`` (does not): where the line
    through the two ends' needs meets the memory (where the peak is affine, that size and its neighbour
    end it), a halving after a step that did not halve the range (the allocator's rounding makes the
    peak a staircase)."""
    halve = low not in steps.measured
    while high - low > 1:
        width = high - low
        if halve:
            low, high = (middle, high) if steps.fits(middle := (low + high) // 2) else (low, middle)
        else:
            rise = steps.need(high) - steps.need(low)
            n = low + int((steps.memory - steps.need(low)) * width / rise) if rise > 0 else (low + high) // 2
            n = min(max(n, low + 1), high - 1)
            low, high = (n, high) if steps.fits(n) else (low, n)
        halve = (high - low) * 2 > width or low not in steps.measured
    return low
