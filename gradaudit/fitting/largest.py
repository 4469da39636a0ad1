"""The largest batch (or sequence length) whose step fits: the batch scaled along one dimension (its
rows repeated in turn, so a padded batch stays padded alike; for a pipeline stage, its micro-batch, their
count or their sequence, the schedule rebuilt at each: fitting/pipeline.py), the step's peak measured at two sizes,
the affine guess between them, then the guess's neighbours measured until n fits and n+1 does not.
On meta nothing is computed, so each measurement costs a forward and backward of shapes only.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..errors import GradauditError
from ..tensors import iter_tensors
from ..torchapi.dispatch import tree_map

DIMENSIONS = {"batch": 0, "seq": 1}
MOST_STEPS = 24  # measurements before giving up on the neighbours' walk


def scaled(inputs: Any, dimension: int, size: int, new: int) -> Any:
    """``inputs`` with every tensor whose ``dimension`` has ``size`` entries resized to ``new``
    along it, by repeating its entries in turn (values kept, on meta too)."""
    from ..values import knowing_values

    def resize(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() <= dimension or t.shape[dimension] != size:
            return t
        index = torch.arange(new, device=t.device) % size
        out = t.detach().index_select(dimension, index)
        return out.requires_grad_(t.requires_grad) if t.requires_grad else out

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

    def __init__(self, peak_of_inputs: Callable[[Any], tuple[int, int]], inputs: Any) -> None:
        self.peak_of_inputs, self.inputs = peak_of_inputs, inputs

    def size(self, dimension: str) -> int:
        return size_of(self.inputs, DIMENSIONS[dimension])

    def most(self, dimension: str) -> Optional[int]:
        return None

    def named(self, dimension: str, n: int) -> str:
        """``n`` along ``dimension`` in words, where the number alone does not say it (here it does)."""
        return ""

    def measure(self, dimension: str, n: int) -> tuple[int, int]:
        axis = DIMENSIONS[dimension]
        return self.peak_of_inputs(scaled(self.inputs, axis, size_of(self.inputs, axis), n))


class Unbounded(GradauditError):
    """The step's peak does not bound the size: it does not grow with it, or fits at the most searched."""


def largest(fit: Any, dimension: str) -> int:
    """The largest size along ``dimension`` whose step peaks within ``fit.memory`` (0 when even 1 does not);
    every answer is measured: n fits and n+1 does not. A module's step scales "batch" and "seq", a pipeline
    stage's "batch" (its micro-batch), "seq" and "micro_batches" (fitting/pipeline.py)."""
    return search(fit, dimension)[0]


def search(fit: Any, dimension: str) -> tuple[int, Optional[int], int]:
    """(the largest size that fits, its step's peak (None for 0), the size fitted)."""
    sizes = fit.live.size_search
    if sizes is None:
        raise GradauditError("this Fit cannot search sizes: its model is gone; fit again")
    if dimension not in sizes.dimensions:
        raise GradauditError(f"largest() scales {' or '.join(repr(d) for d in sizes.dimensions)} here, not "
                             f"{dimension!r}")
    size, most = sizes.size(dimension), sizes.most(dimension)
    # the step's peak and what it needs with its headroom, by size
    measured: dict[int, tuple[int, int]] = {size: (fit.peak_bytes, fit.peak_bytes + fit.headroom)}

    def peak(n: int) -> int:
        """What the step of size ``n`` needs: its peak and its headroom."""
        if n not in measured:
            if len(measured) > MOST_STEPS:
                raise GradauditError(f"the largest {dimension} was not found in {MOST_STEPS} steps: the peak is "
                                     f"far from affine in it")
            step_peak, headroom = sizes.measure(dimension, n)
            measured[n] = (step_peak, step_peak + headroom)
        return measured[n][1]

    def fits(n: int) -> bool:
        if most is not None and n > most:
            if fits(most):
                raise Unbounded(f"{most}, the most searched, fits: the memory does not bound the {dimension} "
                                f"below that")
            return False
        return peak(n) <= fit.memory

    if not fits(size):
        low, high = 0, size  # 0: "nothing fits" until 1 is measured
    else:
        other = size * 2 if most is None else min(size * 2, most)
        if other == size:
            fits(size + 1)  # the most searched: raises Unbounded
        slope = (peak(other) - peak(size)) / (other - size)
        if slope <= 0:
            raise Unbounded(f"the step's peak does not grow with the {dimension} ({size} and {other} peak at "
                            f"{measured[size][0]} and {measured[other][0]} bytes): the memory does not bound it")
        # the affine guess and its neighbour first: where the peak is affine, they are the answer
        guess = max(size + 1, int((fit.memory - peak(size)) / slope) + size)
        if most is not None:
            guess = min(guess, most)
        if fits(guess):
            low, high = guess, guess + 1
            while fits(high):
                low, high = high, high * 2
        else:
            low, high = size, guess
            if fits(guess - 1):
                low = guess - 1
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, measured[low][0] if low in measured else None, size
