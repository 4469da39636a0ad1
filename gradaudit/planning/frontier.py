"""Where the planner decides: the memory/compute frontier of one audit (``Frontier``: the chain,
solve.py's Pareto points, each block's costs, the baselines that do not depend on the budget), the
plan at one of its points (``Frontier.at``), and the cheapest point that fits a budget, by held
bytes or by measured peak (``Frontier.cheapest``, ``by_peak``'s bisection over peaks.py's probes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from .baselines import usual_baselines
from .costs import Costs
from .baselines import Baseline
from .solve import Chain, Point, cheapest_within


@dataclass
class Frontier:
    """Every plan no other plan beats on both held bytes and recompute, cheapest first (``points``),
    with what is needed to state any of them as a ``Plan``: the chain they are choices over, each
    block's costs and the budget-independent baselines (``fixed``: the sqrt(n) segments')."""

    chain: Chain
    points: list[Point]
    costs: Costs
    fixed: tuple[Baseline, ...] = ()

    def paths(self, indices: Iterable[int]) -> tuple[str, ...]:
        """The module paths of the chain blocks ``indices``, in forward order."""
        return tuple(self.chain.blocks[i].path for i in sorted(indices))

    def at(self, point: Point, budget: int) -> dict[str, Any]:
        """The fields of the plan at ``point`` for ``budget`` (what differs between two plans of one
        frontier, but their peaks)."""
        return dict(budget=budget, held_bytes=point.held_bytes,
                    extra_flops=self.costs.extra_flops(point.chosen, point.selective),
                    extra_seconds=self.costs.extra_seconds(point.chosen),
                    checkpointed=self.paths(point.chosen), selective=self.paths(point.selective),
                    baselines=usual_baselines(self.chain, self.costs, budget) + self.fixed)

    def cheapest(self, budget: int, start: int = 0,
                 peak_of: Optional[Callable[[Point], int]] = None) -> Optional[Point]:
        """The cheapest point from ``start`` on that fits ``budget``: holding at most that many
        bytes or, given ``peak_of`` (a bound on the peak), peaking at most at it. None when none
        does."""
        if peak_of is None:
            return cheapest_within(self.points[start:], budget)
        index = by_peak(self.points, budget, peak_of, start)
        return self.points[index] if index is not None else None

    def entries(self) -> tuple[tuple[int, Union[int, float]], ...]:
        """(held_bytes, extra cost) of every point, in the cost's units (``Plan.frontier``)."""
        return tuple((p.held_bytes, self.costs.extra(p.chosen, p.selective)) for p in self.points)

    def blocks(self) -> tuple[dict[str, Any], ...]:
        """Every block's figures (``Plan.blocks``): path, class, calls, flops, seconds (cost="time"),
        the bytes it holds and is passed, and what a selective checkpoint of it caches."""
        chain, costs = self.chain, self.costs
        return tuple({"path": b.path, "module_class": b.module_class, "calls": b.calls, "flops": costs.flops[i],
                      "kept_flops": costs.kept[i], "seconds": costs.extra_seconds([i]),
                      "internal_bytes": chain.bytes_of(b.internal, b.packed), "input_bytes": chain.bytes_of(b.inputs),
                      "cached_bytes": None if b.cached is None else chain.bytes_of(b.cached - b.inputs)}
                     for i, b in enumerate(chain.blocks))


def by_peak(points: Sequence[Point], budget: int, peak_of: Callable[[Point], int], start: int,
            guess: Optional[Callable[[int], Optional[int]]] = None) -> Optional[int]:
    """The index of the cheapest frontier point from ``start`` on whose measured peak is at most
    ``budget``, by bisection: the frontier's points hold less and less after the forward, and the
    peak is taken to fall with them (each probe is measured, and so is the answer: a plan chosen
    this way fits). None when the last point's peak does not fit.

    ``guess(index)``: a prediction of a point's peak from the steps measured so far (None: none yet).
    Given one, each probe goes where the prediction puts the first point that fits (and next to it
    once that fits), not to the middle, for as many probes as a bisection would take at most; then
    the bisection finishes. Where the peak falls with the points, the answer is the same point (the
    one that fits beside one that does not), in fewer steps where the guesses are good and at most
    twice as many where they are not."""
    if peak_of(points[start]) <= budget:
        return start
    low, high = start, len(points) - 1  # low does not fit
    if high == low or peak_of(points[high]) > budget:
        return None
    guided = (high - low).bit_length() if guess is not None else 0  # guided probes left
    while high - low > 1:
        probe = _guided(low, high, budget, guess) if guided else (low + high) // 2
        guided = max(guided - 1, 0)
        if peak_of(points[probe]) <= budget:
            high = probe
        else:
            low = probe
    return high


def _guided(low: int, high: int, budget: int, guess: Callable[[int], Optional[int]]) -> int:
    """The probe strictly between ``low`` (does not fit) and ``high`` (fits) where ``guess`` predicts
    the first point that fits, or ``high - 1`` where it predicts none before ``high``; the middle where
    it predicts nothing."""
    predicted = [guess(i) for i in range(low + 1, high)]
    if any(p is None for p in predicted):
        return (low + high) // 2
    return next((low + 1 + k for k, p in enumerate(predicted) if p <= budget), high - 1)
