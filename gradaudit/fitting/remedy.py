"""The cheapest change that makes a step fit: ``gradaudit.trim`` or not, and a point of the checkpoint
planner's frontier, chosen by the whole step's measured peak (parameters, optimizer state and the
optimizer's step included, which the planner's own ``bound="peak"`` leaves out). For each trim
option the frontier is bisected by that peak (``planning.frontier.by_peak``); of the two answers,
the one that recomputes less wins. Every figure is a step run with the change in force.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import nn

from ..errors import GradauditError

NO_PLAN = 2**62  # a budget every plan fits: the frontier is wanted, not a choice


@dataclass
class Remedy:
    """A change whose step fits: trim or not, and the modules to checkpoint (``plan``, a Plan at one
    point of its frontier), with the step's measured peak and breakdown under it."""

    plan: Any  # gradaudit.Plan
    peak_bytes: int
    breakdown: dict[str, int]
    timeline: list[dict[str, Any]] = field(default_factory=list)

    @property
    def trim(self) -> bool:
        return self.plan.trimmed

    @property
    def checkpointed(self) -> tuple[str, ...]:
        return self.plan.checkpointed

    @property
    def extra_compute(self) -> float:
        """The recomputation's FLOPs as a fraction of one unplanned step's."""
        return self.plan.extra_compute

    def apply(self, model: nn.Module) -> Any:
        """Install it on ``model`` (trim where it has trim, the checkpoints): a handle, also a context
        manager, whose ``remove()`` restores the model (``Plan.apply``)."""
        return self.plan.apply(model)

    def describe(self) -> str:
        parts = []
        if self.trim:
            parts.append(f"gradaudit.trim (bitpack={self.plan.bitpack})")
        if self.checkpointed:
            selective = f", {len(self.plan.selective)} of them op by op" if self.plan.selective else ""
            parts.append(f"checkpoint {len(self.checkpointed)} of {len(self.plan.blocks)} blocks{selective}")
        return " + ".join(parts) or "nothing"

    def to_dict(self) -> dict[str, Any]:
        return {"change": self.describe(), "trim": self.trim, "bitpack": self.plan.bitpack if self.trim else None,
                "checkpointed": list(self.checkpointed), "selective": list(self.plan.selective),
                "extra_compute": self.extra_compute, "extra_flops": self.plan.extra_flops,
                "peak_bytes": self.peak_bytes, "breakdown": dict(self.breakdown)}


@dataclass(frozen=True)
class Alternative:
    """What a user would otherwise try, measured the same way: its name, the step's peak under it
    and its recompute share (None: not applicable)."""

    name: str
    peak_bytes: Optional[int]
    extra_compute: Optional[float]
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "peak_bytes": self.peak_bytes, "extra_compute": self.extra_compute,
                "fits": self.fits}


def search(model: nn.Module, inputs: Any, memory: int, measure: Callable[[Callable[[], Any]], Any], *,
           trainable: Any, frozen: Any, target: str, say: Callable[[str], None]
           ) -> tuple[Optional[Remedy], list[Alternative], list[str]]:
    """(the cheapest remedy, None when nothing fits; "every block checkpointed" beside it; notes).
    ``measure(applied)``: the step's Figures with ``applied()`` in force."""
    from ..planning import plan as make_plan
    from ..planning.conditions import own_checkpointing_off
    from ..planning.frontier import by_peak

    found: list[tuple[float, int, Remedy]] = []
    notes: list[str] = []
    every: Optional[Alternative] = None
    for trim in (False, True):
        say(f"planning checkpoints{' with trim' if trim else ''}")
        try:
            planned = make_plan(model, inputs, NO_PLAN, trainable=trainable, frozen=frozen, target=target,
                                measure_peak=False, trim=trim)
        except GradauditError as error:
            notes.append(f"no checkpoint plan{' with trim' if trim else ''}: {error}")
            continue
        frontier = planned._frontier
        measured: dict[int, Any] = {}

        def figures_at(index: int, planned: Any = planned, frontier: Any = frontier, measured: dict = measured) -> Any:
            if index not in measured:
                at = planned._at(frontier.points[index], memory)
                say(f"measuring a step: {len(at.checkpointed)} of {len(at.blocks)} blocks checkpointed"
                    f"{' with trim' if trim else ''}")

                def applied(at: Any = at) -> Any:
                    stack = contextlib.ExitStack()
                    stack.enter_context(own_checkpointing_off(at.replaces))
                    stack.enter_context(at.apply(model))
                    return stack

                measured[index] = (at, measure(applied))
            return measured[index]

        index = by_peak(list(range(len(frontier.points))), memory, lambda i: figures_at(i)[1].peak_bytes, 0)
        if index is not None:
            at, step = figures_at(index)
            found.append((at.extra_flops, step.peak_bytes, Remedy(at, step.peak_bytes, step.breakdown, step.timeline)))
        if not trim and frontier.chain.blocks:
            every = _every_block(model, planned, measure, memory)
    alternatives = [every] if every is not None else []
    if not found:
        return None, alternatives, notes
    found.sort(key=lambda entry: (entry[0], entry[1]))
    return found[0][2], alternatives, notes


def _every_block(model: nn.Module, planned: Any, measure: Callable[[Callable[[], Any]], Any],
                 memory: int) -> Alternative:
    """Checkpointing every block (Hugging Face's activation_checkpointing_enable()), measured."""
    from ..planning.apply import PlanHandle
    from ..planning.conditions import own_checkpointing_off

    every = next(b for b in planned.baselines if b.name == "every block")

    def applied() -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(own_checkpointing_off(planned.replaces))
        stack.enter_context(PlanHandle(model, every.checkpointed))
        return stack

    step = measure(applied)
    return Alternative("checkpoint every block", step.peak_bytes, planned.share(every), step.peak_bytes <= memory)
