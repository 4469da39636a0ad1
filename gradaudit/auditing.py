"""``gradaudit.audit(model, inputs)``: one traced forward, a Report, and the model left as it was."""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import sys
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from .analysis import build_report
from .errors import ForwardError, GradauditError, NoMatchingParameterError, NothingRequiresGradError
from .measure import held_bytes_after_forward
from .meta import TARGETS, WithoutAttentionDropout, standing_for
from .recorder import Recorder
from .records import Leaf, Manager, Report, StorageKind
from .rules.registry import check_codes
from .tensors import ModelTree, first_meta_parameter, iter_tensors, split_inputs, unique
from .values import to_meta
from .torchapi.compiler import COMPILED_NODE, compiled_original, force_eager
from .torchapi.distributed import distributed_rank, wait_unwaited
from .torchapi.fsdp import fsdp_reshard, fsdp_unsharded_parameters
from .torchapi.modules import hook_counts_of, module_slots
from .torchapi.storages import version_counter


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


def audit(
    model: nn.Module,
    inputs: Any,
    *,
    verify: bool = False,
    trainable: Optional[Sequence[str]] = None,
    frozen: Optional[Sequence[str]] = None,
    select: Sequence[str] = (),
    ignore: Sequence[str] = (),
    eager: bool = False,
    progress: Optional[Callable[[str], None]] = None,
    watch: Sequence[str] = (),
    target: Optional[str] = None,
) -> Report:
    """Run one forward of ``model`` on ``inputs`` and report what autograd saved for backward.

    inputs: a Tensor (one positional argument), a tuple (positional arguments) or a dict
        (keyword arguments). The forward runs in the model's current train/eval mode.
    verify: prove each verdict empirically by calling the backward nodes with poisoned values
        (CPU/GPU only; not on the meta device).
    trainable: glob patterns over ``named_parameters()`` names; when given, exactly the matching
        parameters require grad during the audit (a what-if). ``frozen``: patterns to freeze on top.
    select / ignore: rule code prefixes (longest prefix wins). They define what the report counts:
        its findings and every byte figure (``reclaimable_bytes`` and the rest) cover the selected
        rules only. An entry that is a prefix of no rule code raises UnknownCodeError.
    watch: module paths (``named_modules()`` names) whose every call the report lists with the
        storages of the tensors passed in (``Report.module_calls``): what checkpointing those
        modules would hold instead of their saves (the checkpoint planner uses it).
    eager: run ``torch.compile``'d parts of the model eagerly, so that what eager autograd saves
        (and the findings about it) is seen op by op. Without it, a compiled region is one
        ``CompiledFunctionBackward`` node whose saves the compiler chose; the report says so.
    target: the device type an audit on the meta device stands for, "cpu" (the default) or
        "cuda": the forward takes the kernels that device would take where they save different
        tensors (for "cuda": cuDNN batch norm where ATen picks it, the attention backend CUDA would
        pick on an H100, fused dropout) and ``torch.autocast`` is emulated as that device's. An audit on a real device
        audits that device: a target other than its device type raises GradauditError.
        ``Report.target`` records it.

    The model is left exactly as found: parameters, buffers, requires_grad flags, ``.grad``,
    train/eval flags, the RNG state and module hooks - also when the forward raises.
    """
    if not isinstance(model, nn.Module):
        raise GradauditError(f"audit() needs a torch.nn.Module, got {type(model).__name__}")
    select, ignore = check_codes(select, "select entry"), check_codes(ignore, "ignore entry")
    if isinstance(trainable, str):  # one pattern, not a list of its characters
        trainable = [trainable]
    if isinstance(frozen, str):
        frozen = [frozen]
    scripted = next((path or "the model" for path, m in model.named_modules()
                     if isinstance(m, torch.jit.ScriptModule)), None)
    if scripted is not None:
        raise GradauditError(f"{scripted} is a TorchScript module (torch.jit.script or trace): gradaudit audits "
                             f"eager PyTorch modules; audit the module before scripting it")
    if eager and compiled_original(model) is not None:
        model = compiled_original(model)  # its module paths, without "_orig_mod."
    args, kwargs = split_inputs(inputs)
    input_tensors = unique(list(iter_tensors((args, kwargs))))
    # one walk of the module tree serves every stage before the forward, another every stage after it
    tree = ModelTree(model)
    first_parameter = first_meta_parameter(p for _, p in tree.parameters)
    on_meta = runs_on_meta(first_parameter, input_tensors)
    if on_meta and any(t.device.type != "meta" for t in input_tensors):
        inputs = to_meta(inputs)
        args, kwargs = split_inputs(inputs)
        input_tensors = unique(list(iter_tensors((args, kwargs))))
    if verify and (distributed_rank() or (1, 0))[0] > 1:
        raise GradauditError("verify=True runs backward nodes one by one on poisoned values, which a distributed "
                             "model's collectives cannot (a fake world's carry no values): drop verify, or verify "
                             "the model unparallelised")
    if verify and on_meta:
        raise GradauditError("verify=True needs real values; it cannot run on the meta device "
                             "(audit on CPU or GPU, or drop verify)")
    target = resolve_target(target, on_meta, ([first_parameter] if first_parameter is not None else []) + input_tensors)
    state = ModelState(model, tree)
    try:
        apply_trainable(model, trainable, frozen, tree)
        if progress:
            progress("running the forward")
        recorder = Recorder(model, watch=_watched(model, watch, tree), modules=tree.modules)
        # on meta, attention (and for target cuda batch norm and dropout) must take the kernel the
        # target device would take, or it saves different tensors; and autocast, which meta tensors do not reach,
        # is emulated (entered last: its casts come first)
        emulation = standing_for(target) if on_meta else contextlib.nullcontext()
        stance = force_eager("audit(eager=True)") if eager else contextlib.nullcontext()
        with recorder, emulation as emulated, stance, warnings.catch_warnings():
            # gradaudit's own saved-tensor hooks are what torch warns about around a selective
            # checkpoint (its cache bypasses them: the recorder reads the cache itself)
            warnings.filterwarnings("ignore", message="A saved_tensors_hooks context", category=FutureWarning)
            try:
                output = model(*args, **kwargs)
            except GradauditError:
                raise
            except Exception as error:
                raise ForwardError(_forward_failure(error, on_meta)) from error
        wait_unwaited(iter_tensors(output))
        outputs = unique([t for t in iter_tensors(output) if t.requires_grad and t.grad_fn is not None])
        if not outputs:
            raise NothingRequiresGradError(
                "nothing requires grad: no output of the forward has a grad_fn. Unfreeze parameters "
                "(trainable=[...] / --trainable GLOB) or pass inputs with requires_grad=True")
        after = ModelTree(model)  # as the forward left it (a lazy module has parameters now)
        leaf_names = {id(p): Leaf("param", n) for n, p in after.parameters}
        for n, p in fsdp_unsharded_parameters(model):  # (FSDP2) the leaves gradients reach
            leaf_names.setdefault(id(p), Leaf("param", n))
        for i, t in enumerate(input_tensors):
            leaf_names.setdefault(id(t), Leaf("input", str(i)))
        if progress:
            progress("walking the autograd graph")
        recording = recorder.collect(outputs, leaf_names)
        prove = None
        if verify:
            from .verify import prove  # noqa: WPS433 (imported only when asked for)
        measured = {}
        if any(live.attention is not None and live.attention.math_fallback and live.attention.dropout_p
               and live.attention.kernel_without_dropout != "math"
               and any(recording.saves[i].managed_by == Manager.AUTOGRAD for i in live.saves)
               for live in recording.nodes):
            # attention dropout made SDPA run its math kernel: measure what the model holds
            # without it, so the finding's bytes are a measurement, not a guess
            if progress:
                progress("measuring the forward without attention dropout")
            with standing_for(target, also=WithoutAttentionDropout()) if on_meta else WithoutAttentionDropout():
                measured["held_without_attention_dropout"] = held_bytes_after_forward(model, inputs,
                                                                                    young_only=True)
                after = ModelTree(model)
        if progress:
            progress("analysing saved tensors")
        report = build_report(model, recording, inputs=input_tensors, verify=verify, select=select,
                              ignore=ignore, prove=prove, measured=measured, target=target, tree=after)
        del recording, output, outputs
    finally:
        fsdp_reshard(model)  # (FSDP2) the root keeps its gathered parameters after a forward
        notes = state.restore()
    report.notes.extend(notes)
    if distributed_rank() is not None:
        report.world_size, report.rank = distributed_rank()
        report.notes.extend(_rank_notes(report))
    if emulated is not None:
        report.notes.extend(emulated.notes)
    report.notes.extend(_compiled_notes(model, report))
    if trimmed_now(model):
        # trim stands aside while gradaudit audits (its hooks would hide the saves from the audit)
        report.notes.append(
            f"gradaudit.trim is installed on this model; the audit sees the forward without it, so its figures "
            f"are untrimmed. With trim, autograd holds saved_bytes - reclaimable_with_bitpacking_bytes = "
            f"{report.saved_bytes - report.reclaimable_with_bitpacking_bytes} bytes (trim drops and bit-packs what "
            f"that figure counts)")
    return report


def _rank_notes(report: Report) -> list[str]:
    """What a rank's figures count and leave out."""
    from .report.units import human_bytes

    notes = [f"audited as rank {report.rank} of {report.world_size}: saves of DTensors count the local shard this "
             f"rank holds; communication buffers, NCCL's own memory and the overlap of communication with "
             f"computation are not modelled"]
    resharded = sum(1 for s in report.storages if s.kind == StorageKind.RESHARDED)
    if resharded:
        notes.append(f"FSDP2 resharded {resharded} gathered parameter storage{'s' if resharded > 1 else ''} the "
                     f"forward saved: nothing is held for them between forward and backward, and backward gathers "
                     f"them again ({human_bytes(report.regathered_bytes)}, {report.regathered_bytes} bytes, alive "
                     f"while their layer's backward runs)")
    return notes


def meta_inputs(model: nn.Module, inputs: Any) -> Any:
    """``inputs`` as an audit of ``model`` runs them: beside a meta model, tensors on a real device
    (token ids, masks, positions) become meta tensors whose values are kept (``values.to_meta``),
    since their values decide what the model's code does; otherwise unchanged."""
    tensors = list(iter_tensors(inputs))
    if any(t.device.type != "meta" for t in tensors) and runs_on_meta(first_meta_parameter(model.parameters()), tensors):
        return to_meta(inputs)
    return inputs


def runs_on_meta(first_parameter: Optional[torch.Tensor], input_tensors: Sequence[torch.Tensor]) -> bool:
    """Whether an audit runs on the meta device: an input or ``first_parameter`` (the model's first
    meta parameter, if any) is a meta tensor."""
    tensors = [*input_tensors, *([first_parameter] if first_parameter is not None else [])]
    return any(t.device.type == "meta" for t in tensors)


def trimmed_now(model: nn.Module) -> bool:
    """Whether gradaudit.trim is installed on ``model`` (only possible once its module is imported)."""
    trimming = sys.modules.get("gradaudit.trimming")
    return trimming is not None and trimming.is_trimmed(model)


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


def _watched(model: nn.Module, watch: Sequence[str], tree: Optional[ModelTree] = None) -> tuple[str, ...]:
    if isinstance(watch, str):
        watch = [watch]
    if not watch:
        return ()
    paths = {path for path, _ in (tree.modules if tree is not None else model.named_modules())}
    missing = [path for path in watch if path not in paths]
    if missing:
        raise GradauditError(f"watch: the model has no module {missing[0]!r} (names as in named_modules())")
    return tuple(watch)


def _forward_failure(error: Exception, on_meta: bool) -> str:
    """Two lines: what failed (the error's own first line, whole), and what to do."""
    text = str(error).strip()
    message = f"the model's forward raised {type(error).__name__}: {text.splitlines()[0] if text else ''}"
    if on_meta and "meta" in text.lower():
        # meta tensors have shapes and dtypes but no values
        message += ("\non the meta device tensors have no values: give the batch's token ids, masks and positions "
                    "as CPU tensors beside the meta model (gradaudit keeps their values), or audit on CPU with "
                    "small inputs (the same layers at a shorter sequence or batch)")
    return message


def _compiled_notes(model: nn.Module, report: Report) -> list[str]:
    """What a torch.compile'd model's report can and cannot say."""
    regions = sum(1 for n in report.nodes if n.name == COMPILED_NODE)
    if not regions:
        return []
    compiled = [path or "the model" for path, m in model.named_modules() if compiled_original(m) is not None]
    where = f" ({', '.join(compiled[:5])})" if compiled else ""
    return [f"{regions} torch.compile'd region{'s' if regions > 1 else ''}{where} ran as one compiled graph each "
            f"({COMPILED_NODE}): what such a region keeps for backward is the compiler's choice, "
            f"counted in the byte figures but without per-op verdicts or findings. To see what eager "
            f"autograd would keep and which fixes apply, audit with eager=True (gradaudit scan --eager)"]
