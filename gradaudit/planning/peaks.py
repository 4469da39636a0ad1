"""Where the planner measures peaks: one training step's forward and backward (``Step.forward_backward``)
run on the model's device under a frontier point's checkpointing (or a baseline's), the storage
tracker or the allocator counting the bytes alive at its worst moment. ``PeakProbes`` runs each step
once and remembers it; it is the live half of a plan (it holds the model weakly, and the inputs),
kept apart from the plan's data.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional, Sequence

from torch import nn

from ..errors import GradauditError
from ..fitting.step import Step
from .apply import SELECTIVE_POLICY, PlanHandle
from .baselines import Baseline
from .solve import Point
from .switches import own_checkpointing_off


class PeakProbes:
    """The measured peak of a step under any of a frontier's points or baselines, each step run once
    (``peak``, ``baseline_peak``), with the model's own checkpointing off and trim installed where
    the plan has it. Holds the model weakly: measuring once the model is gone raises."""

    def __init__(self, model: nn.Module, inputs: Any, trainable: Any, frozen: Any, target: str,
                 block_paths: Sequence[str], bitpack: Optional[bool], own_checkpointing: Sequence[str],
                 progress: Callable[[str], None], loss: Optional[Callable[[Any], Any]] = None,
                 masks: str = "bits") -> None:
        self._model = weakref.ref(model)
        self._inputs, self._trainable, self._frozen, self._target = inputs, trainable, frozen, target
        self._block_paths = tuple(block_paths)  # the chain's blocks, in order
        self._bitpack, self._masks = bitpack, masks  # trim's options where the plan has it
        self._own_checkpointing = tuple(own_checkpointing)  # checkpointed_now: turned off for every step
        self._progress = progress
        self._loss = loss  # what the step backpropagates (None: Step's default)
        self._measured: dict[Any, tuple[int, int]] = {}  # (held, peak) of each step run, by what was applied
        self._expected: Optional[int] = None  # how many steps were announced (progress counts them)
        self._counted_from = 0  # the steps measured before they were

    def expect(self, more: int) -> None:
        """Announce that up to ``more`` steps are about to be measured: progress counts them."""
        self._expected, self._counted_from = more, len(self._measured)

    def set_blocks(self, block_paths: Sequence[str]) -> None:
        """The chain's blocks, in order, once known (a frontier point names blocks by their index)."""
        self._block_paths = tuple(block_paths)

    def unplanned(self, watch: Callable[[str], Any]) -> int:
        """``peak(None)``, measured now with ``watch`` in force in its step (``tracking.forward_backward``:
        the planner counts the FLOPs of the same step), where it was not measured yet."""
        return self._measure(((), ()), functools.partial(self._checkpointing, ()), "", watch)

    def unplanned_measured(self) -> bool:
        """Whether the unplanned step was measured already (``unplanned``)."""
        return ((), ()) in self._measured

    def peak(self, point: Optional[Point]) -> int:
        """The measured peak of a frontier point's step (None: of the unplanned step)."""
        paths = tuple(self._block_paths[i] for i in sorted(point.chosen)) if point is not None else ()
        selective = tuple(self._block_paths[i] for i in sorted(point.selective)) if point is not None else ()
        return self._measure((paths, selective), functools.partial(self._checkpointing, paths, selective),
                             f"{len(paths)} of {len(self._block_paths)} blocks checkpointed")

    def baseline_peak(self, baseline: Baseline, applied: Optional[Callable[[], Any]] = None) -> int:
        """The measured peak of a baseline's step: ``applied()`` puts it in force where it is not the
        checkpointing of its blocks (the sqrt(n) segments)."""
        if applied is not None:
            return self._measure((baseline.name,), applied, baseline.name)
        return self._measure((baseline.checkpointed, ()), functools.partial(self._checkpointing, baseline.checkpointed),
                             baseline.name)

    def remember_baseline(self, baseline: Baseline, figures: tuple[int, int]) -> None:
        """A baseline's step (held, peak) measured elsewhere as ``baseline_peak`` would measure it, with what
        puts it in force that is not the checkpointing of its blocks (its audit's run, ``audit_then_step``)."""
        self._measured[(baseline.name,)] = figures

    def _checkpointing(self, paths: tuple[str, ...], selective: tuple[str, ...] = ()) -> PlanHandle:
        return PlanHandle(self._model(), paths, {path: SELECTIVE_POLICY for path in selective}, trim=self._bitpack,
                          masks=self._masks)

    def _measure(self, key: Any, applied: Callable[[], Any], what: str,
                 watch: Optional[Callable[[str], Any]] = None) -> int:
        if key not in self._measured:
            model = self._model()
            if model is None:
                raise GradauditError("the model this plan was made for is gone: plan again to measure peaks")
            done = len(self._measured) - self._counted_from
            count = (f", {done + 1} of at most {self._expected}"
                     if self._expected is not None and done < self._expected else "")
            self._progress(f"measuring the peak of a step{count} ({what})" if watch is None else
                           "counting FLOPs in a step with nothing checkpointed, its peak measured")
            with own_checkpointing_off(self._own_checkpointing):
                step = Step(model, self._inputs, self._target, trainable=self._trainable, frozen=self._frozen,
                                loss_fn=self._loss)
                self._measured[key] = step.forward_backward(applied, watch)
        return self._measured[key][1]
