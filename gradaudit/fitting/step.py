"""One steady-state training step, run and followed storage by storage.

The step, as a training loop runs it once the optimizer has state (after a first step) and every
``.grad`` is None (``zero_grad(set_to_none=True)``)::

    for micro_batch in range(accumulation):  # one, unless gradients are accumulated
        output = model(*args, **kwargs)      # under torch.autocast(target, dtype) with autocast=dtype
        loss = loss_fn(output)               # (the autocast region closes here)
        loss = loss / accumulation           # (with accumulation > 1)
        del output
        loss.backward()                      # the first allocates .grad, the others add to it
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

With accumulation, the first micro-batch and the second are followed: the second runs with the
gradients of the first alive and adds to them, as every later one does, storage for storage.

The forward and backward run on the model as it is (its device, or meta standing for the target,
as an audit runs it), left as found; the optimizer's step runs on meta stand-ins of the parameters
and their gradients (it needs shapes, not values, and must not change the user's weights).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..errors import ForwardError, GradauditError, NothingRequiresGradError
from ..module_tracker import ModuleTracker
from ..sites import user_source_line
from ..tensors import default_loss, iter_tensors, split_inputs, storage_key, strided_parts, unique
from . import optimizers
from .lifetimes import Life, Lifetimes
from .workspaces import GemmCount, workspaces
from ..torchapi.autograd import current_node, node_sequence_number
from ..torchapi.distributed import local_of
from ..torchapi.optimizers import fused_optimizers_on_meta

PARAMETERS, BUFFERS, INPUTS, STATE = "parameters", "buffers", "inputs", "optimizer_state"
GRADIENTS, ACTIVATIONS, TEMPORARIES = "gradients", "activations", "temporaries"
WORKSPACES = "workspaces"  # on CUDA: cuBLAS's and cuBLASLt's, cached from the first step on (workspaces.py)
# the order of a breakdown and of the timeline's rows: what is always there first
CATEGORIES = (PARAMETERS, BUFFERS, INPUTS, STATE, WORKSPACES, GRADIENTS, ACTIVATIONS, TEMPORARIES)
FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"


@dataclass
class StepRun:
    """The storages of one step: those alive throughout (by category), and the lives of those made
    in each phase, categorised; ``notes``: what the figures rest on."""

    persistent: dict[str, list[int]]  # category -> storage sizes
    lives: list[Life]  # every storage the step made, categorised
    phases: list[tuple[str, int]]  # (phase, samples) in order
    notes: list[str] = field(default_factory=list)
    trained: int = 0  # parameters with a gradient
    output_cache: bool = False  # the forward returned a key/value cache (Hugging Face use_cache=True)


def phase_names(accumulation: int) -> list[tuple[str, str]]:
    """(forward, backward) phase names of each micro-batch followed: the plain names for one; with
    accumulation the first micro-batch's, then the second's, which stands for every later one."""
    if accumulation == 1:
        return [(FORWARD, BACKWARD)]
    later = "micro-batch 2" if accumulation == 2 else f"micro-batches 2-{accumulation}"
    return [(f"{FORWARD} (micro-batch 1)", f"{BACKWARD} (micro-batch 1)"),
            (f"{FORWARD} ({later})", f"{BACKWARD} ({later})")]


def run_step(model: nn.Module, inputs: Any, *, builder: Any, optimizer_name: str, loss_fn: Optional[Callable],
             trainable: Any, frozen: Any, target: str, on_meta: bool, autocast: Optional[torch.dtype],
             applied: Callable[[], Any] = contextlib.nullcontext, memo: Optional[dict] = None,
             accumulation: int = 1) -> StepRun:
    """Run the step (``applied()`` in force around the forward and backward: a plan, trim) and
    return its storages. The model is left as found. ``memo``: a dict kept across the runs of one fit,
    where the optimizer's step is remembered by the gradients' layouts (a plan or trim does not
    change them, so probing many plans steps the stand-ins once). ``accumulation``: micro-batches
    (each ``inputs``) whose gradients add up before the optimizer steps."""
    from ..planning.conditions import as_audited

    args, kwargs = split_inputs(inputs)
    device = "meta" if on_meta else _device_of(model, inputs)

    def counts(where: torch.device) -> bool:
        return where.type == device

    persistent: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    seen: set[int] = set()

    def keep(category: str, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            for part in strided_parts(t):
                key = storage_key(part)
                if key not in seen and counts(part.device):
                    seen.add(key)
                    persistent[category].append(part.untyped_storage().nbytes())

    notes: list[str] = []
    with as_audited(model, inputs, trainable, frozen, target):
        keep(PARAMETERS, list(model.parameters()))
        keep(BUFFERS, list(model.buffers()))
        keep(INPUTS, unique(list(iter_tensors((args, kwargs)))))
        leaves = [t for t in unique(list(iter_tensors((args, kwargs)))) if t.is_leaf and t.requires_grad]
        # what the optimizer steps: the parameters that train; where none does and inputs require grad
        # (adversarial examples, style transfer), those inputs
        trains = [p for p in model.parameters() if p.requires_grad] or leaves
        if trains and trains is leaves:
            notes.append(f"no parameter trains: the optimizer steps the {len(leaves)} input tensor(s) that require "
                         f"grad, as adversarial and style-transfer loops do")
        # what made each storage: the module whose forward runs (a checkpoint's recomputation in
        # backward too) and the user's line, found up to this frame (beyond it: the caller of fit).
        # In backward, the module whose forward made the node running then (the tracker's timeline
        # of which module ran from which node's sequence number on)
        tracker, stop = ModuleTracker(model), sys._getframe()
        tracker.timeline = []

        def where() -> tuple[str, Optional[str]]:
            module = tracker.stack[-1][0]
            if len(tracker.stack) == 1:
                node = current_node()
                if node is not None:
                    module = tracker.running_at(node_sequence_number(node))[0]
            return module, user_source_line(sys._getframe(1), stop)

        lifetimes = Lifetimes(seen, counts, where)
        phases: list[tuple[str, int]] = []
        held: set[int] = set()  # lives alive when a forward ends, by identity (a later storage may take a key)
        losses: set[int] = set()  # the lives of each micro-batch's loss
        with applied(), tracker:
            for forward_name, backward_name in phase_names(accumulation):
                start = lifetimes.samples
                loss, cache = _forward(model, args, kwargs, lifetimes, loss_fn, target, autocast, accumulation)
                held |= {id(life) for life in lifetimes.live.values()}
                loss_life = lifetimes.live.get(storage_key(loss))
                if loss_life is not None:
                    losses.add(id(loss_life))
                if not phases:
                    forward_gemms = dataclasses.replace(lifetimes.gemms)
                middle = lifetimes.samples
                with lifetimes:
                    loss.backward()
                phases += [(forward_name, middle - start), (backward_name, lifetimes.samples - middle)]
            lifetimes.close()
        if target == "cuda":
            persistent[WORKSPACES], note = _workspaces(forward_gemms, lifetimes.gemms.minus(forward_gemms))
            notes += [note] if note else []
        gradients = {}
        for p in unique([*trains, *leaves]):
            if p.grad is not None:
                gradients[id(p)] = p.grad
        grad_keys = {storage_key(g) for g in gradients.values()}
        for life in lifetimes.lives:
            if life.died is None and life.key in grad_keys:
                life.category = GRADIENTS
            elif id(life) in held and id(life) not in losses:
                life.category = ACTIVATIONS
            else:
                life.category = TEMPORARIES
        # every gradient is the step's (an input's too); the optimizer takes those of what it steps
        layouts = [(p, gradients[id(p)]) for p in trains if id(p) in gradients]
        carried = [life for life in lifetimes.lives if life.died is None]
        key = tuple((id(p), tuple(local_of(g).shape), local_of(g).stride(), g.dtype) for p, g in layouts)
        if memo is None or key not in memo:
            found = _optimizer_step(model, trains, layouts, builder, optimizer_name, target)
            if memo is not None:
                memo[key] = found
        else:
            found = memo[key]
        state_notes, remembered, state_sizes, samples = found
        optimizer_lives = [dataclasses.replace(life) for life in remembered]  # offset below, per run
        notes += state_notes
        del loss, gradients, layouts
    persistent[STATE] = state_sizes
    lives = list(lifetimes.lives)
    # what the backward left alive (the gradients, the loss) stays alive through the optimizer step
    offset = lifetimes.samples
    for life in optimizer_lives:
        life.born += offset
        life.died = life.died + offset if life.died is not None else None
    # the optimizer's step leaves the gradients alive; zero_grad(set_to_none=True) frees them after it
    end = offset + samples + 1
    for life in carried:
        if life.category == GRADIENTS:
            life.died = end
    lives += optimizer_lives
    if not on_meta and device != "cpu":
        notes.append(f"on {device}, the figures count storages as PyTorch's allocator is asked for them")
    return StepRun(persistent, lives, [*phases, (OPTIMIZER, samples + 1)], notes, trained=len(trains),
                   output_cache=cache)


def _workspaces(forward: GemmCount, backward: GemmCount) -> tuple[list[int], Optional[str]]:
    from ..cuda_choices import assumed_gpu

    return workspaces(forward, backward, assumed_gpu().capability)


def _device_of(model: nn.Module, inputs: Any) -> str:
    for t in [*model.parameters(), *iter_tensors(inputs)]:
        return t.device.type
    return "cpu"


def _forward(model: nn.Module, args: tuple, kwargs: dict, lifetimes: Lifetimes, loss_fn: Optional[Callable],
             target: str, autocast: Optional[torch.dtype], accumulation: int = 1) -> tuple[torch.Tensor, bool]:
    """The forward and the loss (divided by ``accumulation`` where it is over 1), with the model's
    output dropped after it (garbage cycles collected): (the loss, whether the output carried a
    key/value cache)."""
    region = torch.autocast(target, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    # the collection below looks only at the objects made since the forward began (gc.freeze sets the
    # older ones aside): a full one costs tens of milliseconds once transformers is imported, more
    # than a small step; it misses only a garbage cycle through an object older than the forward
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        with lifetimes, region:
            try:
                output = model(*args, **kwargs)
            except GradauditError:
                raise
            except Exception as error:
                raise ForwardError(f"the forward raised {type(error).__name__}: {error}") from error
            loss = (loss_fn or default_loss)(output)
            if accumulation > 1 and isinstance(loss, torch.Tensor):
                loss = loss / accumulation
        cache = _has_cache(output)
        del output
        gc.collect()
    finally:
        if freeze:
            gc.unfreeze()
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise GradauditError(f"the loss must be a tensor of one element, got "
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
    if loss.grad_fn is None:
        raise NothingRequiresGradError("the loss does not require grad: nothing trains. Unfreeze parameters "
                                       "(trainable=[...] / --trainable GLOB)")
    return loss, cache


def _has_cache(output: Any) -> bool:
    """Whether a Hugging Face output carries a key/value cache (read as a dict: the attribute warns)."""
    return isinstance(output, dict) and any(dict.get(output, key) is not None
                                            for key in ("past_key_values", "cache", "cache_params"))


def _optimizer_step(model: nn.Module, trains: Sequence[torch.Tensor], layouts: Sequence[tuple[Any, torch.Tensor]],
                    builder: Any, name: str, target: str) -> tuple[list[str], list[Life], list[int], int]:
    """The optimizer's steady-state step on meta stand-ins: (notes, the lives of the storages its
    step made, the sizes of its state, the step's samples). A first step makes the state; the
    second is followed."""
    stand_in = {}
    for p in [*model.parameters(), *trains]:
        if id(p) not in stand_in:
            shard = local_of(p)
            stand_in[id(p)] = torch.empty_strided(shard.shape, shard.stride(), dtype=p.dtype, device="meta",
                                                  requires_grad=p.requires_grad)
    # a DTensor gradient may be placed otherwise than its parameter (an embedding sharded by rows gets a
    # replicated gradient): the optimizer's ops redistribute it to the parameter's placement and step
    # that, so the stand-in takes the parameter's local layout (the redistribution itself: not followed)
    grads, placed = [], 0
    for p, g in layouts:
        stand, shard = stand_in[id(p)], local_of(g)
        if shard.shape != stand.shape:
            placed += 1
            grads.append((stand, torch.empty_strided(stand.shape, stand.stride(), dtype=g.dtype, device="meta")))
        else:
            grads.append((stand, torch.empty_strided(shard.shape, shard.stride(), dtype=g.dtype, device="meta")))
    # fused=True: the stand-ins are meta tensors, which torch.optim's device check leaves out
    with fused_optimizers_on_meta():
        optimizer = optimizers.build(builder, optimizers.stand_in_groups(builder, trains, stand_in), name)
        notes = optimizers.target_defaults(optimizer, target)
        if placed:
            whose = "parameters' gradients are" if placed > 1 else "parameter's gradient is"
            notes.append(f"{placed} {whose} placed otherwise than the parameter (DTensor: e.g. replicated for a "
                         f"sharded embedding); the optimizer steps it redistributed to the parameter's shard, and "
                         f"that redistribution's temporary copy is not counted")

        def counts(where: torch.device) -> bool:
            # the stand-ins are meta tensors; an optimizer also keeps CPU scalars (Adam's step counts, unless
            # capturable or fused), which are the step's memory when the target is the CPU
            return where.type == "meta" or (where.type == "cpu" and target == "cpu")

        for stand, grad in grads:
            stand.grad = grad
        with torch.no_grad():
            optimizers.step(optimizer, name)  # the first step makes the state
        optimizer.zero_grad(set_to_none=True)
        for stand, grad in grads:
            stand.grad = grad
        state = [t for values in optimizer.state.values() for t in iter_tensors(values)]
        keys = {storage_key(t) for t in [*stand_in.values(), *(g for _, g in grads), *state] if counts(t.device)}
        state_sizes, counted = [], set()
        for t in state:
            if counts(t.device) and storage_key(t) not in counted:
                counted.add(storage_key(t))
                state_sizes.append(t.untyped_storage().nbytes())
        lifetimes = Lifetimes(keys, counts)
        with lifetimes, torch.no_grad():
            optimizers.step(optimizer, name)
        lifetimes.close()
        new_state = {storage_key(t) for values in optimizer.state.values() for t in iter_tensors(values)}
        for life in lifetimes.lives:
            life.category = STATE if life.key in new_state else TEMPORARIES
        optimizer.zero_grad(set_to_none=True)
    return notes, list(lifetimes.lives), state_sizes, lifetimes.samples
