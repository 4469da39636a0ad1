"""The step of one rank of a pipeline: a ``torch.distributed.pipelining`` schedule's ``step`` on the
stage(s) this rank runs, as ``fit`` follows it (``Step`` with a schedule; the following itself is in
step.py, the schedule's parts in torchapi/pipelining.py).

What the rank's step is: ``schedule.step(*args, **kwargs)`` with the inputs as given (the whole batch on
the first stage, ``target=`` on the last, nothing on the others), every micro-batch's forward and backward
in the schedule's order, then the optimizer's step over the stage modules' parameters and
``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

from typing import Any, Optional

from ..errors import GradauditError
from ..torchapi.distributed import in_fake_world
from ..torchapi.pipelining import micro_batch_count, sends_no_gradient_back, stage_module, stages_of, statically_shaped
from .step import Step, prepared_step


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
    model = stage_module(schedule)
    indices = ", ".join(str(stage.stage_index) for stage in stages)
    label = (f"{type(schedule).__name__}, stage{'s' if len(stages) > 1 else ''} {indices} of "
             f"{stages[0].num_stages}, {micro_batch_count(schedule)} micro-batches")
    step = prepared_step(model, inputs, target, trainable, frozen, schedule=schedule, label=label, **options)
    step.notes = [f"stage {stage.stage_index}'s input_args do not require grad: its backward sends no gradient back, "
                  f"so the stage before must not expect one (its output_args not requiring grad either), or a real "
                  f"run waits for it forever" for stage in stages if sends_no_gradient_back(stage)]
    return step
