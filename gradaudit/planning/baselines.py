"""What a user would otherwise pick (``Baseline``), with the same figures as the plan: nothing, every block, every
n-th block (``usual_baselines``, from the chain alone), and for a stack, sqrt(n) segments
(``segments_baseline``: an audit with it in force, see segments.py).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Optional, Sequence

from torch import nn

from ..auditing import audit, audit_then_step
from . import segments
from .chain import held_by_report
from .costs import Costs
from .solve import Chain
from .switches import trimmed


@dataclass(frozen=True)
class Baseline:
    """A plan a user would otherwise pick, with the same figures as the chosen plan."""

    name: str
    checkpointed: tuple[str, ...]
    held_bytes: int
    extra_flops: int
    peak_bytes: Optional[int] = None  # measured as Plan.peak_bytes is (None: not measured)
    extra_seconds: Optional[float] = None  # with cost="time" (None otherwise)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "checkpointed": list(self.checkpointed), "held_bytes": self.held_bytes,
                "extra_flops": self.extra_flops, "extra_seconds": self.extra_seconds, "peak_bytes": self.peak_bytes}


def usual_baselines(chain: Chain, costs: Costs, budget: int) -> tuple[Baseline, ...]:
    """What a user would otherwise pick: nothing, every block (Hugging Face's
    activation_checkpointing_enable()), and every n-th block for the largest n that fits the budget
    (or 2 when none does)."""
    n = len(chain.blocks)

    def baseline(name: str, chosen: Sequence[int]) -> Baseline:
        return Baseline(name, tuple(chain.blocks[i].path for i in chosen), chain.held(chosen),
                        costs.extra_flops(chosen), extra_seconds=costs.extra_seconds(chosen))

    found = [baseline("none", []), baseline("every block", range(n))]
    if n >= 4:
        step = next((k for k in range(n // 2, 1, -1) if chain.held(range(0, n, k)) <= budget), 2)
        found.append(baseline(f"every {step} blocks", range(0, n, step)))
    return tuple(found)


def stack_runner(model: nn.Module, paths: Sequence[str], calls: Sequence[Any]) -> Optional[Callable[[int], Any]]:
    """What runs the blocks ``paths`` in k segments (``runner(k)``, a context manager), where they are
    the children of one nn.Sequential run by its own forward or a stack a loop runs passing each
    block its predecessor's result (``calls``: the audit's module calls); None for other blocks."""
    parent = segments.sequential_parent(model, paths)
    if parent is not None:
        container = model.get_submodule(parent) if parent else model
        return functools.partial(segments.segmented, container)
    if segments.looped_stack(model, paths, [c for c in calls if c.path in set(paths)]):
        return functools.partial(segments.loop_segmented, [model.get_submodule(p) for p in paths])
    return None


@contextlib.contextmanager
def _in_segments(in_segments: Callable[[int], Any], count: int, model: nn.Module,
                 bitpack: Optional[bool], masks: str = "bits") -> Iterator[list[tuple[int, int]]]:
    """The stack run in ``count`` segments (and trim installed where the plan has it)."""
    with in_segments(count) as ranges, trimmed(model, bitpack, masks):
        yield ranges


@dataclass(frozen=True)
class BlockCosts:
    """Every candidate block's forward FLOPs (and of those, what a selective checkpoint keeps) and with
    cost="time" its nanoseconds, by path: ``count_flops``'s and ``timing.measure``'s figures."""

    flops: dict[str, tuple[int, int]]
    nanoseconds: Optional[dict[str, int]] = None


def segments_baseline(model: nn.Module, inputs: Any, trainable: Any, frozen: Any, target: Optional[str],
                      children: Sequence[str], built: Collection[str], costs: BlockCosts,
                      in_segments: Callable[[int], Any], bitpack: Optional[bool], masks: str = "bits",
                      step: bool = False, loss: Optional[Callable[[Any], Any]] = None
                      ) -> tuple[Baseline, Callable[[], Any], Optional[tuple[int, int]]]:
    """The sqrt(n) segments baseline of the stack ``children`` (see segments.py; ``in_segments(k)``
    runs it in k segments): its held bytes from an audit with it in force, its recompute from the
    blocks backward runs again (``recomputed``: ``built`` names the children that build a graph;
    ``costs`` gives every child's FLOPs, and with cost="time" its nanoseconds); what puts it in
    force (to measure its peak); and with ``step``, the training step's (held, peak) measured in the
    same run (``auditing.audit_then_step``: its forward is the audit's, ``loss`` backpropagated; never
    with trim, which the audit's forward runs without), else None."""
    count = segments.square_root_segments(len(children))
    applied = functools.partial(_in_segments, in_segments, count, model, bitpack, masks)
    figures = None
    with applied() as ranges:
        if step:
            report, figures = audit_then_step(model, inputs, trainable=trainable, frozen=frozen, target=target,
                                              loss=loss)
        else:
            report = audit(model, inputs, trainable=trainable, frozen=frozen, target=target)
        held = held_by_report(report, bitpack, masks)
    checkpointed = {children[k] for first, last in ranges[:-1] for k in range(first, last + 1)}
    again = recomputed(children, ranges, built)
    seconds = (sum(costs.nanoseconds.get(p, 0) for p in again) / 1e9 if costs.nanoseconds is not None else None)
    return Baseline(f"{count} segments", tuple(p for p in children if p in checkpointed), held,
                    sum(costs.flops.get(p, (0, 0))[0] for p in again), extra_seconds=seconds), applied, figures


def recomputed(children: Sequence[str], ranges: Sequence[tuple[int, int]], built: Collection[str]) -> list[str]:
    """The children backward runs again when ``ranges`` but the last are checkpointed segments: a segment
    one of whose blocks builds a graph (``built``) is recomputed from its first block (one that builds
    none included: the region's function runs from its start) to the last that builds one (non-reentrant
    checkpoint stops once the saves backward asked for are made again); a segment none of whose blocks
    builds a graph saves nothing and is never recomputed."""
    again = []
    for first, last in ranges[:-1]:
        ends = [k for k in range(first, last + 1) if children[k] in built]
        if ends:
            again += [children[k] for k in range(first, ends[-1] + 1)]
    return again
