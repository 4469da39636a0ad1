"""The step of one rank of a pipeline: a ``torch.distributed.pipelining`` schedule's ``step`` on the
stage(s) this rank runs, as ``fit`` follows it (``Step`` with a schedule; the following itself is in
step.py, the schedule's parts in torchapi/pipelining.py).

What the rank's step is: ``schedule.step(*args, **kwargs)`` with the inputs as given (the whole batch on
the first stage, ``target=`` on the last, nothing on the others), every micro-batch's forward and backward
in the schedule's order, then the optimizer's step over the stage modules' parameters and
``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from ..errors import GradauditError
from ..torchapi.distributed import in_fake_world
from ..torchapi.pipelining import (batch_mismatch, micro_batch_count, micro_batch_shape, rebuilt,
                                   sends_no_gradient_back, stage_module, stages_of, statically_shaped)
from .largest import scaled
from .remedy import Remedy
from .step import Step, prepared_step

MOST_MICRO_BATCHES = 1024  # a step runs every micro-batch: the counts searched are bounded
STAGE_NO_REMEDY = ("no remedy: neither 1F1B (for GPipe) nor smaller micro-batches bring the stage within memory "
                   "(the notes say what each peaked at)")


def stage_step(schedule: Any, inputs: Any, target: Optional[str], trainable: Any, frozen: Any, *,
               loss_fn: Any = None, autocast: Any = None, accumulation: int = 1, **options: Any) -> Step:
    """The Step of this rank of ``schedule`` on ``inputs`` (what its ``step`` takes on this rank)."""
    if loss_fn is not None:
        raise GradauditError("a pipeline schedule computes its loss with its own loss_fn (on the last stage): "
                             "leave fit's loss out")
    if autocast is not None:
        raise GradauditError("autocast is not supported for a pipeline schedule (its step runs the backward too): "
                             "give the stage modules the dtype they train in")
    if accumulation != 1:
        raise GradauditError("a pipeline schedule splits the batch into its own micro-batches: leave accumulation "
                             "out (n_microbatches is the schedule's)")
    stages = stages_of(schedule)
    if in_fake_world() and not all(statically_shaped(stage) for stage in stages):
        raise GradauditError("a PipelineStage that infers its shapes at run time needs the other ranks, which a fake "
                             "process group does not have: build each PipelineStage with input_args and output_args "
                             "(a micro-batch's input and output, the output requiring grad)")
    mismatch = batch_mismatch(schedule, inputs)
    if mismatch is not None:
        raise GradauditError(mismatch)
    model = stage_module(schedule)
    indices = ", ".join(str(stage.stage_index) for stage in stages)
    label = (f"{type(schedule).__name__}, stage{'s' if len(stages) > 1 else ''} {indices} of "
             f"{stages[0].num_stages}, {micro_batch_count(schedule)} micro-batches")
    step = prepared_step(model, inputs, target, trainable, frozen, schedule=schedule, label=label, **options)
    step.notes = [f"stage {stage.stage_index}'s input_args do not require grad: its backward sends no gradient back, "
                  f"so the stage before must not expect one (its output_args not requiring grad either), or a real "
                  f"run waits for it forever" for stage in stages if sends_no_gradient_back(stage)]
    return step


class StageSizes:
    """What ``Fit.largest`` scales for a pipeline stage, each size measured by a step of the schedule
    rebuilt at it (``torchapi.pipelining.rebuilt``: its class and settings, fresh stages over the same
    modules) in the fake process group: ``"batch"``, the micro-batch (dimension 0 of each, the count kept);
    ``"seq"``, dimension 1 of each micro-batch; ``"micro_batches"``, their count (each as it is). The
    batch this rank's step takes (the first stage's inputs, the last's target) grows with each."""

    dimensions = ("batch", "seq", "micro_batches")

    def __init__(self, step: Step, figures_of: Callable[[Step], Any], headroom_of: Callable[[Any], int]) -> None:
        self.step = step
        self.figures_of, self.headroom_of = figures_of, headroom_of  # a step's Figures; what it needs beside them
        self.count = micro_batch_count(step.schedule)

    @property
    def shape(self) -> tuple[int, ...]:
        """A micro-batch's shape (its first input's on this rank's first stage)."""
        return micro_batch_shape(self.step.schedule)

    def size(self, dimension: str) -> int:
        if dimension == "micro_batches":
            return self.count
        axis = 0 if dimension == "batch" else 1
        if len(self.shape) <= axis:
            raise GradauditError(f"the stage's micro-batch has no dimension {axis} to scale (its shape is "
                                 f"{self.shape})")
        return self.shape[axis]

    def most(self, dimension: str) -> Optional[int]:
        """The largest size searched (a step runs every micro-batch: their count is bounded)."""
        return MOST_MICRO_BATCHES if dimension == "micro_batches" else None

    def named(self, dimension: str, n: int) -> str:
        """``n`` along ``dimension``, in words."""
        if dimension == "micro_batches":
            return f"{n} micro-batches of {self.shape[0]}"
        if dimension == "batch":
            return f"micro-batches of {n} ({self.count} of them: a batch of {self.count * n})"
        return f"micro-batches of sequence length {n}"

    def measure(self, dimension: str, n: int) -> tuple[int, int]:
        """The peak and headroom of the step at ``n`` along ``dimension``."""
        key = {"micro_batches": "count", "batch": "micro", "seq": "seq"}[dimension]
        measured = self.figures_of(self.at(**{key: n}))
        return measured.peak_bytes, self.headroom_of(measured)

    def at(self, *, count: Optional[int] = None, micro: Optional[int] = None, seq: Optional[int] = None,
           kind: Any = None) -> Step:
        """The step with ``count`` micro-batches of ``micro`` (dimension 0) and ``seq`` (dimension 1), each
        as it is where not given, under the schedule class ``kind`` (default: its own)."""
        if not in_fake_world():
            raise GradauditError("a pipeline stage is measured at another size in a fake process group only "
                                 "(gradaudit.per_rank, or the command line's --world-size): call largest() there")
        old = {0: self.shape[0], 1: self.size("seq") if seq is not None else None}
        new = {0: micro or old[0], 1: seq}
        count = count or self.count

        def resize(shape: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(new[i] if i in new and new[i] is not None and s == old[i] else s for i, s in enumerate(shape))

        inputs = scaled(self.step.inputs, 0, self.count * old[0], count * new[0])
        if seq is not None:
            inputs = scaled(inputs, 1, old[1], seq)
        schedule = rebuilt(self.step.schedule, count, resize, kind)
        return dataclasses.replace(self.step, schedule=schedule, model=stage_module(schedule), inputs=inputs,
                                   attribute=False, notes=[])


def stage_remedy(sizes: StageSizes, memory: int,
                 say: Callable[[str], None]) -> tuple[Optional[Remedy], str, list[str]]:
    """Where a stage's step does not fit: the schedule changes that may make it, each measured, cheapest
    first: 1F1B for GPipe (fewer micro-batches in flight, the same work), then smaller micro-batches (the
    batch kept: more of them, each size dividing it), under the schedule's class and, for GPipe, 1F1B.
    Returns (the first that fits, or None; where none, what the fit says instead; notes)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    schedule = sizes.step.schedule
    kinds = [type(schedule)] + ([Schedule1F1B] if type(schedule) is ScheduleGPipe else [])
    try:
        micro = sizes.shape[0]
    except GradauditError as error:
        return None, "no remedy: the schedule cannot be rebuilt at another size", [
            f"no schedule change could be measured: {error}"]
    batch = sizes.count * micro
    candidates = [(kind, micro) for kind in kinds[1:]]
    candidates += [(kind, size) for size in range(micro - 1, 0, -1)
                   if batch % size == 0 and batch // size <= MOST_MICRO_BATCHES for kind in kinds]
    tried: list[tuple[Any, int, int]] = []
    refused = ""
    for kind, size in candidates:
        say(f"measuring {kind.__name__} with {batch // size} micro-batches of {size}")
        try:
            step = sizes.at(count=batch // size, micro=size, kind=kind)
        except GradauditError as error:  # e.g. an interleaved schedule wants a count its stages divide
            refused = refused or str(error)
            continue
        measured = sizes.figures_of(step)
        headroom = sizes.headroom_of(measured)
        tried.append((kind, size, measured.peak_bytes))
        if measured.peak_bytes + headroom <= memory:
            return Remedy(plan=None, peak_bytes=measured.peak_bytes, breakdown=measured.breakdown,
                          timeline=measured.timeline, micro_batch=size if size != micro else None, batch=batch,
                          headroom=headroom, micro_batches=batch // size, schedule=kind.__name__), "", []
    shown = "; ".join(f"{kind.__name__} with {batch // size} micro-batches of {size}: peak {peak} bytes"
                      for kind, size, peak in tried[:4])
    return None, STAGE_NO_REMEDY, [
        f"no schedule change measured brings the stage within memory ({shown or refused or 'none to try'}): "
        f"checkpointing within the stage's module, or another split of the model over the stages, are the "
        f"levers left"]
