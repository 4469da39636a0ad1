"""What a ``torch.compile``'d region keeps for backward, attributed as eager saves are: from the
region's graphs (``torchapi.compiler.saved_origins``), the module and source line of the op whose
gradient reads each save, the ops that make and read it, and whether it is a copy of one of the
model's parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from .sites import traced_source_line
from .torchapi.compiler import COMPILED_NODE, SavedOrigin, compiled_original, original_path, saved_origins

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
        self.by_layout: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
        self.storages: set[int] = set()
        for name, p in model.named_parameters():
            self.by_layout.setdefault((tuple(p.shape), p.dtype), []).append((original_path(name), p))
            if p.device.type != "meta":
                self.storages.add(p.untyped_storage().data_ptr())

    def copied(self, t: torch.Tensor) -> Optional[str]:
        """The name of the one parameter ``t`` is a copy of, or None (no values to compare on meta, the
        parameter itself, no parameter or several with its values)."""
        if type(t) is not torch.Tensor or t.device.type == "meta" or t.untyped_storage().data_ptr() in self.storages:
            return None
        same = [name for name, p in self.by_layout.get((tuple(t.shape), t.dtype), ())
                if p.device == t.device and torch.equal(p.detach(), t)]
        return same[0] if len(same) == 1 else None


def compiled_reason(origin: SavedOrigin, itself: Optional[str], copy_of: Optional[str] = None) -> str:
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
    read = f", read by {', '.join(origin.read_by)} in its backward graph" if origin.read_by else ""
    return f"kept by the compiled region: {made}{read}; the compiler chose to keep it, no op knowledge judges it yet"


def compiled_regions(report: "Report") -> int:
    """How many ``torch.compile``'d regions the audited forward ran (one ``CompiledFunctionBackward`` node each)."""
    return sum(1 for n in report.nodes if n.name == COMPILED_NODE)


def compiled_paths(model: nn.Module) -> list[str]:
    """The paths of the model's ``torch.compile``'d modules ("the model" for the model itself)."""
    return [path or "the model" for path, m in model.named_modules() if compiled_original(m) is not None]


def ran_eagerly_note(model: nn.Module, on_meta: bool) -> Optional[str]:
    """The note for a compiled model that made no compiled region here (on meta, or eager=True): its
    figures are eager autograd's, not its compiled graph's; None for a model with no compiled module."""
    paths = compiled_paths(model)
    if not paths:
        return None
    why = ("on the meta device TorchDynamo does not compile under gradaudit's emulation" if on_meta
           else "eager=True, or TorchDynamo fell back to eager")
    return (f"the model is torch.compile'd ({', '.join(paths[:5])}) but ran eagerly here ({why}): these figures are "
            f"what eager autograd keeps, not what its compiled graphs keep, which can be far more or less "
            f"(a ResNet-18 fine-tune at 32x224 under inductor keeps 362,725,376 B on an H200, where eager keeps "
            f"433,586,176 B). For the compiled figures run it on the CPU or the GPU: the partitioner is the same, "
            f"and for that ResNet-18 the CPU's graph keeps the GPU's bytes, but where a kernel differs between "
            f"devices (attention, batch norm) a region can keep other tensors")


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

