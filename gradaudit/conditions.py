"""How a run is set up, and put back: the device type it stands for (``resolve_target``), whether it
runs on meta (``runs_on_meta``, ``meta_inputs``), the requires_grad what-if of trainable and frozen
patterns (``check_patterns``, ``apply_trainable``), and the model's state kept and restored
(``ModelState``); ``as_audited`` puts them together for a run that must see the model as the audit
did. The audit, the planner, fit and trim all set up their runs here."""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import sys
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from .errors import GradauditError, NoMatchingParameterError
from .meta import TARGETS, standing_for
from .tensors import Args, ModelTree, first_meta_parameter, iter_tensors, split_inputs
from .torchapi.distributed import in_fake_world
from .torchapi.ddp import reduce_locally
from .torchapi.modules import hook_counts_of, module_slots
from .torchapi.pipelining import example_inputs, micro_batch_count, stages_of
from .torchapi.storages import version_counter
from .values import to_meta


def matching_parameters(model: nn.Module, patterns: Sequence[str],
                        names: Optional[Sequence[str]] = None) -> set[str]:
    """The parameter names (``names``, default ``named_parameters()``'s) matching any pattern."""
    if names is None:
        names = [n for n, _ in model.named_parameters()]
    return {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)}


def check_patterns(model: nn.Module, patterns: Optional[Sequence[str]], label: str,
                   names: Optional[Sequence[str]] = None) -> None:
    """Raise NoMatchingParameterError for the first pattern that matches no parameter name.

    A pattern that matches nothing (a typo, ``fc`` for ``fc.*``, a name from another model) would
    silently audit a different freezing pattern than the one asked for; the error names up to
    three real names closest to it. ``label`` names the option (``--trainable``, ``trainable``).
    ``names``: the model's parameter names when the caller has them (default: ``named_parameters()``).
    """
    if not patterns:
        return
    if names is None:
        names = [n for n, _ in model.named_parameters()]
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(n, pattern) for n in names):
            continue
        if not names:
            raise NoMatchingParameterError(f"{label} {pattern!r} matches no parameter: the model has no "
                                           f"parameters")
        # glob characters say nothing about closeness: compare the literal part of the pattern;
        # a module path ("layers.3" for "layers.3.*") names its own parameters first
        literal = pattern.replace("*", "").replace("?", "").replace("[", "").replace("]", "")
        near = [n for n in names if literal and n.startswith(literal)][:3]
        near += [n for n in difflib.get_close_matches(literal, names, n=3, cutoff=0.0) if n not in near]
        near = near[:3]
        raise NoMatchingParameterError(
            f"{label} {pattern!r} matches no parameter (globs match whole names from named_parameters()); "
            f"nearest: {', '.join(near)}")


def apply_trainable(model: nn.Module, trainable: Optional[Sequence[str]], frozen: Optional[Sequence[str]],
                    tree: Optional[ModelTree] = None) -> None:
    """The what-if: with ``trainable``, exactly the matching parameters require grad; parameters
    matching ``frozen`` do not. No patterns: the flags stay as they are. A pattern that matches no
    parameter raises NoMatchingParameterError (before any flag changes). ``tree``: the model's
    ModelTree when the caller has one (default: one taken here)."""
    if trainable is None and not frozen:
        return
    named = (tree or ModelTree(model)).parameters
    names = [n for n, _ in named]
    check_patterns(model, trainable, "trainable", names)
    check_patterns(model, frozen, "frozen", names)
    chosen = matching_parameters(model, trainable, names) if trainable is not None else None
    blocked = matching_parameters(model, frozen, names) if frozen else set()
    for name, p in named:
        want = (name in chosen) if chosen is not None else p.requires_grad
        if name in blocked:
            want = False
        if p.requires_grad != want:
            p.requires_grad_(want)


class ModelState:
    """Everything an audit could disturb, captured before and put back afterwards.

    Parameters are restored by identity and flags (a forward does not change their values; if one
    does, in place, the audit reports it rather than silently keeping a copy of every weight).
    Buffers are copied because a train-mode forward updates BatchNorm running statistics (in
    place, without bumping their version counter, so values are compared, not versions).
    Submodule slots are kept too: a forward may replace a submodule.

    ``tree``: the model's ModelTree when the caller has one (default: one taken here).
    """

    def __init__(self, model: nn.Module, tree: Optional[ModelTree] = None) -> None:
        self.model = model
        tree = tree or ModelTree(model)
        self.modules = tree.module_list
        self.training = [m.training for m in self.modules]
        slots = module_slots
        self.slots = [(m, *map(dict, slots(m))) for m in self.modules]
        version = version_counter
        self.flags = [(p, p.requires_grad, p.grad, version(p)) for _, p in tree.parameters]
        # meta buffers have no values to restore (and cloning them would be free anyway)
        self.buffer_values = [(b, b.detach().clone()) for b in tree.buffers if not b.is_meta]
        self.hook_counts = self._hook_counts()
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = (torch.cuda.get_rng_state_all()
                         if torch.cuda.is_available() and torch.cuda.is_initialized() else None)

    def _hook_counts(self) -> list[tuple[int, ...]]:
        return hook_counts_of(self.modules)

    def restore(self) -> list[str]:
        """Put everything back; returns notes about what could not be restored exactly."""
        notes = []
        for m, flag in zip(self.modules, self.training):
            if m.training is not flag:  # nn.Module.__setattr__ is slow, and most flags are as they were
                m.training = flag
        for m, *saved in self.slots:
            for live, slots in zip(module_slots(m), saved):
                if live or slots:  # most are empty, and stayed so
                    live.clear()
                    live.update(slots)
        with torch.no_grad():
            for buffer, value in self.buffer_values:
                # compared by value: native_batch_norm updates running statistics without bumping
                # the buffers' version counter
                if not torch.equal(buffer, value):
                    # through .data, which does not bump the version either: a graph the caller
                    # built before the audit (it may have saved this buffer) can still run backward
                    buffer.data.copy_(value)
        for p, requires_grad, grad, version in self.flags:
            if p.requires_grad != requires_grad:
                p.requires_grad_(requires_grad)
            if p.grad is not grad:
                p.grad = grad
            if version_counter(p) != version:
                notes.append("the forward modified a parameter in place; gradaudit cannot undo that")
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if self._hook_counts() != self.hook_counts:  # our hooks are removed by handle; check anyway
            notes.append("module hook counts changed during the audit")
        return notes


def meta_inputs(model: nn.Module, inputs: Any) -> Any:
    """``inputs`` as an audit of ``model`` runs them: beside a meta model, tensors on a real device
    (token ids, masks, positions) become meta tensors whose values are kept (``values.to_meta``),
    since their values decide what the model's code does; otherwise unchanged."""
    tensors = list(iter_tensors(inputs))
    if any(t.device.type != "meta" for t in tensors) and runs_on_meta(first_meta_parameter(model.parameters()), tensors):
        return to_meta(inputs)
    return inputs


def device_type_of(model: nn.Module, default: str = "cpu") -> str:
    """The device type ``model`` runs on (its first meta parameter's, else its first parameter's), or
    ``default`` for a model without parameters."""
    first = first_meta_parameter(model.parameters())
    return first.device.type if first is not None else default


def runs_on_meta(first_parameter: Optional[torch.Tensor], input_tensors: Sequence[torch.Tensor]) -> bool:
    """Whether an audit runs on the meta device: an input or ``first_parameter`` (the model's first
    meta parameter, if any) is a meta tensor."""
    tensors = [*input_tensors, *([first_parameter] if first_parameter is not None else [])]
    return any(t.device.type == "meta" for t in tensors)


def trimmed_now(model: nn.Module) -> bool:
    """Whether gradaudit.trim is installed on ``model`` (only possible once its module is imported)."""
    trimming = sys.modules.get("gradaudit.trimming")
    return trimming is not None and trimming.is_trimmed(model)


def module_of_data_parallel(who: str) -> GradauditError:
    """The error for ``who`` given the module a DistributedDataParallel wraps, in a fake process group:
    its parameters carry DDP's hooks, whose gradient reduction needs an all-reduce's result, and the
    fake backend's collectives complete with none (PyTorch then fails an internal assert)."""
    return GradauditError(
        f"{who} ran a backward through the module a DistributedDataParallel wraps (its parameters carry DDP's "
        f"hooks, which cannot reduce in a fake process group): give {who} the DistributedDataParallel itself")


def one_stage(schedule: Any, inputs: Any) -> tuple[nn.Module, Any, str]:
    """What an audit of a pipeline schedule runs: this rank's stage module on one micro-batch (on the
    first stage, the first micro-batch of ``inputs`` as the schedule splits them, along dim 0; on the
    others, zeros shaped as the stage's ``input_args``), and the note that says so."""
    stages = stages_of(schedule)
    if len(stages) > 1:
        indices = ", ".join(str(stage.stage_index) for stage in stages)
        raise GradauditError(f"this rank runs stages {indices}: audit one stage's module on one micro-batch "
                             f"(audit(stage.submod, micro_batch)), or fit the schedule")
    stage, count = stages[0], micro_batch_count(schedule)
    if stage.stage_index == 0:
        args, kwargs = split_inputs(inputs)
        first = lambda value: value.tensor_split(count)[0] if isinstance(value, torch.Tensor) else value  # noqa: E731
        kwargs = {k: first(v) for k, v in kwargs.items() if k not in ("target", "losses", "return_outputs")}
        batch = Args(*(first(a) for a in args), **kwargs) if args and kwargs else (
            tuple(first(a) for a in args) if args else kwargs)
    else:
        examples = example_inputs(stage)
        if examples is None:
            raise GradauditError(f"stage {stage.stage_index} was built without input_args: give its PipelineStage "
                                 f"input_args (a micro-batch's input), or audit(stage.submod, micro_batch)")
        batch = tuple(examples)
    note = (f"the audit of stage {stage.stage_index} of {stage.num_stages} ({type(schedule).__name__}) on one "
            f"micro-batch of {count}: the stage holds this for each micro-batch in flight; gradaudit.fit runs "
            f"the whole schedule")
    return stage.submod, batch, note


def prepare_data_parallel(model: nn.Module) -> None:
    """Before a backward (fit, plan): in a fake process group, every DistributedDataParallel in ``model``
    gets gradaudit's communication hook that reduces nothing (``torchapi.ddp``), so that its backward
    runs there; a DDP with a hook of its own is refused. Nothing in a real process group."""
    if in_fake_world():
        reduce_locally(model)


def resolve_target(target: Optional[str], on_meta: bool, tensors: Sequence[torch.Tensor]) -> str:
    """The device type the audit stands for: ``target`` (checked), else the device the audit runs on
    (CPU for the meta device)."""
    running = "meta" if on_meta else (tensors[0].device.type if tensors else "cpu")
    if target is None:
        return "cpu" if on_meta else running
    if target not in TARGETS:
        raise GradauditError(f"target must be one of {', '.join(TARGETS)}, not {target!r}")
    if not on_meta and target != running:
        raise GradauditError(f"target={target!r} needs the meta device: it emulates {target} kernels on meta tensors, "
                             f"and this audit runs on {running} (build the model and inputs on meta, or drop target)")
    return target



@contextlib.contextmanager
def as_audited(model: nn.Module, inputs: Any, trainable: Any, frozen: Any, target: str) -> Iterator[None]:
    """The requires_grad what-if applied and, on meta, the kernel choices and autocast of the
    target device, as the audit has them; the model is left as found afterwards (gradients,
    buffers, RNG state included)."""
    tensors = list(iter_tensors(inputs))
    on_meta = runs_on_meta(first_meta_parameter(model.parameters()), tensors)
    state = ModelState(model)
    try:
        with gradients_set_aside(model, tensors):
            apply_trainable(model, trainable, frozen)
            with standing_for(target) if on_meta else contextlib.nullcontext():
                yield
    except RuntimeError as error:
        # a module DistributedDataParallel wraps (its parameters carry DDP's hooks), given on its own
        if in_fake_world() and "hook result is either a Tensor or a TensorList" in str(error):
            raise module_of_data_parallel("gradaudit") from error
        raise
    finally:
        state.restore()


@contextlib.contextmanager
def gradients_set_aside(model: nn.Module, tensors: Sequence[Any]) -> Iterator[None]:
    """Gradients the caller has set aside, not accumulated into (backward adds to an existing .grad in
    place, which putting the same tensor object back would not undo): the parameters' set to None (the
    caller's ModelState puts them back), those of the leaf tensors among ``tensors`` put back here."""
    leaves = [(t, t.grad) for t in tensors if t.is_leaf and t.requires_grad and t.grad is not None]
    for p in model.parameters():
        p.grad = None
    for t, _ in leaves:
        t.grad = None
    try:
        yield
    finally:
        for t, grad in leaves:
            t.grad = grad
