"""``gradaudit.fit()``: will a whole training step (forward, backward, optimizer step) fit in a
device's memory, and if not, the cheapest change (trim, a checkpoint plan) that makes it fit.
The step is run and followed storage by storage (step.py), counted as the target's allocator
would (result.py); the remedy searches the planner's frontier by the whole step's peak (remedy.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..compiled import FIT, ran_eagerly_note
from ..errors import GradauditError
from ..report.units import human_bytes
from ..sizes import as_bytes
from ..torchapi.ddp import bucket_view_setting
from ..torchapi.distributed import in_fake_world
from ..torchapi.pipelining import is_schedule
from . import optimizers
from .largest import InputSizes, search
from .levers import other_levers
from .remedy import Alternative, search_levers
from .pipeline import StageSizes, stage_remedy, stage_step
from .result import Figures, Fit, Live, allocated, figures
from ..collecting import collecting_only_new
from .step import BUCKETS, CATEGORIES, GRADIENTS, STATE, Step, prepared_step

__all__ = ["fit", "Fit", "CATEGORIES"]


@collecting_only_new()  # (its steps' garbage collections look at what it made, not at the model)
def fit(
    model: Any,
    inputs: Any,
    *,
    memory: Union[int, str],
    optimizer: Any = None,
    loss: Optional[Callable[[Any], torch.Tensor]] = None,
    trainable: Optional[Sequence[str]] = None,
    frozen: Optional[Sequence[str]] = None,
    target: Optional[str] = None,
    autocast: Optional[torch.dtype] = None,
    accumulation: int = 1,
    headroom: Union[int, str, None] = None,
    remedy: bool = True,
    split_batch: bool = True,
    progress: Optional[Callable[[str], None]] = None,
) -> Fit:
    """The peak memory of one steady-state training step of ``model`` on ``inputs``, by category,
    and whether it fits in ``memory``.

    model: a module, or a ``torch.distributed.pipelining`` schedule of this rank's stage, whose step on
        ``inputs`` (what it takes on this rank) is the step (docs/per-rank.md: "Pipeline stages").

    memory: the bytes the step may use (an int, or a size such as "80GiB").
    optimizer: a torch.optim class (built over the parameters that train, with its defaults), an
        instance (rebuilt with its groups' options), a name ("adamw", "sgd", any torch.optim class in
        any case, or "module:Class"), or a callable from parameters to an optimizer. Default "adamw".
        It runs on meta stand-ins of the parameters: its state and its step's temporaries are its own.
    loss: a callable from the model's output to the scalar loss (default: the output's ``loss`` when
        it has one, as Hugging Face models given labels do, else the sum of its first tensor).
    trainable / frozen: what-if requires_grad patterns, as for ``audit``: only what trains gets a
        gradient and optimizer state.
    target: on the meta device, the device type the figures are for ("cpu" or "cuda"), as for
        ``audit``; on a real device, that device.
    autocast: a dtype (torch.bfloat16, torch.float16): the forward and the loss run under
        ``torch.autocast(target, dtype)``, and backward and the optimizer step after it closes, as a
        training loop runs them. Call fit outside any autocast region.
    accumulation: micro-batches per optimizer step, each ``inputs``: their losses divided by it, their
        gradients added up by backward (the first micro-batch allocates them, the later ones run with
        them alive), then one optimizer step. Default 1.
    headroom: what the device needs beside the step's peak, which ``fits`` and the remedy leave
        free: bytes (an int, or a size such as "2GiB"). Default: on CUDA, what the caching allocator
        would reserve beyond the peak (whole segments, cached free blocks: ``reserved_bytes`` minus
        the peak, its rules replayed), for each step measured; on the CPU nothing.
    remedy: when the step does not fit, search for the cheapest change whose measured step fits
        (``Fit.remedy``): smaller micro-batches with gradient accumulation, trim, a checkpoint plan,
        alone and combined.
    split_batch: whether the remedy may split the batch into micro-batches (a change to the training
        loop, which ``Remedy.apply`` cannot make); False leaves the changes to the model alone.

    The step is the one a training loop repeats once the optimizer has state: forward, loss,
    backward, optimizer step, zero_grad(set_to_none=True). Its forward and backward run on the model
    as it is (left exactly as found, like an audit); the optimizer steps on meta stand-ins, so the
    model's weights never change.
    """
    schedule = model if is_schedule(model) else None
    memory_bytes = as_bytes(memory, "memory")
    headroom_of = _Headroom(None if headroom is None else as_bytes(headroom, "headroom"))
    step = _step_of(model, inputs, target, trainable, frozen, optimizer, dict(loss_fn=loss, autocast=autocast,
                                                                           accumulation=accumulation))
    inputs, target = step.inputs, step.target
    say = progress or (lambda text: None)
    say("running a training step (forward, backward, optimizer step)")
    measured = figures(run := step.run(), target)
    result = _as_fit(step, run, measured, memory_bytes, headroom_of)
    result.live.size_search = (InputSizes(lambda scaled: _peak_and_headroom(step.on(scaled), headroom_of), inputs,
                                          measured.floor_bytes) if schedule is None else
                               StageSizes(step, lambda other: figures(other.run(), other.target), headroom_of))
    if result.fits:
        return result
    result.levers = _levers(step, run, measured)
    if remedy and schedule is not None:
        _search_stage_remedy(result, memory_bytes, say)
    elif remedy and measured.floor_bytes + headroom_of(measured) > memory_bytes:
        result.remedy_searched = True
        result.notes.append(_beyond_remedy(measured.floor_bytes, memory_bytes, headroom_of(measured)))
    elif remedy:
        _search_remedy(result, step, measured, memory_bytes, headroom_of, split_batch, say)
    return result


def _step_of(model: Any, inputs: Any, target: Optional[str], trainable: Any, frozen: Any, optimizer: Any,
             options: dict[str, Any]) -> Step:
    """The step fit runs: of the module, or of this rank's stage of a pipeline schedule; options checked."""
    schedule = model if is_schedule(model) else None
    if schedule is None and not isinstance(model, nn.Module):
        raise GradauditError(f"fit() needs a torch.nn.Module or a torch.distributed.pipelining schedule, got "
                             f"{type(model).__name__}")
    _check_options(options["autocast"], options["accumulation"])
    builder, name = optimizers.resolve(optimizer)
    if schedule is not None:
        return stage_step(schedule, inputs, target, trainable, frozen, builder=builder, optimizer_name=name, **options)
    return prepared_step(model, inputs, target, trainable, frozen, builder=builder, optimizer_name=name, **options)


def _levers(step: Step, run: Any, measured: Figures) -> list[Any]:
    """The levers named (not applied) for a step that does not fit (``levers.py``)."""
    copied = bool(run.persistent.get(BUCKETS)) and not bucket_view_setting(step.model)  # DDP copies gradients in
    return other_levers([allocated(n, step.target) for n in run.persistent.get(STATE, ())], measured.peak_bytes,
                        measured.attribution, measured.breakdown.get(GRADIENTS, 0) if copied else 0)


def _beyond_remedy(floor_bytes: int, memory_bytes: int, headroom_bytes: int) -> str:
    """The note where what no remedy reduces does not fit beside the headroom: naming the limit it passes."""
    if floor_bytes > memory_bytes:
        limit = f"more than the memory ({human_bytes(memory_bytes)})"
    else:
        limit = (f"more than the memory less the headroom ({human_bytes(memory_bytes)} - "
                 f"{human_bytes(headroom_bytes)} = {human_bytes(memory_bytes - headroom_bytes)})")
    return (f"no remedy: the parameters, buffers, optimizer state and gradients alone take "
            f"{human_bytes(floor_bytes)}, {limit}, and neither smaller micro-batches, trim "
            f"nor checkpointing reduces them (train fewer parameters, keep less optimizer state, or shard the model)")


def _as_fit(step: Step, run: Any, measured: Figures, memory_bytes: int, headroom_of: "_Headroom") -> Fit:
    """The Fit of ``step``'s run (its figures ``measured``) in ``memory_bytes``, before any remedy."""
    notes = list(run.notes)
    eager = ran_eagerly_note(step.model, FIT)
    if eager:
        notes.append(eager)
    if run.output_cache:
        notes.append("the forward returned a key/value cache (Hugging Face: the config's use_cache=True): training "
                     "never reads it; model.config.use_cache = False may hold less")
    return Fit(model=step.label or type(step.model).__name__, device="meta" if step.on_meta else step.target, target=step.target,
               optimizer=step.optimizer_name, memory=memory_bytes, peak_bytes=measured.peak_bytes,
               breakdown=measured.breakdown, peak_phase=measured.peak_phase, timeline=measured.timeline,
               trained_parameters=run.trained, reserved_bytes=measured.reserved_bytes, notes=notes,
               accumulation=step.accumulation, headroom=headroom_of(measured),
               headroom_given=headroom_of.given is not None, attribution=measured.attribution, live=Live(run=run))


class _Headroom:
    """What a step needs beside its peak: the headroom given, else the caching allocator's reserve."""

    def __init__(self, given: Optional[int]) -> None:
        self.given = given

    def __call__(self, step: Figures) -> int:
        if self.given is not None:
            return self.given
        return max(0, step.reserved_bytes - step.peak_bytes) if step.reserved_bytes is not None else 0

    def needed(self, step: Figures) -> int:
        """The step's peak and its headroom."""
        return step.peak_bytes + self(step)


def _check_options(autocast: Any, accumulation: Any) -> None:
    if autocast is not None and (not isinstance(autocast, torch.dtype) or not autocast.is_floating_point):
        raise GradauditError(f"autocast must be a floating dtype such as torch.bfloat16, not {autocast!r}")
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        raise GradauditError("fit() was called inside torch.autocast: call it outside and pass autocast=dtype (the "
                             "forward and loss run under it, backward and the optimizer step after it closes)")
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise GradauditError(f"accumulation must be a whole number of micro-batches >= 1, not {accumulation!r}")


def _peak_and_headroom(step: Step, headroom_of: _Headroom) -> tuple[int, int]:
    """``Fit.largest``'s measure: the peak of ``step`` (on scaled inputs) and its headroom. The Fit keeps
    the model alive for it, as it keeps the inputs: ``gradaudit.fit(build(), batch).largest("batch")``
    is a natural one-liner."""
    measured = figures(step.run(), step.target)
    return measured.peak_bytes, headroom_of(measured)


def _search_remedy(result: Fit, step: Step, measured: Figures, memory_bytes: int, headroom_of: _Headroom,
                   split_batch: bool, say: Callable[[str], None]) -> None:
    """The cheapest change whose measured step fits (``Fit.remedy``), the alternatives and their notes.
    Frontier points that cannot fit by the bytes alive throughout ``measured`` and a plan's held bytes are
    not run, where the plan's held bytes are its step's: the plan audits no autocast and no process group."""
    def measure_with(step_inputs: Any, micro_batches: int) -> Callable[[Callable[[], Any]], Figures]:
        on = step.on(step_inputs, micro_batches)
        return lambda applied: figures(on.run(applied), step.target)

    result.remedy, result.alternatives, more = search_levers(
        step.model, step.inputs, memory_bytes, measure_with, accumulation=step.accumulation, trainable=step.trainable,
        frozen=step.frozen, target=step.target, say=say, needed=headroom_of.needed, split_batch=split_batch,
        measured=measured if step.autocast is None and not in_fake_world() else None)
    result.remedy_searched = True
    result.notes += more
    result.alternatives += _smaller_batch(result, say)
    if result.remedy is not None and result.remedy.plan is not None:
        result.notes += [n for n in result.remedy.plan.notes if n not in result.notes]


def _search_stage_remedy(result: Fit, memory_bytes: int, say: Callable[[str], None]) -> None:
    """A pipeline stage's remedy: a schedule change, measured (fitting/pipeline.py); in a fake process group
    only, where the schedule can be rebuilt and stepped alone."""
    if not in_fake_world():
        result.notes.append("no remedy is searched for a pipeline stage outside a fake process group (each change "
                            "would have to run on every rank): fit it with gradaudit.per_rank or --world-size")
        return
    result.remedy_searched = True
    result.remedy, result.no_remedy, notes = stage_remedy(result.live.size_search, memory_bytes, say)
    result.notes += notes


def _smaller_batch(result: Fit, say: Callable[[str], None]) -> list[Any]:
    """The largest batch that fits as it is, beside the remedy (none where the inputs have no batch
    to shrink or even one sample does not fit)."""
    say("searching the largest batch that fits as it is")
    try:
        n, peak, size = search(result, "batch")
    except GradauditError:
        return []
    if n == 0 or n >= size:
        return []
    return [Alternative(f"a batch of {n} instead of {size}", peak, None, True)]
