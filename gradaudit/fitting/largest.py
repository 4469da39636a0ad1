"""The largest batch (or sequence length) whose step fits: the batch scaled along one dimension (its
rows repeated in turn, so a padded batch stays padded alike), the step's peak measured at two sizes,
the affine guess between them, then the guess's neighbours measured until n fits and n+1 does not.
On meta nothing is computed, so each measurement costs a forward and backward of shapes only.
"""

from __future__ import annotations

from typing import Any, Optional

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


def largest(fit: Any, dimension: str) -> int:
    """The largest size along ``dimension`` ("batch" or "seq") whose step peaks within ``fit.memory``
    (0 when even 1 does not); every answer is measured: n fits and n+1 does not."""
    return search(fit, dimension)[0]


def search(fit: Any, dimension: str) -> tuple[int, Optional[int], int]:
    """(the largest size that fits, its step's peak (None for 0), the inputs' own size)."""
    if dimension not in DIMENSIONS:
        raise GradauditError(f"largest() scales 'batch' or 'seq', not {dimension!r}")
    if fit.live.size_search is None:
        raise GradauditError("this Fit cannot search sizes: its model is gone; fit again")
    peak_of_inputs, inputs = fit.live.size_search
    axis = DIMENSIONS[dimension]
    size = size_of(inputs, axis)
    # the step's peak and what it needs with its headroom, by size
    measured: dict[int, tuple[int, int]] = {size: (fit.peak_bytes, fit.peak_bytes + fit.headroom)}

    def peak(n: int) -> int:
        """What the step of size ``n`` needs: its peak and its headroom."""
        if n not in measured:
            if len(measured) > MOST_STEPS:
                raise GradauditError(f"the largest {dimension} was not found in {MOST_STEPS} steps: the peak is "
                                     f"far from affine in it")
            step_peak, headroom = peak_of_inputs(scaled(inputs, axis, size, n))
            measured[n] = (step_peak, step_peak + headroom)
        return measured[n][1]

    fits = lambda n: peak(n) <= fit.memory  # noqa: E731
    if not fits(size):
        low, high = 0, size  # 0: "nothing fits" until 1 is measured
    else:
        other = size * 2
        slope = (peak(other) - peak(size)) / (other - size)
        if slope <= 0:
            raise GradauditError(f"the step's peak does not grow with the {dimension}: nothing bounds it")
        # the affine guess and its neighbour first: where the peak is affine, they are the answer
        guess = max(size + 1, int((fit.memory - peak(size)) / slope) + size)
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
