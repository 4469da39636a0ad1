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

from ..compiled import compiled_paths
from ..conditions import as_audited, meta_inputs, prepare_data_parallel, resolve_target, runs_on_meta, trimmed_now
from ..errors import ForwardError, GradauditError, NothingRequiresGradError
from ..module_tracker import ModuleTracker
from ..sites import user_source_line
from ..tensors import default_loss, first_meta_parameter, iter_tensors, split_inputs, storage_key, strided_parts, unique
from ..torchapi.autograd import current_node, node_sequence_number
from ..torchapi.compiler import force_eager
from ..torchapi.ddp import bucket_view_setting, buckets_seen, no_sync
from ..torchapi.distributed import in_fake_world, local_of
from ..torchapi.pipelining import (following_chunks, passes_between_own_stages, received_buffers,
                                   sends_held_by_their_work, stages_of)
from ..torchapi.optimizers import fused_optimizers_on_meta
from ..collecting import collecting_only_new
from ..tracking import Category, Life, Lifetimes, forward_backward, keys_of
from . import optimizers
from .workspaces import GemmCount, workspaces

PARAMETERS, BUFFERS, INPUTS, STATE = Category.PARAMETERS, Category.BUFFERS, Category.INPUTS, Category.OPTIMIZER_STATE
GRADIENTS, ACTIVATIONS, TEMPORARIES = Category.GRADIENTS, Category.ACTIVATIONS, Category.TEMPORARIES
WORKSPACES = Category.WORKSPACES  # on CUDA: cuBLAS's and cuBLASLt's, cached from the first step on (workspaces.py)
BUCKETS = Category.GRADIENT_BUCKETS  # DistributedDataParallel's, alive from its construction on (torchapi/ddp.py)
STAGE_BUFFERS = Category.PIPELINE_BUFFERS  # a pipeline stage's, alive from its first step on (torchapi/pipelining.py)
# the order of a breakdown and of the timeline's rows: what is always there first
CATEGORIES = (PARAMETERS, BUFFERS, INPUTS, STATE, WORKSPACES, BUCKETS, STAGE_BUFFERS, GRADIENTS, ACTIVATIONS,
              TEMPORARIES)
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
    loss: Any = None


def phase_names(accumulation: int) -> list[tuple[str, str]]:
    """(forward, backward) phase names of each micro-batch followed: the plain names for one; with
    accumulation the first micro-batch's, then the second's, which stands for every later one."""
    if accumulation == 1:
        return [(FORWARD, BACKWARD)]
    later = "micro-batch 2" if accumulation == 2 else f"micro-batches 2-{accumulation}"
    return [(f"{FORWARD} (micro-batch 1)", f"{BACKWARD} (micro-batch 1)"),
            (f"{FORWARD} ({later})", f"{BACKWARD} ({later})")]


@dataclass
class Step:
    """One training step as fit runs it: the model and its inputs, how the loss is taken, what trains,
    the optimizer, the target and the micro-batches. ``run`` runs it (levers applied, if any) and
    returns its storages; ``on`` gives the same step on other inputs or micro-batches (the remedy's
    smaller batches, ``Fit.largest``'s scaled ones), whose storages are not attributed.

    The optimizer's step on stand-ins is remembered across the runs of one step and those ``on``
    gives, by the gradients' layouts: a plan or trim does not change them, so probing many plans steps
    the stand-ins once.
    """

    model: nn.Module
    inputs: Any
    target: str  # the device type the figures are for (on meta, what it stands for)
    on_meta: bool = False
    trainable: Any = None  # the what-if requires_grad patterns, as for audit
    frozen: Any = None
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None  # None: the output's loss, else its first tensor's sum
    builder: Any = None  # the optimizer's builder (optimizers.resolve); needed by ``run``
    optimizer_name: str = ""
    autocast: Optional[torch.dtype] = None
    accumulation: int = 1  # micro-batches (each ``inputs``) whose gradients add up before the optimizer steps
    # each storage's module and user source line (``Life.module``, ``Life.source``): what fit reports
    # of its own step; the remedy's and largest's probes compare peaks only and skip it (a frame walk
    # per storage)
    attribute: bool = True
    # a torch.distributed.pipelining schedule whose step runs this rank's micro-batches (``model``: its
    # stages' modules); None: the model's own forward and backward
    schedule: Any = None
    label: str = ""  # what the fit calls the model (default: its class's name)
    notes: list = field(default_factory=list)  # what the step's set-up found, for the fit's notes
    optimizer_steps: dict = field(default_factory=dict, repr=False)  # gradients' layouts -> the step followed

    def on(self, inputs: Any, accumulation: Optional[int] = None) -> "Step":
        """This step on other ``inputs`` (and ``accumulation``), sharing the optimizer steps remembered;
        its storages are not attributed."""
        return dataclasses.replace(self, inputs=inputs, attribute=False,
                                   accumulation=self.accumulation if accumulation is None else accumulation)

    def forward_backward(self, applied: Callable[[], Any] = contextlib.nullcontext,
                         watch: Optional[Callable[[str], Any]] = None) -> tuple[int, int]:
        """The step without its optimizer, as the planner measures it: (held after the forward less the
        outputs, peak through forward and backward) beside what is alive anyway, with ``applied()`` in
        force (a plan's or a baseline's checkpointing), on the model's device (``tracking.forward_backward``:
        the tracker on CPU and meta, the caching allocator's counters on CUDA; ``watch`` as it takes
        it). One micro-batch; the model is left as found."""
        args, kwargs = split_inputs(self.inputs)
        with as_audited(self.model, self.inputs, self.trainable, self.frozen, self.target), applied():
            _steady_trim(self, args, kwargs)
            return forward_backward(self.model, args, kwargs, self.loss_fn or default_loss, watch)

    def run(self, applied: Callable[[], Any] = contextlib.nullcontext) -> StepRun:
        """Run the whole step (``applied()`` in force around the forwards and backwards: a plan, trim) and
        return its storages. The model is left as found."""
        if self.builder is None:
            raise GradauditError("a Step runs its optimizer's step: give it the builder (optimizers.resolve)")
        model = self.model
        args, kwargs = split_inputs(self.inputs)
        device = "meta" if self.on_meta else _device_of(model, self.inputs)
        persistent = _Persistent(device)
        notes: list[str] = list(self.notes)
        with as_audited(model, self.inputs, self.trainable, self.frozen, self.target):
            persistent.keep(PARAMETERS, list(model.parameters()))
            persistent.keep(BUFFERS, list(model.buffers()))
            inputs = unique(list(iter_tensors((args, kwargs))))
            persistent.keep(INPUTS, inputs)
            leaves = [t for t in inputs if t.is_leaf and t.requires_grad]
            # what the optimizer steps: the parameters that train; where none does and inputs require grad
            # (adversarial examples, style transfer), those inputs
            trains = [p for p in model.parameters() if p.requires_grad] or leaves
            if trains and trains is leaves:
                notes.append(f"no parameter trains: the optimizer steps the {len(leaves)} input tensor(s) that "
                             f"require grad, as adversarial and style-transfer loops do")
            tracker, where = _attribution(model, sys._getframe()) if self.attribute else (contextlib.nullcontext(), None)
            gemms = GemmCount()  # the matrix products run (on CUDA they hold cuBLAS's workspaces)
            lifetimes = Lifetimes(persistent.seen, persistent.counts, where, observe=gemms.count)
            # a compiled model's step runs eagerly, as Lifetimes' dispatch mode makes TorchDynamo do anyway
            # (explicitly: whatever the release's rule for modes; the Fit's note says so, compiled.FIT)
            eager = force_eager("fit") if compiled_paths(model) else contextlib.nullcontext()
            with applied(), tracker, buckets_seen() as buckets, eager:
                _steady_trim(self, args, kwargs)
                if self.schedule is not None:
                    micro = _scheduled(self, args, kwargs, lifetimes, gemms)
                else:
                    micro = _micro_batches(self, args, kwargs, lifetimes, gemms)
            notes += _buckets_apart(lifetimes, buckets, persistent, model)
            if self.schedule is not None:
                notes += _stage_buffers_apart(lifetimes, self.schedule, persistent, len(micro.passed))
            if self.target == "cuda":
                persistent.sizes[WORKSPACES], note = _workspaces(micro.forward_gemms, gemms.minus(micro.forward_gemms))
                notes += [note] if note else []
            gradients = {id(p): p.grad for p in unique([*trains, *leaves]) if p.grad is not None}
            _categorise(lifetimes.lives, {storage_key(g) for g in gradients.values()}, micro)
            # every gradient is the step's (an input's too); the optimizer takes those of what it steps
            layouts = [(p, gradients[id(p)]) for p in trains if id(p) in gradients]
            carried = [life for life in lifetimes.lives if life.died is None]
            if trains or self.schedule is None:
                state_notes, remembered, persistent.sizes[STATE], samples = self._optimizer_step(trains, layouts)
            else:  # a pipeline stage none of whose parameters trains (a probe's stages before the probed layer)
                state_notes, remembered, persistent.sizes[STATE], samples = [
                    "no parameter of this stage trains: its optimizer has nothing to step"], [], [], 0
            notes += state_notes
            phases, output_cache = micro.phases, micro.output_cache
            del micro, gradients, layouts
        lives = list(lifetimes.lives)
        # what the backward left alive (the gradients, the loss) stays alive through the optimizer step
        offset = lifetimes.samples
        for life in remembered:
            life = dataclasses.replace(life)  # the remembered lives stay as they are: offset per run
            life.born += offset
            life.died = life.died + offset if life.died is not None else None
            lives.append(life)
        # the optimizer's step leaves the gradients alive; zero_grad(set_to_none=True) frees them after it
        for life in carried:
            if life.category == GRADIENTS:
                life.died = offset + samples + 1
        if not self.on_meta and device != "cpu":
            notes.append(f"on {device}, the figures count storages as PyTorch's allocator is asked for them")
        return StepRun(persistent.sizes, lives, [*phases, (OPTIMIZER, samples + 1)], notes, trained=len(trains),
                       output_cache=output_cache)

    def _optimizer_step(self, trains: Sequence[torch.Tensor],
                        layouts: Sequence[tuple[Any, torch.Tensor]]) -> tuple[list[str], list[Life], list[int], int]:
        """``_optimizer_step`` for these gradients' layouts, remembered."""
        key = tuple((id(p), tuple(local_of(g).shape), local_of(g).stride(), g.dtype) for p, g in layouts)
        if key not in self.optimizer_steps:
            self.optimizer_steps[key] = _optimizer_step(self.model, trains, layouts, self.builder,
                                                        self.optimizer_name, self.target)
        return self.optimizer_steps[key]


def prepared_step(model: nn.Module, inputs: Any, target: Optional[str], trainable: Any, frozen: Any,
                  **options: Any) -> Step:
    """The step fit runs: its inputs as the run takes them (beside a meta model, real tensors become meta
    tensors whose values are kept), on meta or not, the target resolved, the patterns as lists; in a fake
    process group, each DistributedDataParallel given a hook that reduces nothing (``conditions``)."""
    prepare_data_parallel(model)
    inputs = meta_inputs(model, inputs)
    tensors = list(iter_tensors(inputs))
    on_meta = runs_on_meta(first_meta_parameter(model.parameters()), tensors)
    first = next(iter(model.parameters()), None)
    target = resolve_target(target, on_meta, ([first] if first is not None else []) + tensors)
    return Step(model, inputs, target, on_meta, trainable=[trainable] if isinstance(trainable, str) else trainable,
                frozen=[frozen] if isinstance(frozen, str) else frozen, **options)


class _Persistent:
    """The storages alive throughout the step, by category (each storage counted once, on the step's
    device only)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.sizes: dict[str, list[int]] = {c: [] for c in CATEGORIES}
        self.seen: set[int] = set()

    def counts(self, where: torch.device) -> bool:
        return where.type == self.device

    def keep(self, category: str, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            for part in strided_parts(t):
                key = storage_key(part)
                if key not in self.seen and self.counts(part.device):
                    self.seen.add(key)
                    self.sizes[category].append(part.untyped_storage().nbytes())


def _attribution(model: nn.Module, stop: Any) -> tuple[ModuleTracker, Callable[[], tuple[str, Optional[str]]]]:
    """What made each storage: the module whose forward runs (a checkpoint's recomputation in backward
    too) and the user's line, found up to ``stop`` (fit's frame; beyond it: the caller of fit). In
    backward, the module whose forward made the node running then (the tracker's timeline of which
    module ran from which node's sequence number on). Returns the tracker, to be entered around the
    micro-batches, and ``where``."""
    tracker = ModuleTracker(model)
    tracker.timeline = []

    def where() -> tuple[str, Optional[str]]:
        module = tracker.stack[-1][0]
        if len(tracker.stack) == 1:
            node = current_node()
            if node is not None:
                module = tracker.running_at(node_sequence_number(node))[0]
        return module, user_source_line(sys._getframe(1), stop)

    return tracker, where


@dataclass
class _MicroBatches:
    """What the forwards and backwards of the micro-batches left to categorise the lives by."""

    held: set[int] = field(default_factory=set)  # lives alive when a forward ends, by identity
    # lives that were a gradient when a backward ended, by identity (one a later backward replaced too:
    # DDP's gradient_as_bucket_view swaps an accumulated gradient for its bucket's view)
    gradients: set[int] = field(default_factory=set)
    losses: set[int] = field(default_factory=set)  # the lives of each micro-batch's loss
    forward_gemms: Optional[GemmCount] = None  # the first forward's matrix products (workspaces.py)
    phases: list[tuple[str, int]] = field(default_factory=list)  # (phase, samples) in order
    output_cache: bool = False  # the forward returned a key/value cache (Hugging Face use_cache=True)
    # a pipeline schedule's step: what a forward made and the step still holds at its end (the last
    # stage's output chunks, its losses) is kept until the next step, not held for a backward
    kept_over: bool = False
    # lives of what a V-shaped schedule's stages pass each other, kept in their receive infos until the next
    # step replaces them (the previous step's, followed from the start, and this one's): by identity
    passed: set[int] = field(default_factory=set)

    def note_gradients(self, lifetimes: Lifetimes, tensors: Sequence[torch.Tensor]) -> None:
        """The lives that are the gradients of ``tensors`` now (when a backward ends)."""
        grads = [t.grad for t in tensors if t.grad is not None]
        self.gradients |= {id(lifetimes.live[key]) for key in keys_of(grads) if key in lifetimes.live}


def _micro_batches(step: Step, args: tuple, kwargs: dict, lifetimes: Lifetimes, gemms: GemmCount) -> _MicroBatches:
    """Each micro-batch's forward, loss and backward, followed by ``lifetimes`` (closed after them)."""
    micro, loss = _MicroBatches(), None
    for first, (forward_name, backward_name) in zip((True, False), phase_names(step.accumulation)):
        # DDP: the micro-batches but the last accumulate under no_sync, as DDP's documentation has it;
        # the second stands for the last (the one that reduces)
        with no_sync(step.model) if first and step.accumulation > 1 else contextlib.nullcontext():
            start = lifetimes.samples
            loss, micro.output_cache = _forward(step.model, args, kwargs, lifetimes, step.loss_fn, step.target,
                                                step.autocast, step.accumulation)
            micro.held |= {id(life) for life in lifetimes.live.values()}  # by identity: a later storage may take a key
            loss_life = lifetimes.live.get(storage_key(loss))
            if loss_life is not None:
                micro.losses.add(id(loss_life))
            if micro.forward_gemms is None:
                micro.forward_gemms = dataclasses.replace(gemms)
            middle = lifetimes.samples
            with lifetimes:
                loss.backward()
        micro.note_gradients(lifetimes, [*step.model.parameters(), *iter_tensors((args, kwargs))])
        micro.phases += [(forward_name, middle - start), (backward_name, lifetimes.samples - middle)]
    lifetimes.close()
    micro.loss = loss  # the last micro-batch's: alive until the step's run lets go of it, as a training loop's
    return micro


def _alive_throughout(lifetimes: Lifetimes, tensors: Sequence[torch.Tensor], persistent: _Persistent,
                      category: Category) -> int:
    """The storages of ``tensors`` taken out of the step's lives into ``category``, alive throughout
    (storages made once and kept, which the first step allocates and the tracker may first see in the
    middle of a later one); their bytes."""
    sizes = {}
    for t in tensors:
        if persistent.counts(t.device):
            sizes[storage_key(t)] = t.untyped_storage().nbytes()
    # (alive when the tracking ended: a storage that died earlier had the address before)
    lifetimes.lives[:] = [life for life in lifetimes.lives if life.died is not None or life.key not in sizes]
    persistent.seen |= set(sizes)
    persistent.sizes[category] = list(sizes.values())
    return sum(sizes.values())


def _buckets_apart(lifetimes: Lifetimes, buckets: Sequence[torch.Tensor], persistent: _Persistent,
                   model: nn.Module) -> list[str]:
    """DDP's gradient buckets (those its hook was handed), alive throughout: before the step and after it
    (the tracker first sees them when the backward copies a gradient in; on the iteration that rebuilds
    them, when the forward allocates them). The note that says so, where there are any."""
    if not buckets or not _alive_throughout(lifetimes, buckets, persistent, BUCKETS):
        return []
    sizes = persistent.sizes[BUCKETS]
    views = bucket_view_setting(model)
    held = ("the gradients are views of them (gradient_as_bucket_view=True)" if views else
            "as large as the gradients again: gradient_as_bucket_view=True would make the gradients views of them")
    return [f"DistributedDataParallel: {sum(sizes)} bytes of gradient buckets, alive throughout, {held}; "
            f"in the fake process group they are reduced by no communication"]


def _stage_buffers_apart(lifetimes: Lifetimes, schedule: Any, persistent: _Persistent, passed: int) -> list[str]:
    """A pipeline stage's receive buffers, alive throughout from its first step on (but those its rank's
    own stages fill: their ``passed`` lives are the step's); the notes saying so."""
    buffers = received_buffers(schedule, passed=False)
    nbytes = _alive_throughout(lifetimes, buffers, persistent, STAGE_BUFFERS)
    notes = []
    if nbytes:
        notes.append(f"the pipeline stage keeps {len(buffers)} receive buffers ({nbytes} bytes) from its first step "
                     f"on: for each micro-batch, the activations it is sent (every stage but the first) and the "
                     f"gradients sent back to it (every stage but the last)")
    if passed:
        notes.append("this rank's adjacent stages pass each other their outputs and gradients, which stay in the "
                     "receiving stage's buffers until the next step replaces them (pipeline_buffers): the step "
                     "followed is the second, which starts with the first's")
    return notes


def _scheduled(step: Step, args: tuple, kwargs: dict, lifetimes: Lifetimes, gemms: GemmCount) -> _MicroBatches:
    """This rank's step of a pipeline schedule (``schedule.step(*args, **kwargs)``: each micro-batch's
    forward and backward in the schedule's order), followed by ``lifetimes`` (closed after it), one
    phase per micro-batch's forward or backward."""
    micro = _MicroBatches(kept_over=True)
    stages = stages_of(step.schedule)
    starts: list[tuple[str, int]] = []

    def begin(kind: str, stage: int, chunk: int) -> None:
        where = f"stage {stage}, " if len(stages) > 1 else ""
        starts.append((f"{kind} ({where}micro-batch {chunk + 1})", lifetimes.samples))

    def end(kind: str, stage: int, chunk: int) -> None:
        if kind == "forward":
            micro.held |= {id(life) for life in lifetimes.live.values()}
            if micro.forward_gemms is None:
                micro.forward_gemms = dataclasses.replace(gemms)
        else:
            micro.note_gradients(lifetimes, list(step.model.parameters()))

    region = torch.autocast(step.target, dtype=step.autocast) if step.autocast is not None else contextlib.nullcontext()
    held = sends_held_by_their_work if in_fake_world() else contextlib.nullcontext
    if passes_between_own_stages(step.schedule):
        # what its stages pass each other stays in their receive infos until the next step replaces it: a
        # step first, so that the followed one starts as a training loop's does, with the last step's
        with held(), region:
            _schedule_step(step.schedule, args, kwargs)
        for parameter in step.model.parameters():
            parameter.grad = None  # zero_grad(set_to_none=True) after it
        micro.passed |= {id(life) for life in lifetimes.adopt(received_buffers(step.schedule, passed=True),
                                                                "the last step's pass")}
    with lifetimes, following_chunks(stages, begin, end), held(), region:
        _schedule_step(step.schedule, args, kwargs)
    passed = keys_of(received_buffers(step.schedule, passed=True))
    micro.passed |= {id(lifetimes.live[key]) for key in passed if key in lifetimes.live}
    lifetimes.close()
    ends = [start for _, start in starts[1:]] + [lifetimes.samples]
    first = starts[0][1] if starts else lifetimes.samples
    micro.phases = ([("schedule set-up", first)] if first else []) + [(name, stop - start) for (name, start), stop
                                                                in zip(starts, ends)]
    return micro


def _schedule_step(schedule: Any, args: tuple, kwargs: dict) -> None:
    """``schedule.step(*args, **kwargs)``, its merged output dropped as a training loop drops it (its
    chunks stay, the stage's); what it raises said as the forward's error."""
    try:
        output = schedule.step(*args, **kwargs)
    except GradauditError:
        raise
    except Exception as error:
        raise ForwardError(f"the schedule's step raised {type(error).__name__}: {error}") from error
    del output


def _categorise(lives: Sequence[Life], gradient_keys: set[int], micro: _MicroBatches) -> None:
    """Each life's category: what a V-shaped schedule's stages pass each other, kept for the next step, a
    pipeline buffer; a gradient alive at the end (or one when a backward ended), an activation held from
    a forward into its backward (the loss aside), else a temporary."""
    for life in lives:
        if id(life) in micro.passed:
            life.category = STAGE_BUFFERS
        elif (life.died is None and life.key in gradient_keys) or id(life) in micro.gradients:
            life.category = GRADIENTS
        elif id(life) in micro.held and id(life) not in micro.losses and not (micro.kept_over and life.died is None):
            life.category = ACTIVATIONS
        else:
            life.category = TEMPORARIES


def _workspaces(forward: GemmCount, backward: GemmCount) -> tuple[list[int], Optional[str]]:
    from ..cuda_choices import assumed_gpu

    return workspaces(forward, backward, assumed_gpu().capability)


def _device_of(model: nn.Module, inputs: Any) -> str:
    for t in [*model.parameters(), *iter_tensors(inputs)]:
        return t.device.type
    return "cpu"


def _steady_trim(step: Step, args: tuple, kwargs: dict) -> None:
    """With gradaudit.trim installed on the step's model, its first forward decides and the later ones
    follow its steady plan, which is what a training loop runs and so what a step measures: one
    forward and backward first, untracked, the model put back after it (``trimming.handle.settle``)."""
    if step.schedule is not None or not trimmed_now(step.model):
        return
    from ..trimming.handle import settle

    def run() -> None:
        region = (torch.autocast(step.target, dtype=step.autocast) if step.autocast is not None
                  else contextlib.nullcontext())
        with region:
            loss = (step.loss_fn or default_loss)(step.model(*args, **kwargs))
        loss.backward()

    settle(step.model, args, kwargs, run)


def _forward(model: nn.Module, args: tuple, kwargs: dict, lifetimes: Lifetimes, loss_fn: Optional[Callable],
             target: str, autocast: Optional[torch.dtype], accumulation: int = 1) -> tuple[torch.Tensor, bool]:
    """The forward and the loss (divided by ``accumulation`` where it is over 1), with the model's
    output dropped after it (garbage cycles collected): (the loss, whether the output carried a
    key/value cache)."""
    region = torch.autocast(target, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with collecting_only_new():  # the collection below: only what the forward made
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
