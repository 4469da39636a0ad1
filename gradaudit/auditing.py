"""``gradaudit.audit(model, inputs)``: one traced forward, a Report, and the model left as it was."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from .analysis import build_report
from .collecting import collecting_only_new
from .conditions import (ModelState, apply_trainable, gradients_set_aside, one_stage, resolve_target,
                         runs_on_meta, trimmed_now)
from .errors import ForwardError, GradauditError, NothingRequiresGradError
from .meta import standing_for
from .sdpa import WithoutAttentionDropout
from .recorder import Recorder
from .records import Leaf, Manager, Report, StorageKind
from .rules.registry import check_codes
from .tracking import TrackedStep, held_after_forward
from .tensors import ModelTree, default_loss, first_meta_parameter, iter_tensors, split_inputs, unique
from .values import to_meta
from .compiled import (EAGER_ASKED, compare_with_eager, compile_failed_on_meta_note, compiled_paths,
                       compiled_regions, on_meta_note, ran_eagerly_note)
from .torchapi.compiler import COMPILED_NODE, compiled_original, dynamo_error, force_eager, keeping_graphs
from .torchapi.distributed import distributed_rank, wait_unwaited
from .torchapi.fsdp import fsdp_reshard, fsdp_unsharded_parameters
from .torchapi.pipelining import is_schedule


@collecting_only_new()  # (its collections look at what it makes, not at the model and the libraries)
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
    compare_eager: bool = False,
) -> Report:
    """Run one forward of ``model`` on ``inputs`` and report what autograd saved for backward.

    model: a module, or a pipeline schedule: its stage's module on one micro-batch (``conditions.one_stage``).
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
    compare_eager: a ``torch.compile``'d model audited again with ``eager=True``: what eager autograd would
        hold, per module too (``Report.eager``); a model that ran no compiled region raises GradauditError.

    The model is left exactly as found: parameters, buffers, requires_grad flags, ``.grad``,
    train/eval flags, the RNG state and module hooks - also when the forward raises.
    """
    options = dict(verify=verify, trainable=trainable, frozen=frozen, select=select, ignore=ignore, eager=eager,
                   progress=progress, watch=watch, target=target)
    if compare_eager:
        return _compared_with_eager(model, inputs, **options)
    try:
        return _audited(model, inputs, **options)
    except ForwardError as error:
        if eager or not _compile_failed_on_meta(model, error):
            raise
        # TorchDynamo could not compile the model on meta under the emulation: its eager figures, said so
        report = _audited(model, inputs, **{**options, "eager": True})
        # (its note that it ran eagerly as asked gives way to the note saying why it did)
        asked = ran_eagerly_note(model, EAGER_ASKED)
        report.notes[:] = [n for n in report.notes if n != asked]
        report.notes.append(compile_failed_on_meta_note(model, error.__cause__))
        return report


def audit_then_step(model: nn.Module, inputs: Any, *, trainable: Optional[Sequence[str]] = None,
                    frozen: Optional[Sequence[str]] = None, target: Optional[str] = None,
                    loss: Optional[Callable[[Any], torch.Tensor]] = None) -> tuple[Report, Optional[tuple[int, int]]]:
    """``audit(model, inputs, ...)`` whose forward is also a training step's, tracked as
    ``tracking.forward_backward`` tracks one (the planner's segments baseline: its audit and its step in
    one run): once the report is built, the loss (``loss``, else the default loss) is taken from the
    output and backpropagated (on meta under the emulation again). Returns the report and the step's
    (held, peak), equal to ``forward_backward``'s on the model as the audit ran it; None where the audit
    ran a second forward (attention dropout's math kernel), after which they would not be. It watches no
    module: a watched call's tensors are kept alive until the report, which a step would not keep.
    Gradients the caller has are set aside, as ``as_audited`` does; the model is left as found. For a
    forward on the CPU or meta, off a distributed world, eagerly."""
    then = _ThenStep(loss or default_loss)
    with collecting_only_new():  # (as audit's own)
        report = _audited(model, inputs, verify=False, trainable=trainable, frozen=frozen, select=(), ignore=(),
                          eager=False, progress=None, watch=(), target=target, then=then)
    return report, then.figures


class _ThenStep:
    """What ``audit_then_step`` hands the audit: the tracked step it starts and finishes."""

    def __init__(self, loss: Callable[[Any], torch.Tensor]) -> None:
        self.loss = loss
        self.figures: Optional[tuple[int, int]] = None

    def start(self, model: nn.Module, args: tuple, kwargs: dict) -> TrackedStep:
        return TrackedStep(model, args, kwargs, self.loss)

    def finish(self, step: TrackedStep, holder: list, inputs: Sequence[torch.Tensor], target: Optional[str],
               emulated: Any) -> None:
        """The step's backward, once nothing of the audit's holds a tensor of its (the recording is gone;
        on meta, the forward's emulation lets go of its casts, as its next call would)."""
        if emulated is not None:
            emulated.regions_closed()
        with gradients_set_aside(step.model, inputs):
            step.backward(holder, standing_for(target) if target is not None else None)
        self.figures = step.figures()


def _compile_failed_on_meta(model: Any, error: ForwardError) -> bool:
    """Whether ``error`` is TorchDynamo's, raised compiling a compiled model on the meta device."""
    module = model if isinstance(model, nn.Module) else None
    return (dynamo_error(error.__cause__) and module is not None and bool(compiled_paths(module))
            and first_meta_parameter(module.parameters()) is not None)


def _audited(model: nn.Module, inputs: Any, verify: bool, trainable: Optional[Sequence[str]],
             frozen: Optional[Sequence[str]], select: Optional[Sequence[str]], ignore: Optional[Sequence[str]],
             eager: bool, progress: Optional[Callable[[str], None]], watch: Sequence[str], target: Optional[str],
             then: Optional["_ThenStep"] = None) -> Report:
    """``audit`` without ``compare_eager`` and without its fallback for a compile that fails on meta;
    ``then``: the forward is a tracked step's, whose backward runs once the report is built (``audit_then_step``)."""
    model, inputs, stage_note = one_stage(model, inputs) if is_schedule(model) else (model, inputs, None)
    model, trainable, frozen = _checked_model(model, trainable, frozen, eager)
    select, ignore = check_codes(select, "select entry"), check_codes(ignore, "ignore entry")
    say = progress or (lambda step: None)
    # one walk of the module tree serves every stage before the forward, another every stage after it
    tree = ModelTree(model)
    first_parameter = first_meta_parameter(p for _, p in tree.parameters)
    inputs, args, kwargs, input_tensors, on_meta = _as_run(inputs, first_parameter)
    _check_verify(verify, on_meta)
    target = resolve_target(target, on_meta, ([first_parameter] if first_parameter is not None else []) + input_tensors)
    state = ModelState(model, tree)
    try:
        apply_trainable(model, trainable, frozen, tree)
        say("running the forward")
        recorder = Recorder(model, watch=_watched(model, watch, tree), modules=tree.modules)
        stepping = then.start(model, args, kwargs) if then is not None else None
        output, emulated = _recorded_forward(model, args, kwargs, recorder, target if on_meta else None, eager,
                                             stepping.forward if stepping is not None else contextlib.nullcontext)
        holder = stepping.forward_done(output) if stepping is not None else None
        outputs = _graph_outputs(output)
        after = ModelTree(model)  # as the forward left it (a lazy module has parameters now)
        say("walking the autograd graph")
        recording = recorder.collect(outputs, _leaf_names(model, after, input_tensors))
        if stepping is not None and _attention_dropout_chose_math(recording):
            # a second forward runs before the report (``_measured_beside``): what the model's own
            # machinery keeps of the last forward (a segments runner's hand-over) would not be the step's
            stepping = holder = None
        measured = _measured_beside(recording, model, inputs, target, on_meta, say)
        after = ModelTree(model) if measured else after  # a second forward may have made parameters
        say("analysing saved tensors")
        report = build_report(model, recording, inputs=input_tensors, verify=verify, select=select, ignore=ignore,
                              prove=_prover() if verify else None, measured=measured, target=target, tree=after)
        del recording, output, outputs, recorder
        if stepping is not None:
            then.finish(stepping, holder, input_tensors, target if on_meta else None, emulated)
        del holder
    finally:
        fsdp_reshard(model)  # (FSDP2) the root keeps its gathered parameters after a forward
        notes = state.restore()
    report.notes.extend(notes + ([stage_note] if stage_note else []))
    report.notes.extend(_notes_after(model, report, emulated))
    return report


def _as_run(inputs: Any, first_parameter: Optional[torch.Tensor]) -> tuple[Any, tuple, dict, list, bool]:
    """The inputs as the audit runs them (beside a meta model, real tensors become meta tensors whose
    values are kept), split into arguments, their tensors, and whether the audit runs on meta."""
    args, kwargs = split_inputs(inputs)
    tensors = unique(list(iter_tensors((args, kwargs))))
    on_meta = runs_on_meta(first_parameter, tensors)
    if on_meta and any(t.device.type != "meta" for t in tensors):
        inputs = to_meta(inputs)
        args, kwargs = split_inputs(inputs)
        tensors = unique(list(iter_tensors((args, kwargs))))
    return inputs, args, kwargs, tensors, on_meta


def _graph_outputs(output: Any) -> list[torch.Tensor]:
    """The output's tensors with a graph behind them; none raises NothingRequiresGradError."""
    outputs = unique([t for t in iter_tensors(output) if t.requires_grad and t.grad_fn is not None])
    if not outputs:
        raise NothingRequiresGradError(
            "nothing requires grad: no output of the forward has a grad_fn. Unfreeze parameters "
            "(trainable=[...] / --trainable GLOB) or pass inputs with requires_grad=True")
    return outputs


def _held_without_attention_dropout(model: nn.Module, inputs: Any, target: str, on_meta: bool) -> int:
    """What the model holds with every attention call's dropout_p set to 0: attention dropout made SDPA
    run its math kernel, and the finding's bytes are this measurement, not a guess."""
    with standing_for(target, also=WithoutAttentionDropout()) if on_meta else WithoutAttentionDropout():
        return held_after_forward(model, inputs)


def _checked_model(model: Any, trainable: Any, frozen: Any,
                   eager: bool) -> tuple[nn.Module, Optional[Sequence[str]], Optional[Sequence[str]]]:
    """The model to audit (a compiled one's original with ``eager``) and the patterns as lists,
    once the model is known to be an eager module."""
    if not isinstance(model, nn.Module):
        raise GradauditError(f"audit() needs a torch.nn.Module, got {type(model).__name__}")
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
    return model, trainable, frozen


def _prover() -> Callable[..., Any]:
    from .verify import prove  # noqa: WPS433 (imported only when asked for)
    return prove


def _measured_beside(recording: Any, model: nn.Module, inputs: Any, target: str, on_meta: bool,
                     say: Callable[[str], None]) -> dict[str, int]:
    """Figures a second forward measures beside the recorded one: where attention dropout made the
    math kernel run, what the model holds without it."""
    if not _attention_dropout_chose_math(recording):
        return {}
    say("measuring the forward without attention dropout")
    return {"held_without_attention_dropout": _held_without_attention_dropout(model, inputs, target, on_meta)}


def _compared_with_eager(model: nn.Module, inputs: Any, **options: Any) -> Report:
    """``audit(compare_eager=True)``: the audit as asked, and beside it one with eager=True."""
    if options["eager"]:
        raise GradauditError("compare_eager=True compares the compiled run with an eager one: drop eager=True")
    say = options["progress"] or (lambda step: None)
    report = audit(model, inputs, **options)
    if not compiled_regions(report):
        raise GradauditError("compare_eager=True: the model ran no torch.compile'd region, so there is no "
                             "compiled run to compare with eager; drop compare_eager")
    say("auditing the model again, eagerly")
    eager = audit(model, inputs, **{**options, "eager": True})
    report.eager = compare_with_eager(report, eager)
    return report


def _check_verify(verify: bool, on_meta: bool) -> None:
    if verify and (distributed_rank() or (1, 0))[0] > 1:
        raise GradauditError("verify=True runs backward nodes one by one on poisoned values, which a distributed "
                             "model's collectives cannot (a fake world's carry no values): drop verify, or verify "
                             "the model unparallelised")
    if verify and on_meta:
        raise GradauditError("verify=True needs real values; it cannot run on the meta device "
                             "(audit on CPU or GPU, or drop verify)")


def _recorded_forward(model: nn.Module, args: Any, kwargs: Any, recorder: Recorder, target: Optional[str],
                      eager: bool, around: Callable[[], Any] = contextlib.nullcontext) -> tuple[Any, Any]:
    """The model's output of one forward under ``recorder``, and the emulation's record (None off
    meta). ``target``: on meta, the device type whose kernels the forward takes (None: not on meta).
    ``around()``: in force around the model's call, inside the emulation (a tracked step's forward)."""
    # on meta, attention (and for target cuda batch norm and dropout) must take the kernel the
    # target device would take, or it saves different tensors; and autocast, which meta tensors do not reach,
    # is emulated (entered last: its casts come first)
    emulation = standing_for(target) if target is not None else contextlib.nullcontext()
    stance = force_eager("audit(eager=True)") if eager else contextlib.nullcontext()
    with recorder, emulation as emulated, stance, keeping_graphs(), warnings.catch_warnings():
        # gradaudit's own saved-tensor hooks are what torch warns about around a selective
        # checkpoint (its cache bypasses them: the recorder reads the cache itself)
        warnings.filterwarnings("ignore", message="A saved_tensors_hooks context", category=FutureWarning)
        try:
            with around():
                output = model(*args, **kwargs)
        except GradauditError:
            raise
        except Exception as error:
            raise ForwardError(_forward_failure(error, target is not None)) from error
    wait_unwaited(iter_tensors(output))
    return output, emulated


def _leaf_names(model: nn.Module, tree: ModelTree, input_tensors: Sequence[torch.Tensor]) -> dict[int, Leaf]:
    """The leaves gradients reach, by id: parameters by name (FSDP2's gathered ones too), inputs by position."""
    names = {id(p): Leaf("param", n) for n, p in tree.parameters}
    for n, p in fsdp_unsharded_parameters(model):
        names.setdefault(id(p), Leaf("param", n))
    for i, t in enumerate(input_tensors):
        names.setdefault(id(t), Leaf("input", str(i)))
    return names


def _attention_dropout_chose_math(recording: Any) -> bool:
    """Whether attention dropout made SDPA run its math kernel where, without dropout, another kernel
    would have run, with autograd holding what the math kernel saved."""
    return any(live.attention is not None and live.attention.math_fallback and live.attention.dropout_p
               and live.attention.kernel_without_dropout != "math"
               and any(recording.saves[i].managed_by == Manager.AUTOGRAD for i in live.saves)
               for live in recording.nodes)


def _notes_after(model: nn.Module, report: Report, emulated: Any) -> list[str]:
    """The notes an audit adds once the model is restored: the rank, the emulation, compiled regions, trim."""
    notes = []
    if distributed_rank() is not None:
        report.world_size, report.rank = distributed_rank()
        notes.extend(_rank_notes(report))
    if emulated is not None:
        notes.extend(emulated.notes)
    notes.extend(_compiled_notes(model, report, emulated))
    if trimmed_now(model):
        # trim stands aside while gradaudit audits (its hooks would hide the saves from the audit)
        notes.append(
            f"gradaudit.trim is installed on this model; the audit sees the forward without it, so its figures "
            f"are untrimmed. With trim, autograd holds saved_bytes - reclaimable_with_bitpacking_bytes = "
            f"{report.saved_bytes - report.reclaimable_with_bitpacking_bytes} bytes (trim drops and bit-packs what "
            f"that figure counts)")
    return notes


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


def _compiled_notes(model: nn.Module, report: Report, emulated: Any) -> list[str]:
    """What a torch.compile'd model's report can and cannot say (``emulated``: the meta emulation, or None)."""
    regions = compiled_regions(report)
    if not regions:
        eager = ran_eagerly_note(model, EAGER_ASKED)
        return [eager] if eager else []
    compiled = compiled_paths(model)
    where = f" ({', '.join(compiled[:5])})" if compiled else ""
    notes = []
    if emulated is not None:
        compiled_here = emulated.compiled_here
        notes.append(on_meta_note(report.target, compiled_here.inductor_regions if compiled_here else 0))
    plural = "s" if regions > 1 else ""
    return notes + [
        f"{regions} torch.compile'd region{plural}{where} ran as one compiled graph each "
        f"({COMPILED_NODE}): what such a region keeps for backward is the compiler's choice, "
        f"counted in the byte figures and attributed to the module and line its graphs name (each "
        f"save's reason names the ops that make and read it); verdicts and findings (GA003) come "
        f"from what its backward graph's ops read of each save, and from the proof (verify=True, "
        f"scan --verify) for what the graph does not settle. To see what eager autograd would keep "
        f"and which fixes apply, audit with eager=True (gradaudit scan --eager); both side by side, per "
        f"module: compare_eager=True (scan --compare-eager)"]
