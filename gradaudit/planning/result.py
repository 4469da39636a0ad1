"""The plan, as data: ``Plan`` (which modules to checkpoint, what it holds and costs, the frontier
it was chosen from, the baselines beside it; ``for_budget`` and ``sweep`` choose again from the same
frontier, ``BudgetError``; the baselines are ``baselines.Baseline``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from torch import nn

from ..errors import GradauditError
from ..records import Bound, Cost
from ..sizes import as_bytes
from .apply import FULL_POLICY, SELECTIVE_POLICY, PlanHandle
from .baselines import Baseline
from .switches import checkpointing_off_call, checkpoints_itself
from .solve import Point

if TYPE_CHECKING:
    from .frontier import Frontier
    from .peaks import PeakProbes

# 2: the cost (FLOPs or measured time) is chosen: ``cost``, ``extra_seconds``, ``step_seconds``;
# ``extra_compute`` and the frontier's entries are in the cost's units
PLAN_SCHEMA_VERSION = 2
HELD_BOUND, PEAK_BOUND = Bound.HELD, Bound.PEAK  # (the names before Bound)


class BudgetError(GradauditError):
    """No plan of the candidate blocks holds at most the budget. ``smallest`` is the least any
    plan holds (``smallest_plan`` the plan that does); with ``bound="peak"``, that plan's measured
    peak."""

    def __init__(self, message: str, smallest: int, smallest_plan: "Plan") -> None:
        super().__init__(message)
        self.smallest = smallest
        self.smallest_plan = smallest_plan


@dataclass(frozen=True)
class PlanSearch:
    """Where a plan was found, which a ``Plan`` keeps beside its data: the frontier of plans it was
    chosen from, its point on it, and the probes that measure a point's step's peak (running one step
    each, once). ``for_budget``, ``sweep`` and ``on_frontier`` choose again from it."""

    frontier: "Frontier"
    point: Point
    probes: "PeakProbes"
    # whether gradaudit.trim's steady steps would change a save of the audited forward (chain.trim_changes):
    # where not, a step with trim holds what the same step without it holds (fit's remedy search skips it)
    trim_changes: bool = True


@dataclass
class Plan:
    """Which modules to checkpoint so that autograd holds at most ``budget`` bytes after the forward."""

    model: str  # class name of the planned model
    device: str
    target: str  # the device type the figures are for (Report.target: on meta, what it stands for)
    budget: int
    held_bytes: int  # held after the forward under the plan: what an audit of the planned model counts
    unplanned_held_bytes: int  # the same without the plan (the audit's saved_bytes)
    extra_flops: int  # FLOPs the recomputation adds per step (forward FLOPs of the checkpointed modules)
    step_flops: int  # FLOPs of one unplanned step (forward and backward)
    checkpointed: tuple[str, ...]  # module paths, in forward order
    # every candidate: path, class, calls, flops, seconds (cost="time"), bytes it holds and is passed
    blocks: tuple[dict[str, Any], ...]
    # (held_bytes, extra cost) of every Pareto plan, cheapest first; the cost in the plan's units:
    # FLOPs (cost="flops") or seconds (cost="time")
    frontier: tuple[tuple[int, Union[int, float]], ...]
    baselines: tuple[Baseline, ...]
    optimal: bool  # False when the solver could not charge every storage exactly (see notes)
    notes: list[str] = field(default_factory=list)
    # bytes alive at the worst moment of one planned step (forward, recomputation and backward,
    # activation and parameter gradients included; parameters, buffers and inputs not), measured by
    # running that step on the model's device: on meta (shapes only, nothing computed) it predicts
    # the real device's figure; None when not measured (measure_peak=False)
    peak_bytes: Optional[int] = None
    unplanned_peak_bytes: Optional[int] = None
    # the modules the model checkpoints itself (the plan replaces that: its figures are without it),
    # and what the model holds with it
    replaces: tuple[str, ...] = ()
    current_held_bytes: Optional[int] = None
    # those of ``checkpointed`` checkpointed op by op: the outputs of their costly ops (matrix
    # products, convolutions, attention) are kept and only the rest is recomputed
    selective: tuple[str, ...] = ()
    # what the solver minimised: "flops" (forward FLOPs, counted) or "time" (forward time, measured
    # on the model's device: the median of timing.REPEATS runs); with "time", the seconds the
    # recomputation adds per step and one unplanned step's (None with "flops")
    cost: Cost = Cost.FLOPS
    extra_seconds: Optional[float] = None
    step_seconds: Optional[float] = None
    # what the budget bounds: "held" (bytes held after the forward, exact) or "peak" (the measured
    # peak of one step: the plan is the cheapest frontier point whose peak fits, see _by_peak)
    bound: Bound = Bound.HELD
    # every figure above is with gradaudit.trim installed (with these options): apply installs it
    trimmed: bool = False
    bitpack: Optional[bool] = None  # trim's option; None without trim
    masks: str = "bits"  # trim's option (what a bit-packable save becomes: "bits" or "bytes")
    # not part of the plan's data: where it was found, for for_budget and sweep (None: nowhere to look)
    search: Optional["PlanSearch"] = field(default=None, repr=False, compare=False)

    def for_budget(self, budget: Union[int, str]) -> "Plan":
        """The plan for another budget, from the same audit and frontier: instant (nothing runs
        again, its peak is not measured), except with ``bound="peak"``, which measures the peaks
        its bisection probes (steps already measured are not run again). Raises BudgetError when
        nothing fits."""
        budget_bytes = as_bytes(budget)
        return self._for(budget_bytes, 0)

    def sweep(self, budgets: Sequence[Union[int, str]], measure_peak: bool = False) -> list["Plan"]:
        """The plans for several budgets (in the order given), from the same audit and frontier.
        Neither held bytes nor, where peaks are measured (``measure_peak``, or ``bound="peak"``), the
        peak ever rises as the budget shrinks: a smaller budget's plan is searched only among the
        points from the larger one's on; with peaks, one whose peak would exceed the larger budget's
        plan's gives way to the next point that peaks no higher (points further on hold less, so
        they fit the budget too; that costs more recompute than the budget alone asks). A budget
        nothing fits gives the least plan (``fits`` False)."""
        wanted = [as_bytes(b) for b in budgets]
        points, peak_of = self.search.frontier.points, self.search.probes.peak
        peaks = measure_peak or self.bound == Bound.PEAK
        found: dict[int, Plan] = {}
        start, ceiling = 0, None
        for budget_bytes in sorted(set(wanted), reverse=True):
            try:
                chosen = self._for(budget_bytes, start)
            except BudgetError as error:
                chosen = error.smallest_plan
            index = points.index(chosen.search.point)
            if peaks and ceiling is not None and chosen.fits:
                while peak_of(points[index]) > ceiling and index + 1 < len(points):
                    index += 1
                if index != points.index(chosen.search.point):
                    chosen = self._at(points[index], budget_bytes)
            if peaks:
                chosen.peak_bytes = peak_of(points[index])
                chosen.unplanned_peak_bytes = peak_of(None)
                ceiling = chosen.peak_bytes
            found[budget_bytes] = chosen
            start = index
        return [found[b] for b in wanted]

    def frontier_size(self) -> int:
        """How many plans the frontier this plan was chosen from holds (0 when it keeps none): from
        the first, which checkpoints least, to the last, which holds least."""
        return len(self.search.frontier.points) if self.search is not None else 0

    def on_frontier(self, index: int, budget: Union[int, str]) -> "Plan":
        """The plan at the frontier's ``index``-th point (see ``frontier_size``), for ``budget``: instant,
        nothing runs again (with ``bound="peak"`` its peak is measured)."""
        if not 0 <= index < self.frontier_size():
            raise GradauditError(f"the frontier holds {self.frontier_size()} plans; there is none at {index}")
        return self._at(self.search.frontier.points[index], as_bytes(budget))

    def _for(self, budget_bytes: int, start: int) -> "Plan":
        frontier, probes = self.search.frontier, self.search.probes
        point = frontier.cheapest(budget_bytes, start, probes.peak if self.bound == Bound.PEAK else None)
        other = self._at(point if point is not None else frontier.points[-1], budget_bytes)
        if point is None:
            raise budget_error(other, len(frontier.chain.blocks))
        return other

    def _at(self, point: Point, budget_bytes: int) -> "Plan":
        """This plan's figures for another frontier point and budget."""
        peaks = self.bound == Bound.PEAK
        return dataclasses.replace(
            self, **self.search.frontier.at(point, budget_bytes), notes=list(self.notes),
            peak_bytes=self.search.probes.peak(point) if peaks else None,
            unplanned_peak_bytes=self.unplanned_peak_bytes if peaks else None,
            search=dataclasses.replace(self.search, point=point))

    @property
    def fits(self) -> bool:
        """Whether the plan keeps what its budget bounds (``bound``) at or under the budget."""
        if self.bound == Bound.PEAK:
            return self.peak_bytes is not None and self.peak_bytes <= self.budget
        return self.held_bytes <= self.budget

    @property
    def extra_compute(self) -> float:
        """The recomputation's cost as a fraction of an unplanned step's, in the cost's units (FLOPs,
        or seconds with cost="time")."""
        return self.share(self)

    def share(self, figures: Union["Plan", Baseline]) -> float:
        """What ``figures`` (this plan, or one of its baselines) adds per step, as a fraction of an
        unplanned step, in the plan's cost units."""
        if self.cost == Cost.TIME:
            return (figures.extra_seconds or 0.0) / self.step_seconds if self.step_seconds else 0.0
        return figures.extra_flops / self.step_flops if self.step_flops else 0.0

    def apply(self, model: nn.Module) -> PlanHandle:
        """Checkpoint the planned modules of ``model`` (non-reentrant ``torch.utils.checkpoint``) and,
        for a plan made with trim, install ``gradaudit.trim`` (with the plan's bitpack and masks) unless it is
        installed already; returns a handle: ``remove()`` or ``with plan.apply(model): ...`` restores
        it (removing trim only where apply installed it)."""
        if self.replaces and checkpoints_itself(model):
            raise GradauditError(f"this plan replaces the model's own checkpointing, which is still on: turn it off "
                                 f"first ({checkpointing_off_call(model)})")
        return PlanHandle(model, self.checkpointed, self.policies, trim=self.bitpack if self.trimmed else None,
                          masks=self.masks)

    @property
    def policies(self) -> dict[str, str]:
        """How each checkpointed module is checkpointed: "full" (everything recomputed) or
        "selective" (costly ops' outputs kept)."""
        return {path: SELECTIVE_POLICY if path in self.selective else FULL_POLICY for path in self.checkpointed}

    def to_dict(self) -> dict[str, Any]:
        """The plan's JSON document (``gradaudit plan --json``; fields in docs/json.md)."""
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "tool": "gradaudit",
            "kind": "plan",
            "model": self.model,
            "device": self.device,
            "target": self.target,
            "budget": self.budget,
            "fits": self.fits,
            "held_bytes": self.held_bytes,
            "unplanned_held_bytes": self.unplanned_held_bytes,
            "cost": str(self.cost),
            "extra_flops": self.extra_flops,
            "step_flops": self.step_flops,
            "extra_seconds": self.extra_seconds,
            "step_seconds": self.step_seconds,
            "extra_compute": self.extra_compute,
            "peak_bytes": self.peak_bytes,
            "unplanned_peak_bytes": self.unplanned_peak_bytes,
            "replaces": list(self.replaces),
            "current_held_bytes": self.current_held_bytes,
            "trim": {"bitpack": self.bitpack, "masks": self.masks} if self.trimmed else None,
            "bound": str(self.bound),
            "checkpointed": list(self.checkpointed),
            "selective": list(self.selective),
            "optimal": self.optimal,
            "blocks": [dict(b) for b in self.blocks],
            # the key names the cost's units
            "frontier": [{"held_bytes": h, "extra_seconds" if self.cost == Cost.TIME else "extra_flops": c}
                         for h, c in self.frontier],
            "baselines": [b.to_dict() for b in self.baselines],
            "notes": list(self.notes),
        }

    def __repr__(self) -> str:
        selective = f" ({len(self.selective)} selectively)" if self.selective else ""
        return (f"<gradaudit.Plan {self.model}: checkpoint {len(self.checkpointed)}{selective} of {len(self.blocks)} "
                f"blocks, holds {self.held_bytes} of budget {self.budget} bytes{' with trim' if self.trimmed else ''}, "
                f"+{100 * self.extra_compute:.1f}% {'time' if self.cost == Cost.TIME else 'compute'}>")


def budget_error(least: "Plan", blocks: int) -> "BudgetError":
    """The BudgetError of a budget nothing fits, ``least`` the least plan of the ``blocks`` candidates."""
    if least.bound == Bound.PEAK:
        return BudgetError(f"no plan's peak fits {least.budget} bytes: checkpointing the {blocks} candidate blocks "
                           f"peaks at {least.peak_bytes} bytes (unplanned {least.unplanned_peak_bytes}); raise the "
                           f"budget or consider more modules (blocks=...)", least.peak_bytes or 0, least)
    return BudgetError(f"no plan fits {least.budget} bytes: checkpointing the {blocks} candidate blocks holds at "
                       f"least {least.held_bytes} bytes (of {least.unplanned_held_bytes} unplanned); raise the "
                       f"budget or consider more modules (blocks=...)", least.held_bytes, least)
