"""What a ``torch.compile``'d region keeps for backward, attributed as eager saves are: from the
region's graphs (``torchapi.compiler.saved_origins``), the module and source line of the op whose
gradient reads each save, the ops that make and read it, and whether it is a copy of one of the
model's parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from .knowledge import Bit, Outcome
from .records import NEEDED, NOT_NEEDED, SIGN_ONLY
from .sites import traced_source_line
from .torchapi.compiler import (COMPILED_NODE, SavedOrigin, SavedUse, compiled_in_place, compiled_original,
                                original_path, saved_origins)

if TYPE_CHECKING:
    from .records import EagerComparison, Report

# (module path, module class, source line, origin, parameter it copies) of one save
Attribution = tuple[str, str, Optional[str], SavedOrigin, Optional[str]]


def attribute(node: Any, attrs: list[str], tensors: list[Optional[torch.Tensor]],
              region: tuple[str, str, Optional[str]], parameters: Callable[[], "ParameterLayouts"],
              ) -> Optional[list[Attribution]]:
    """Per save of a compiled region's ``node`` (its ``attrs`` and ``tensors`` in order; ``region``: the
    module path, class and source line the node itself was attributed to), where it comes from.
    None when the graphs say nothing certain: a slot missing, or no graph that matches the saves."""
    if attrs != [f"saved_tensors[{i}]" for i in range(len(attrs))]:
        return None  # a slot missing: the saves cannot be matched with the graph's inputs one by one
    origins = saved_origins(node, tensors)
    if origins is None:
        return None
    path, cls, line = region
    found = []
    for tensor, origin in zip(tensors, origins):
        # the module paths of the original model, as an eager audit names them (an OptimizedModule's
        # _orig_mod left out): the region's own where the graph names none (the model's own code)
        module, module_class = original_path(path), cls
        if origin.module is not None:
            # the module paths of the original model, as an eager audit names them (an
            # OptimizedModule's _orig_mod left out)
            module = original_path(f"{path}.{origin.module}")
            module_class = origin.module_class or module_class
        source = (traced_source_line(origin.trace) if origin.trace else None) or line
        copy_of = parameters().copied(tensor) if origin.made_by is None and tensor is not None else None
        found.append((module, module_class, source, origin, copy_of))
    return found


class ParameterLayouts:
    """The model's parameters by shape and dtype, to recognise a compiled region's copy of one: a
    tensor in a storage of its own whose values equal exactly one parameter's."""

    def __init__(self, model: nn.Module) -> None:
        # (name, tensor, whether a parameter) by shape and dtype: buffers too, so that a copy whose values
        # equal a buffer's as well (a fresh batch norm's running mean, zeros like its bias) is no one's
        self.by_layout: dict[tuple, list[tuple[str, torch.Tensor, bool]]] = {}
        self.storages: set[int] = set()
        members = [(n, p, True) for n, p in model.named_parameters()] + [(n, b, False) for n, b in model.named_buffers()]
        for name, p, parameter in members:
            self.by_layout.setdefault((tuple(p.shape), p.dtype), []).append((original_path(name), p, parameter))
            if p.device.type != "meta" and parameter:
                self.storages.add(p.untyped_storage().data_ptr())

    def copied(self, t: torch.Tensor) -> Optional[str]:
        """The name of the one parameter ``t`` is a copy of, or None (no values to compare on meta, the
        parameter itself, no parameter or several parameters or buffers with its values)."""
        if type(t) is not torch.Tensor or t.device.type == "meta" or t.untyped_storage().data_ptr() in self.storages:
            return None
        same = [(name, parameter) for name, p, parameter in self.by_layout.get((tuple(t.shape), t.dtype), ())
                if p.device == t.device and torch.equal(p.detach(), t)]
        return same[0][0] if len(same) == 1 and same[0][1] else None


def compiled_reason(origin: SavedOrigin, itself: Optional[str], copy_of: Optional[str] = None,
                    judged: Optional[str] = None) -> str:
    """Why a compiled region's save is there, in one sentence: what made it (``itself``: the kind
    of storage it is when it is a parameter, buffer or input the region was given, else None;
    ``copy_of``: the parameter it copies), and what reads it."""
    if origin.made_by:
        made = f"made by {origin.made_by} in its forward graph"
    elif copy_of:
        made = f"a copy the compiled code made of parameter {copy_of}"
    elif itself:
        made = f"the {itself} the region was given, itself"
    else:
        # the graph names an input of the region, but the storage is new: the compiled code's own
        # copy of it (inductor's channels-last copy of a convolution's weight, say)
        made = "a copy the compiled code made of a parameter, buffer or input the region was given"
    if judged is not None:  # a verdict read off the backward graph (``static_verdict``): why
        return f"kept by the compiled region: {made}; {judged}"
    read = f", read by {', '.join(origin.read_by)} in its backward graph" if origin.read_by else ""
    return f"kept by the compiled region: {made}{read}; the compiler chose to keep it, no op knowledge judges it yet"


# What an op of a backward graph reads of each argument it takes (a compiled region's save): "values",
# "shape" (its sizes, strides, dtype: never its values), or one bit per element (a Bit). The backward
# ops a partitioner keeps a save for whose value it never reads (pytorch#133566), as the op knowledge
# declares their eager nodes (knowledge/builtin.py: ConvolutionBackward0, NativeBatchNormBackward0 in
# eval mode, MaxPool2DWithIndicesBackward0, ReluBackward0 / ThresholdBackward0); any other op reads
# the values of every tensor it takes.
_SHAPE_ONLY_OPS = frozenset({"aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like",
                             "aten.new_empty", "aten.new_zeros", "aten.new_ones", "aten.new_full",
                             "aten.new_empty_strided", "aten.sym_size", "aten.sym_stride", "aten.sym_numel",
                             "aten.sym_storage_offset"})


def _mask(arguments: tuple, index: int) -> Optional[tuple]:
    mask = arguments[index] if index < len(arguments) else None
    return mask if isinstance(mask, tuple) and all(isinstance(m, bool) for m in mask) else None


def _read(use: SavedUse) -> Any:
    """"values", "shape" or a Bit: what ``use`` reads of the save."""
    op, i, args = use.op, use.position, use.arguments
    if op in _SHAPE_ONLY_OPS and i == 0:
        return "shape"
    if op == "aten.convolution_backward" and i in (1, 2):
        # (grad_output, input, weight, ..., output_mask): the weight's gradient reads the input, the
        # input's gradient the weight, the bias's neither
        mask = _mask(args, 10)
        return "values" if mask is None or mask[2 - i] else "shape"
    if op == "aten.native_batch_norm_backward" and 1 <= i <= 6:
        # (grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
        # output_mask); in eval mode grad_input = grad * weight * invstd(running_var), grad_weight =
        # sum(grad * (input - running_mean) * invstd): the batch statistics are not read at all
        mask = _mask(args, 9)
        if mask is None or len(args) < 8 or args[7] not in (True, False):
            return "values"
        if args[7] is True:
            # in training the input and weight gradients read the input and the batch statistics, the
            # input's the weight too; the bias's (a sum of grad) none; no gradient reads the running
            # statistics, which a functional region passes as the forward's updated copies (tensors of
            # its own, where eager passes the buffers)
            either = mask[0] or mask[1]
            wanted_by = {1: either, 2: mask[0], 3: False, 4: False, 5: either, 6: either}
        else:
            wanted_by = {1: mask[1], 2: mask[0], 3: mask[1], 4: mask[0] or mask[1], 5: False, 6: False}
        return "values" if wanted_by[i] else "shape"
    if op in ("aten.max_pool2d_with_indices_backward", "aten.max_pool3d_with_indices_backward") and i == 1:
        return "shape"  # the indices say where the maxima were; the input gives the gradient's shape
    if op == "aten.threshold_backward" and i == 1 and len(args) > 2 and args[2] == 0:
        return Bit.NOT_LE_ZERO  # x <= 0 ? 0 : grad
    if op in ("aten.le", "aten.gt") and i == 0 and len(args) > 1 and type(args[1]) in (int, float) and args[1] == 0:
        return Bit.NOT_LE_ZERO if op == "aten.le" else Bit.GT_ZERO
    return "values"


def static_verdict(origin: SavedOrigin, floating: bool) -> Optional[Outcome]:
    """The verdict on a compiled region's save from what its backward graph does with it
    (``origin.uses``), explained by GA003 where unread or read as a sign; None where the graph's uses
    are not all known (then "unknown")."""
    if not origin.uses:
        return None
    reads = [(use, _read(use)) for use in origin.uses]
    valued = [use.op for use, how in reads if how == "values"]
    if valued:
        return Outcome(NEEDED, f"read by {', '.join(dict.fromkeys(valued))} in its backward graph")
    bits = {how for _, how in reads if isinstance(how, Bit)}
    takers = ", ".join(dict.fromkeys(use.op for use, _ in reads))
    if len(bits) > 1 or (bits and not floating):
        return Outcome(NEEDED, f"read by {takers} in its backward graph")
    if bits:
        return Outcome(SIGN_ONLY, f"its backward graph reads only its sign ({takers})", bitpackable=True,
                       bit=bits.pop(), rule="GA003")
    return Outcome(NOT_NEEDED, f"its backward graph reads only its shape ({takers} takes it, and no gradient it is "
                               f"asked for reads its values)", rule="GA003")


def compiled_regions(report: "Report") -> int:
    """How many ``torch.compile``'d regions the audited forward ran (one ``CompiledFunctionBackward`` node each)."""
    return sum(1 for n in report.nodes if n.name == COMPILED_NODE)


def compiled_paths(model: nn.Module) -> list[str]:
    """The paths of the model's ``torch.compile``'d modules ("the model" for the model itself)."""
    return [path or "the model" for path, m in model.named_modules()
            if compiled_original(m) is not None or compiled_in_place(m)]


# why a compiled model ran eagerly, by who ran it (``ran_eagerly_note``)
EAGER_ASKED = "eager=True, or TorchDynamo fell back to eager"
FIT = ("fit's step tracker follows the aten ops a step dispatches, and a compiled region's generated code does "
       "not dispatch all it does: inductor makes its buffers out of the tracker's sight")


def ran_eagerly_note(model: nn.Module, why: str) -> Optional[str]:
    """The note for a compiled model that made no compiled region here (``why``: EAGER_ASKED or FIT): its
    figures are eager autograd's, not its compiled graph's; None for a model with no compiled module."""
    paths = compiled_paths(model)
    if not paths:
        return None
    where = ("audit it (gradaudit scan, gradaudit.audit): an audit counts every tensor its regions keep for "
             "backward" if why == FIT else "audit it without eager=True")
    return (f"the model is torch.compile'd ({', '.join(paths[:5])}) but ran eagerly here ({why}): these figures are "
            f"what eager autograd keeps, not what its compiled graphs keep, which can be far more or less "
            f"(a ResNet-18 fine-tune at 32x224 under inductor keeps 362,725,376 B on an H200, where eager keeps "
            f"433,586,176 B). For what its compiled graphs keep, {where}")


def compile_failed_on_meta_note(model: nn.Module, error: BaseException) -> str:
    """The note of a compiled model audited eagerly on meta because TorchDynamo failed to compile it there."""
    error = getattr(error, "inner_exception", None) or error  # (a backend's own error, inside dynamo's)
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (f"the model is torch.compile'd ({', '.join(compiled_paths(model)[:5])}) but TorchDynamo could not compile "
            f"it on the meta device under gradaudit's emulation ({type(error).__name__}: {first[:200]}), so it ran "
            f"eagerly here: these figures are what eager autograd keeps, not what its compiled graphs keep. For "
            f"those, audit it on the CPU or the GPU (on torch 2.11, a literal made for the meta device inside a "
            f"region, such as GPT-Neo's attention mask value, fails to trace this way; later releases trace it)")


def on_meta_note(target: Optional[str], inductor_regions: int) -> str:
    """What a compiled model's audit on the meta device stands for (``target``: the device it stands
    for; ``inductor_regions``: graphs compiled for inductor, partitioned but not code-generated)."""
    target = target or "cpu"
    kernels = ("cuDNN batch norm, the attention kernel the GPU would take, fused dropout" if target == "cuda" else
               "the CPU's attention kernel")
    note = (f"on the meta device the compiled regions were traced and partitioned as for {target}: TorchDynamo "
            f"traced the forward under the kernel choices gradaudit emulates for {target} ({kernels}), and "
            f"AOTAutograd decomposed and partitioned that graph as it does on the device")
    if inductor_regions:
        note += (f"; {inductor_regions} graph{'s' if inductor_regions > 1 else ''} compiled for inductor went through "
                 f"inductor's decompositions and partitioner (the backend aot_eager_decomp_partition), not its code "
                 f"generation, so what its generated code adds is not counted: copies of weights in another layout "
                 f"(GA703: a channels-last copy of each 3x3 convolution's weight on the CPU) and buffers it "
                 f"reuses. For those, audit on the CPU or the GPU")
    return note


def compare_with_eager(compiled: "Report", eager: "Report") -> "EagerComparison":
    """Per module, what the compiled regions' saves hold (``compiled``, attributed to the module whose op
    reads each) beside what eager autograd's saves hold (``eager``, an audit of the same model with
    eager=True); modules either holds something in, largest change first."""
    from .records import EagerComparison, ModuleChange

    compiled_by = {m.path: m for m in compiled.modules}
    eager_by = {m.path: m for m in eager.modules}
    rows = []
    for path in {*compiled_by, *eager_by}:
        was, now = eager_by.get(path), compiled_by.get(path)
        eager_bytes, compiled_bytes = (was.own_bytes if was else 0), (now.own_bytes if now else 0)
        if eager_bytes or compiled_bytes:
            rows.append(ModuleChange(path, (now or was).module_class, eager_bytes, compiled_bytes))
    rows.sort(key=lambda m: (-abs(m.compiled_bytes - m.eager_bytes), m.path))
    return EagerComparison(eager.saved_bytes, eager.reclaimable_with_bitpacking_bytes, rows)

