"""The cheapest change that makes a step fit, among the levers a user has, alone and combined: a
smaller micro-batch with gradient accumulation keeping the effective batch, ``gradaudit.trim`` or
not, and a point of the checkpoint planner's frontier, chosen by the whole step's measured peak
(parameters, optimizer state and the optimizer's step included, which the planner's own
``bound="peak"`` leaves out). For each micro-batch size (the batch split in 1, 2, ... equal parts)
and trim option the frontier is bisected by that peak (``planning.frontier.by_peak``; trim only where
its steady steps would change a save, ``planning.chain.trim_changes``: elsewhere they make the tensors
the steps without it make, and are not run again); the search stops at the first split whose step
fits without checkpointing. What fits is ranked by its cost: the FLOPs recomputed first, then the
number of micro-batches (the same FLOPs in smaller passes). Every figure is a step run with the change
in force.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..errors import GradauditError, LoopChangeWarning
from ..planning.switches import own_checkpointing_off

NO_PLAN = 2**62  # a budget every plan fits: the frontier is wanted, not a choice


@dataclass
class Remedy:
    """A change whose step fits: a smaller micro-batch with gradient accumulation or not, trim or
    not, and the modules to checkpoint (``plan``, a Plan at one point of its frontier; None where the
    micro-batches alone fit), with the step's measured peak and breakdown under it."""

    plan: Any  # gradaudit.Plan, or None
    peak_bytes: int
    breakdown: dict[str, int]
    timeline: list[dict[str, Any]] = field(default_factory=list)
    # the micro-batch the step runs (None: the batch as given), and the micro-batches per optimizer
    # step it takes to keep the effective batch (the fit's own accumulation times the split)
    micro_batch: Optional[int] = None
    accumulation: int = 1
    batch: Optional[int] = None  # the batch as given (dimension 0 of the inputs), where it is split
    headroom: int = 0  # what the device needs beside this step's peak (the fit's headroom, for this step)
    # a pipeline stage's remedy (fitting/pipeline.py): the schedule class and its micro-batch count, the
    # batch kept (None: a module's remedy)
    schedule: Optional[str] = None
    micro_batches: Optional[int] = None

    @property
    def trim(self) -> bool:
        return self.plan is not None and self.plan.trimmed

    @property
    def checkpointed(self) -> tuple[str, ...]:
        return self.plan.checkpointed if self.plan is not None else ()

    @property
    def selective(self) -> tuple[str, ...]:
        return tuple(self.plan.selective) if self.plan is not None else ()

    @property
    def extra_compute(self) -> float:
        """The recomputation's FLOPs as a fraction of one unplanned step's."""
        return self.plan.extra_compute if self.plan is not None else 0.0

    @property
    def split(self) -> int:
        """Into how many micro-batches each batch as given is split (1: not split)."""
        return self.batch // self.micro_batch if self.micro_batch else 1

    def apply(self, model: nn.Module) -> Any:
        """Install the model's part of it on ``model`` (trim where it has trim, the checkpoints): a
        handle, also a context manager, whose ``remove()`` restores the model (``Plan.apply``). The
        micro-batches are the training loop's to make (``loop_change``; ``micro_batches_of`` splits a batch):
        where the remedy has them, a ``LoopChangeWarning`` says so, since the whole batch does not fit."""
        change = self.loop_change()
        if change is not None:
            helper = " (Remedy.micro_batches_of(batch) makes them)" if self.schedule is None else ""
            warnings.warn(f"the model's part of the remedy is installed{' (nothing)' if self.plan is None else ''}; "
                          f"the step fits only with the loop's part too: {change}{helper}", LoopChangeWarning,
                          stacklevel=2)
        if self.plan is None:
            return _NothingApplied()
        return self.plan.apply(model)

    def micro_batches_of(self, batch: Any) -> list[Any]:
        """``batch`` (a tensor, tuple, list, dict or ``gradaudit.Args``, as the fit was given) split into
        the remedy's micro-batches along dimension 0: every tensor with the batch's rows (those of its
        first tensor) is split into views of ``micro_batch`` rows, anything else (a scalar, a tensor of
        other rows) shared by each. A batch of other rows (a loader's last) is split alike, the last
        micro-batch the smaller. With no micro-batches in the remedy: ``[batch]``."""
        if self.schedule is not None:
            raise GradauditError("a pipeline schedule makes its own micro-batches: build it with "
                                 f"n_microbatches={self.micro_batches} (Remedy.loop_change() says the rest)")
        if not self.micro_batch:
            return [batch]
        return split_rows(batch, self.micro_batch)

    def loop_change(self) -> Optional[str]:
        """What the training loop changes, in words (None: nothing)."""
        if self.schedule is not None:
            size = self.micro_batch or self.batch // self.micro_batches
            return (f"build every rank's schedule as {self.schedule} with n_microbatches={self.micro_batches}, each "
                    f"PipelineStage's input_args and output_args for micro-batches of {size} (the batch of "
                    f"{self.batch} kept; every stage takes the same count: fit the others with it)")
        if not self.micro_batch:
            return None
        return (f"split each batch of {self.batch} into {self.split} micro-batches of {self.micro_batch}: "
                f"(loss / {self.accumulation}).backward() for each, {self.accumulation} per optimizer.step() "
                f"(a loss averaged over its batch keeps the effective batch's gradient)")

    def describe(self) -> str:
        if self.schedule is not None:
            return f"{self.schedule} with {self.micro_batches} micro-batches of {self.batch // self.micro_batches}"
        parts = []
        if self.micro_batch:
            parts.append(f"micro-batches of {self.micro_batch} with {self.accumulation} accumulation steps")
        if self.trim:
            # (named: what trim's default chooses depends on the device)
            masks = f", masks={self.plan.masks!r}" if self.plan.bitpack else ""
            parts.append(f"gradaudit.trim (bitpack={self.plan.bitpack}{masks})")
        if self.checkpointed:
            selective = f", {len(self.plan.selective)} of them op by op" if self.plan.selective else ""
            parts.append(f"checkpoint {len(self.checkpointed)} of {len(self.plan.blocks)} blocks{selective}")
        return " + ".join(parts) or "nothing"

    def to_dict(self) -> dict[str, Any]:
        return {"change": self.describe(), "micro_batch": self.micro_batch, "accumulation": self.accumulation,
                "trim": self.trim, "bitpack": self.plan.bitpack if self.trim else None,
                "masks": self.plan.masks if self.trim else None,
                "checkpointed": list(self.checkpointed), "selective": list(self.selective),
                "extra_compute": self.extra_compute,
                "extra_flops": self.plan.extra_flops if self.plan is not None else 0,
                "peak_bytes": self.peak_bytes, "headroom": self.headroom, "breakdown": dict(self.breakdown),
                # a pipeline stage's remedy only: the schedule's class and micro-batch count
                **({"schedule": self.schedule, "micro_batches": self.micro_batches} if self.schedule else {})}


class _NothingApplied:
    """The handle of a remedy with nothing to install on the model."""

    def remove(self) -> None:
        pass

    def __enter__(self) -> "_NothingApplied":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


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


Measure = Callable[[Callable[[], Any]], Any]  # the step's Figures with applied() in force
Needed = Callable[[Any], int]  # what a step's Figures need of the memory: its peak and its headroom


def search_levers(model: nn.Module, inputs: Any, memory: int, measure_with: Callable[[Any, int], Measure], *,
                  accumulation: int, trainable: Any, frozen: Any, target: str, say: Callable[[str], None],
                  needed: Needed, split_batch: bool = True, measured: Any = None
                  ) -> tuple[Optional[Remedy], list[Alternative], list[str]]:
    """(the cheapest remedy over every split of the batch into micro-batches, None when nothing
    fits; beside it "every block checkpointed" and the other remedies that fit, cheapest first;
    notes). ``measure_with(inputs, accumulation)``: a Measure of the step on those inputs; a step
    fits where ``needed(figures) <= memory``. ``measured``: the Figures of the step on ``inputs`` as
    it is, where a plan's held bytes are what its step holds after the forward (no autocast, no
    process group): a frontier point that cannot fit by them is not run (``_Bound``)."""
    from .largest import size_of

    best, alternatives, notes = search(model, inputs, memory, measure_with(inputs, accumulation),
                                       trainable=trainable, frozen=frozen, target=target, say=say, needed=needed,
                                       steady=measured.steady_bytes if measured is not None else None)
    found = [best] if best is not None else []
    try:
        batch = size_of(inputs, 0) if split_batch else 1
    except GradauditError:
        batch = 1  # no tensor to split
    for split in (k for k in range(2, batch + 1) if batch % k == 0):
        if found and found[0].extra_compute == 0:
            break  # nothing recomputed already: more micro-batches cost time and save nothing worth it
        micro = batch // split
        micro_inputs = split_rows(inputs, micro)[0]  # views of the batch, as Remedy.micro_batches_of makes them
        measure = measure_with(micro_inputs, accumulation * split)
        say(f"measuring a step in {split} micro-batches of {micro}")
        plain = measure(contextlib.nullcontext)
        lever = dict(micro_batch=micro, accumulation=accumulation * split, batch=batch)
        if needed(plain) <= memory:
            found.append(Remedy(None, plain.peak_bytes, plain.breakdown, plain.timeline,
                                headroom=needed(plain) - plain.peak_bytes, **lever))
            break
        remedy, _, more = search(model, micro_inputs, memory, measure, trainable=trainable, frozen=frozen,
                                 target=target, say=say, needed=needed, every=False,
                                 steady=plain.steady_bytes if measured is not None else None)
        notes += [note for note in more if note not in notes]
        if remedy is not None:
            found.append(dataclasses.replace(remedy, **lever))
    found.sort(key=lambda r: (r.extra_compute, r.accumulation, r.peak_bytes))
    for other in found[1:]:  # where not the same step as one beside it already (every block checkpointed)
        if not any((a.peak_bytes, a.extra_compute) == (other.peak_bytes, other.extra_compute) for a in alternatives):
            alternatives.append(Alternative(other.describe(), other.peak_bytes, other.extra_compute, True))
    return (found[0] if found else None), alternatives, notes


def search(model: nn.Module, inputs: Any, memory: int, measure: Measure, *, trainable: Any, frozen: Any,
           target: str, say: Callable[[str], None], needed: Needed, every: bool = True,
           steady: Optional[int] = None) -> tuple[Optional[Remedy], list[Alternative], list[str]]:
    """(the cheapest remedy of trim and checkpointing, None when nothing fits; "every block
    checkpointed" beside it, where ``every``; notes). ``steady``: the bytes alive throughout the step on
    these inputs, where frontier points may be bounded by them (``_Bound``)."""
    from ..planning import plan as make_plan
    from ..planning.frontier import by_peak

    found: list[tuple[float, int, int, Remedy]] = []
    notes: list[str] = []
    every_block: Optional[Alternative] = None
    trim_changes = True
    for trim, masks in _trim_options(model, target):
        if trim and not trim_changes:
            break  # trim's steady steps would change no save: they are the steps just measured without it
        with_trim = (" with trim" + (" (masks as bytes)" if masks == "bytes" else "")) if trim else ""
        say(f"planning checkpoints{with_trim}")
        try:
            planned = make_plan(model, inputs, NO_PLAN, trainable=trainable, frozen=frozen, target=target,
                                measure_peak=False, trim=trim, masks=masks)
        except GradauditError as error:
            notes.append(f"no checkpoint plan{with_trim}: {error}")
            continue
        trim_changes = planned.search.trim_changes
        measured: dict[int, Any] = {}

        def figures_at(index: int, planned: Any = planned, measured: dict = measured) -> Any:
            if index not in measured:
                at = planned.on_frontier(index, memory)
                say(f"measuring a step: {len(at.checkpointed)} of {len(at.blocks)} blocks checkpointed"
                    f"{' with trim' if at.trimmed else ''}")

                def applied(at: Any = at) -> Any:
                    stack = contextlib.ExitStack()
                    stack.enter_context(own_checkpointing_off(at.replaces))
                    stack.enter_context(at.apply(model))
                    return stack

                measured[index] = (at, measure(applied))
            return measured[index]

        points = list(range(planned.frontier_size()))
        bound = _Bound(planned, steady, memory, figures_at, needed)
        index = by_peak(points, memory, bound.needed, 0, bound.guess)
        if bound.broken:  # a measured step below its bound: the bound is not one here; bisect by steps alone
            index = by_peak(points, memory, lambda i: needed(figures_at(i)[1]), 0)
        if index is not None:
            at, step = figures_at(index)
            found.append((at.extra_flops, _slower_on(target, at), step.peak_bytes,
                          Remedy(at, step.peak_bytes, step.breakdown, step.timeline,
                                 headroom=needed(step) - step.peak_bytes)))
        if every and not trim and planned.blocks:
            every_block = _every_block(model, planned, measure, memory, needed, list(measured.values()))
    alternatives = [every_block] if every_block is not None else []
    if not found:
        return None, alternatives, notes
    found.sort(key=lambda entry: entry[:3])
    best = found[0][3]
    if best.plan.trimmed and best.plan.masks == "bytes":  # what bits would give, beside it
        bits = next((r for *_, r in found[1:] if r.plan.trimmed and r.plan.masks == "bits"), None)
        if bits is not None:
            alternatives.append(Alternative(bits.describe(), bits.peak_bytes, bits.extra_compute, True))
    return best, alternatives, notes


def _trim_options(model: nn.Module, target: str) -> list[tuple[bool, Optional[str]]]:
    """The remedy search's plans: without trim, with it, and for a GPU with its masks as bytes too;
    with trim installed, only with it as installed (its options are the user's)."""
    from ..conditions import trimmed_now

    if trimmed_now(model):
        return [(False, None), (True, None)]
    return [(False, None), (True, "bits")] + ([(True, "bytes")] if target == "cuda" else [])


def _slower_on(target: str, at: Any) -> int:
    """1 where a remedy's trim keeps masks as bits on a GPU, else 0: among remedies recomputing the same,
    one that keeps them as bytes comes first there. On an H200 a ResNet-50 step with its weights frozen
    ran 1.35-1.51x a plain one with byte masks and 1.70-1.88x with bits (half the host time per changed
    save, fewer kernels: docs/benchmarks.md); on the CPU the two cost about the same and bits free more."""
    return int(target == "cuda" and at.trimmed and bool(at.bitpack) and at.masks == "bits")


# bytes: the audit counts 0-dim numbers autograd saves that no op makes; the step's tracker does not
BOUND_SLACK = 2**20


class _Bound:
    """What a frontier point's step needs, for the bisection: where the bytes alive throughout the step
    (``steady``) and the plan's held bytes at the point (alive together when the forward ends) pass
    ``memory`` by more than ``BOUND_SLACK``, the step cannot fit and is not run (the bound is returned);
    else the step is measured. A measured step whose peak is below its bound means the bound does not
    hold for this model (``broken``): the caller bisects again by measured steps alone."""

    def __init__(self, planned: Any, steady: Optional[int], memory: int, figures_at: Callable[[int], Any],
                 needed: Needed) -> None:
        self.planned, self.steady, self.memory = planned, steady, memory
        self.figures_at, self.needed_of = figures_at, needed
        self.broken = False
        self.above: dict[int, int] = {}  # by point measured: by how much what its step needs passes its bound
        self.held: dict[int, int] = {}  # by point: the plan's held bytes there

    def needed(self, index: int) -> int:
        if self.steady is None or self.broken:
            return self.needed_of(self.figures_at(index)[1])
        lower = self._lower(index)
        if lower > self.memory:
            return lower
        step = self.figures_at(index)[1]
        self.broken = step.peak_bytes < lower
        self.above[index] = self.needed_of(step) - lower
        return self.needed_of(step)

    def guess(self, index: int) -> Optional[int]:
        """What a point's step needs, predicted (for where the bisection probes, never as a figure):
        its bound plus what the measured step nearest to it in held bytes needed above its own bound;
        None before any step is measured, or where the bound does not hold."""
        if self.steady is None or self.broken or not self.above:
            return None
        nearest = min(self.above, key=lambda i: abs(self._held(i) - self._held(index)))
        return self._lower(index) + self.above[nearest]

    def _lower(self, index: int) -> int:
        return self.steady + self._held(index) - BOUND_SLACK

    def _held(self, index: int) -> int:
        if index not in self.held:
            self.held[index] = self.planned.on_frontier(index, self.memory).held_bytes
        return self.held[index]


def _every_block(model: nn.Module, planned: Any, measure: Measure, memory: int, needed: Needed,
                 measured: list[tuple[Any, Any]] = ()) -> Alternative:
    """Checkpointing every block (Hugging Face's activation_checkpointing_enable()), measured: the step
    of the frontier point that is the same change, where the bisection ran it (``measured``: (plan,
    figures) of each step run), else its own."""
    from ..planning.apply import PlanHandle
    every = next(b for b in planned.baselines if b.name == "every block")
    same = [step for at, step in measured
            if tuple(at.checkpointed) == tuple(every.checkpointed) and not at.selective and not at.trimmed]
    if same:
        return Alternative("checkpoint every block", same[0].peak_bytes, planned.share(every),
                           needed(same[0]) <= memory)

    def applied() -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(own_checkpointing_off(planned.replaces))
        stack.enter_context(PlanHandle(model, every.checkpointed))
        return stack

    step = measure(applied)
    return Alternative("checkpoint every block", step.peak_bytes, planned.share(every), needed(step) <= memory)


def split_rows(batch: Any, micro_batch: int) -> list[Any]:
    """``batch`` in micro-batches of ``micro_batch`` rows (the last the smaller): every tensor with the
    rows of the batch's first tensor is split into views, anything else shared by each. Views: the
    batch's storages stay alive beside them as the loaded batch does, and the remedy's steps are
    measured so (a loader of micro-batches holds less)."""
    from ..torchapi.dispatch import tree_map
    from ..values import knowing_values
    from .largest import size_of

    rows = size_of(batch, 0)

    def part(start: int) -> Any:
        size = min(micro_batch, rows - start)
        return tree_map(lambda t: t.narrow(0, start, size) if isinstance(t, torch.Tensor) and t.dim() > 0
                        and t.shape[0] == rows else t, batch)

    with knowing_values():
        return [part(start) for start in range(0, rows, micro_batch)]
