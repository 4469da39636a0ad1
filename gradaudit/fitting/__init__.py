"""``gradaudit.fit()``: will a whole training step (forward, backward, optimizer step) fit in a
device's memory, and if not, the cheapest change (trim, a checkpoint plan) that makes it fit.
The step is run and followed storage by storage (step.py), counted as the target's allocator
would (result.py); the remedy searches the planner's frontier by the whole step's peak (remedy.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..errors import GradauditError
from .result import Figures, Fit, Live, figures
from .step import CATEGORIES, STATE, run_step

__all__ = ["fit", "Fit", "CATEGORIES"]


def fit(
    model: nn.Module,
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
    from ..auditing import resolve_target, meta_inputs, runs_on_meta
    from ..sizes import as_bytes
    from ..tensors import first_meta_parameter, iter_tensors
    from . import optimizers

    if not isinstance(model, nn.Module):
        raise GradauditError(f"fit() needs a torch.nn.Module, got {type(model).__name__}")
    memory_bytes = as_bytes(memory, "memory")
    fixed_headroom = None if headroom is None else as_bytes(headroom, "headroom")

    def headroom_of(step: Figures) -> int:
        """What ``step`` needs beside its peak: the headroom given, else the allocator's reserve."""
        if fixed_headroom is not None:
            return fixed_headroom
        return max(0, step.reserved_bytes - step.peak_bytes) if step.reserved_bytes is not None else 0

    def needed(step: Figures) -> int:
        return step.peak_bytes + headroom_of(step)

    if isinstance(trainable, str):
        trainable = [trainable]
    if isinstance(frozen, str):
        frozen = [frozen]
    if autocast is not None and (not isinstance(autocast, torch.dtype) or not autocast.is_floating_point):
        raise GradauditError(f"autocast must be a floating dtype such as torch.bfloat16, not {autocast!r}")
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        raise GradauditError("fit() was called inside torch.autocast: call it outside and pass autocast=dtype (the "
                             "forward and loss run under it, backward and the optimizer step after it closes)")
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise GradauditError(f"accumulation must be a whole number of micro-batches >= 1, not {accumulation!r}")
    builder, name = optimizers.resolve(optimizer)
    inputs = meta_inputs(model, inputs)
    tensors = list(iter_tensors(inputs))
    on_meta = runs_on_meta(first_meta_parameter(model.parameters()), tensors)
    first = next(iter(model.parameters()), None)
    target = resolve_target(target, on_meta, ([first] if first is not None else []) + tensors)
    say = progress or (lambda step: None)
    say("running a training step (forward, backward, optimizer step)")
    memo: dict = {}  # the optimizer's stand-in step, stepped once for every run of this fit
    run = run_step(model, inputs, builder=builder, optimizer_name=name, loss_fn=loss, trainable=trainable,
                   frozen=frozen, target=target, on_meta=on_meta, autocast=autocast, memo=memo,
                   accumulation=accumulation)
    step = figures(run, target)
    notes = list(run.notes)
    if run.output_cache:
        notes.append("the forward returned a key/value cache (Hugging Face: the config's use_cache=True): training "
                     "never reads it; model.config.use_cache = False may hold less")
    result = Fit(model=type(model).__name__, device="meta" if on_meta else target, target=target, optimizer=name,
                 memory=memory_bytes, peak_bytes=step.peak_bytes, breakdown=step.breakdown,
                 peak_phase=step.peak_phase, timeline=step.timeline, trained_parameters=run.trained,
                 reserved_bytes=step.reserved_bytes, notes=notes, accumulation=accumulation,
                 headroom=headroom_of(step), headroom_given=fixed_headroom is not None,
                 attribution=step.attribution, live=Live(run=run))
    _searchable(result, model, builder, name, loss, trainable, frozen, target, on_meta, autocast, inputs, memo,
                headroom_of)
    if not result.fits:
        from .levers import other_levers
        from .result import allocated

        result.levers = other_levers([allocated(n, target) for n in run.persistent.get(STATE, ())],
                                     step.peak_bytes, step.attribution)
    if remedy and not result.fits and step.floor_bytes + headroom_of(step) > memory_bytes:
        from ..report.units import human_bytes

        result.remedy_searched = True
        result.notes.append(
            f"no remedy: the parameters, buffers, optimizer state and gradients alone take "
            f"{human_bytes(step.floor_bytes)}, more than the memory, and neither smaller micro-batches, trim nor "
            f"checkpointing reduces them (train fewer parameters, keep less optimizer state, or shard the model)")
    elif remedy and not result.fits:
        from .remedy import search_levers

        def measure_with(step_inputs: Any, micro_batches: int) -> Callable[[Callable[[], Any]], Any]:
            def measure(applied: Callable[[], Any]) -> Any:
                return figures(run_step(model, step_inputs, builder=builder, optimizer_name=name, loss_fn=loss,
                                        trainable=trainable, frozen=frozen, target=target, on_meta=on_meta,
                                        autocast=autocast, applied=applied, memo=memo, accumulation=micro_batches),
                               target)
            return measure

        result.remedy, result.alternatives, more = search_levers(
            model, inputs, memory_bytes, measure_with, accumulation=accumulation, trainable=trainable, frozen=frozen,
            target=target, say=say, needed=needed, split_batch=split_batch)
        result.remedy_searched = True
        result.notes += more
        result.alternatives += _smaller_batch(result, say)
        if result.remedy is not None and result.remedy.plan is not None:
            result.notes += [n for n in result.remedy.plan.notes if n not in result.notes]
    return result


def _searchable(result: Fit, model: nn.Module, builder: Any, name: str, loss: Any, trainable: Any, frozen: Any,
                target: str, on_meta: bool, autocast: Any, inputs: Any, memo: dict,
                headroom_of: Callable[[Figures], int]) -> None:
    """Let ``result.largest`` run the same step on scaled inputs. The Fit keeps the model alive for it,
    as it keeps the inputs: ``gradaudit.fit(build(), batch).largest("batch")`` is a natural one-liner."""
    from .largest import remember

    def peak_of(scaled_inputs: Any) -> tuple[int, int]:
        run = run_step(model, scaled_inputs, builder=builder, optimizer_name=name, loss_fn=loss, trainable=trainable,
                       frozen=frozen, target=target, on_meta=on_meta, autocast=autocast, memo=memo,
                       accumulation=result.accumulation)
        step = figures(run, target)
        return step.peak_bytes, headroom_of(step)

    remember(result, peak_of, inputs)


def _smaller_batch(result: Fit, say: Callable[[str], None]) -> list[Any]:
    """The largest batch that fits as it is, beside the remedy (none where the inputs have no batch
    to shrink or even one sample does not fit)."""
    from .largest import search
    from .remedy import Alternative

    say("searching the largest batch that fits as it is")
    try:
        n, peak, size = search(result, "batch")
    except GradauditError:
        return []
    if n == 0 or n >= size:
        return []
    return [Alternative(f"a batch of {n} instead of {size}", peak, None, True)]
