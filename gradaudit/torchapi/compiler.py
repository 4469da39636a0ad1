"""``torch.compile``: compiled modules and their eager originals, tracing, running eagerly."""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from .features import require


COMPILED_NODE = "CompiledFunctionBackward"  # one node per compiled region in the autograd graph


def compiled_original(module: Any) -> Optional[torch.nn.Module]:
    """The eager module behind a ``torch.compile``'d one (``OptimizedModule._orig_mod``), else None.
    Recognised without importing torch._dynamo (importing it is slow)."""
    if type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None),
                                                                 torch.nn.Module):
        return module._orig_mod
    return None


def compiled_in_place(module: Any) -> bool:
    """Whether ``nn.Module.compile()`` compiled ``module`` in place (its calls run a compiled
    ``_call_impl``; the module keeps its class and paths)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def original_path(path: str) -> str:
    """A module or parameter path as the eager model names it: a compiled module's ``_orig_mod`` (and
    empty parts) left out (``block._orig_mod.lin`` -> ``block.lin``)."""
    return ".".join(part for part in path.split(".") if part and part != "_orig_mod")


_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def compiling() -> bool:
    """Whether TorchDynamo is tracing the code that calls this (it folds the answer into the graph:
    a hook can skip what dynamo cannot trace without breaking the graph)."""
    return _IS_COMPILING()


def settable_attribute(func: Any) -> Optional[str]:
    """The attribute a tensor property's setter sets (``func``: ``Tensor.requires_grad.__set__`` as a
    TorchFunctionMode is handed it), else None."""
    descriptor = getattr(func, "__self__", None)
    if type(descriptor).__name__ != "getset_descriptor" or getattr(func, "__name__", None) != "__set__":
        return None
    return getattr(descriptor, "__name__", None)


_NEVER_ALONE: set[Any] = set()  # code objects already marked


def never_compiled_alone(*functions: Any) -> None:
    """TorchDynamo never compiles these functions (a TorchFunctionMode's ``__torch_function__``) as frames
    of their own, nor what runs inside them: where it traces a region it still inlines them, so what they
    do is part of the region's graph. Where a region breaks its graph, the call at the break runs
    eagerly, and a mode's ``__torch_function__`` with it as a frame TorchDynamo compiled: the casts and
    kernels the mode ran there became compiled regions of their own, and its value reads ran on fake
    tensors. Nothing to do before ``torch._dynamo`` is imported (nothing is compiled before)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return
    skip = eval_frame.FrameAction.SKIP
    for function in functions:
        code = getattr(function, "__code__", None)
        if code is not None and code not in _NEVER_ALONE:
            eval_frame.set_code_exec_strategy(code, eval_frame.FrameExecStrategy(skip, skip))
            _NEVER_ALONE.add(code)


class InlinedMode(TorchFunctionMode):
    """A TorchFunctionMode of gradaudit's: entered, TorchDynamo inlines its ``__torch_function__`` where it
    traces and never compiles it alone (``never_compiled_alone``)."""

    def __enter__(self) -> Any:
        never_compiled_alone(type(self).__torch_function__)
        return super().__enter__()


def constant_when_traced(function: Any) -> Any:
    """``function`` marked as ``torch.compiler.assume_constant_result`` marks it (TorchDynamo calls it once
    while it traces, on constant arguments, and records its result as a constant), without importing
    torch._dynamo as that function does (importing it is slow; it reads the mark only when it traces)."""
    function._dynamo_marked_constant = True
    return function


def dynamo_error(error: Optional[BaseException]) -> bool:
    """Whether ``error`` is TorchDynamo's (it failed to compile: ``torch._dynamo.exc``)."""
    return error is not None and type(error).__module__.startswith("torch._dynamo")


def graph_break() -> None:
    """Where TorchDynamo traces the caller, end the graph here: what follows runs eagerly."""
    torch._dynamo.graph_break()


def traced_setter(func: Any) -> Optional[str]:
    """The attribute ``func`` sets where it is a tensor property's setter (``Tensor.requires_grad.__set__``)
    handed to a TorchFunctionMode while TorchDynamo traces, else None. Dynamo cannot trace the
    descriptor's own ``__set__`` (it fails the user's compile: Wav2Vec2's feature encoder sets
    ``hidden_states.requires_grad``) but traces the assignment itself: a mode does ``setattr`` instead."""
    if getattr(func, "__name__", None) != "__set__" or not compiling():
        return None
    return settable_attribute(func)


def force_eager(who: str) -> Any:
    """A context in which torch.compile'd modules and functions run eagerly."""
    require("compiler stance", who)
    return torch.compiler.set_stance("force_eager")


# -- what a compiled region saves, read off its backward graph ---------------------------------------

@dataclass(frozen=True)
class SavedOrigin:
    """Where one tensor a compiled region saved for backward comes from, as its graphs record it.

    ``module``: the module path inside the compiled module (``""`` its root) of the op whose
    gradient reads it (as an eager save belongs to the module whose op saved it), None when the
    graphs name none; ``module_class`` that module's class name. ``trace``: the forward's stack
    trace of that op (Python's traceback text), if recorded. ``made_by``: the aten op of the forward
    graph that produced it (None for an input of the region: a parameter, a buffer or an input
    tensor); ``read_by``: the aten ops of the backward graph that read it; ``uses``: each place
    the backward graph takes it (through views of it), for a verdict read off the graph."""

    module: Optional[str]
    module_class: Optional[str]
    trace: Optional[str]
    made_by: Optional[str]
    read_by: tuple[str, ...]
    uses: tuple["SavedUse", ...] = ()


@dataclass(frozen=True)
class SavedUse:
    """One op of a compiled region's backward graph that takes a saved tensor (or a view of it):
    ``op`` its name (``aten.convolution_backward``; ``output`` where the graph returns it),
    ``position`` the argument it takes it as, ``arguments`` the op's positional arguments with
    every graph value (a tensor) as None: what its other arguments say (an output mask, a threshold)."""

    op: str
    position: int
    arguments: tuple


# ops whose result is a view of their first argument (what a use of the view reads, it reads of the save)
_VIEWS = frozenset({"aten.detach", "aten.view", "aten._unsafe_view", "aten.reshape", "aten.t", "aten.transpose",
                    "aten.permute", "aten.expand", "aten.squeeze", "aten.unsqueeze", "aten.alias", "aten.slice",
                    "aten.select", "aten.as_strided", "aten.view_as", "aten.expand_as"})


def _literal(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return None
    if isinstance(value, (list, tuple)):
        return tuple(_literal(v) for v in value)
    return value


def _schema_position(target: Any, name: str) -> Optional[int]:
    """The position of argument ``name`` in ``target``'s schema (an aten overload), else None."""
    schema = getattr(target, "_schema", None)
    for i, argument in enumerate(getattr(schema, "arguments", ())):
        if argument.name == name:
            return i
    return None


def _uses(placeholder: Any) -> Optional[tuple[SavedUse, ...]]:
    """Every op that takes ``placeholder`` or a view of it (a keyword argument at its schema position:
    the CPU flash attention's backward takes the mask as ``attn_mask``; an item of a list argument at the
    list's: index_put's indices); None where the graph takes it in a way this does not follow (outside a
    call, a keyword of an op without a schema, inside a keyword's list)."""
    found: list[SavedUse] = []
    pending, seen = [placeholder], set()
    while pending:
        value = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        for user in value.users:
            if user.op == "output":
                found.append(SavedUse("output", -1, ()))
                continue
            if user.op != "call_function":
                return None
            name = _op_name(user.target)
            positions = [i for i, a in enumerate(user.args) if a is value]
            keywords = [_schema_position(user.target, k) for k, a in user.kwargs.items() if a is value]
            # inside a list argument (index_put's indices, cat's tensors): a use at the list's position,
            # which no op's special reading in compiled._read concerns (they read tensors given alone)
            listed = [i for i, a in enumerate(user.args) if isinstance(a, (list, tuple)) and any(v is value for v in a)]
            if None in keywords or not positions + keywords + listed:
                return None  # a keyword no schema places, or inside a keyword's list
            positions += keywords + listed
            if name in _VIEWS and positions == [0]:
                pending.append(user)
                continue
            for i in positions:
                found.append(SavedUse(name, i, _literal(tuple(user.args))))
    return tuple(found)


def _op_name(target: Any) -> str:
    name = getattr(target, "__name__", None) or str(target)
    packet = getattr(target, "_overloadpacket", None)
    return f"aten.{packet.__name__}" if packet is not None else name


# the compiled frame's local that holds the module: L['self'] (its forward compiled), L['fn'] (the
# module called as a function) or L['args'][0] (a wrapper of its forward, such as transformers'
# decorators on LlamaForCausalLM.forward, taking it as its first argument); what follows is the path
# inside it
_FRAME_LOCAL = re.compile(r"^L\['(?:args'\]\[0\]|(?!args')[^']*'\])")


def _module_path(stack: Any) -> tuple[Optional[str], Optional[str]]:
    """(path inside the compiled module, class name) of the innermost entry of an FX node's
    ``nn_module_stack`` (outermost first), else (None, None)."""
    if not isinstance(stack, dict) or not stack:
        return None, None
    try:
        inner, cls = list(stack.values())[-1][:2]
    except (TypeError, ValueError, IndexError):
        return None, None
    found = _FRAME_LOCAL.match(inner) if isinstance(inner, str) else None
    if found is None:
        return None, None
    rest = inner[found.end():]
    # .layer1._modules['0'].conv1, .layers[0]: a dotted path
    rest = rest.replace("._modules['", ".").replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")
    if rest and not rest.startswith("."):
        return None, None
    name = cls if isinstance(cls, str) else getattr(cls, "__name__", None)
    if isinstance(name, str):
        name = name.rsplit(".", 1)[-1]
    return rest.strip("."), name


def _origin(placeholder: Any) -> SavedOrigin:
    readers = [user for user in placeholder.users if user.op == "call_function"]
    module = module_class = trace = None
    for node in [*readers, placeholder]:
        meta = node.meta
        if module is None:
            module, module_class = _module_path(meta.get("fwd_nn_module_stack") or meta.get("nn_module_stack"))
        if trace is None and isinstance(meta.get("stack_trace"), str):
            trace = meta["stack_trace"]
    made = placeholder.meta.get("original_aten")
    try:
        uses = _uses(placeholder)
    except Exception:  # noqa: BLE001 - a graph of another shape: no verdict from it
        uses = None
    return SavedOrigin(module, module_class, trace, None if made is None else _op_name(made),
                       tuple(dict.fromkeys(_op_name(user.target) for user in readers)), uses or ())


def _same_layout(value: Any, tensor: Any) -> bool:
    if not isinstance(value, torch.Tensor) or value.dtype != tensor.dtype or value.dim() != tensor.dim():
        return False
    if tensor.numel() == 0 and value.device.type == "meta":
        # traced on meta, a statistic the device's kernel returns empty (an eval batch norm's saved mean
        # on the CPU) has the meta kernel's size in the graph: the emulation gives the save the CPU's
        return True
    # symbolic sizes (dynamic shapes) cannot be compared: the concrete ones must agree
    return all(not isinstance(a, int) or a == b for a, b in zip(value.shape, tensor.shape))


def saved_origins(node: Any, saved: list[Any]) -> Optional[list[SavedOrigin]]:
    """Per tensor a compiled region's node saved (``saved``: its ``saved_tensors`` in order), where it
    comes from: from the backward graph AOTAutograd keeps on the region's autograd function, whose
    first tensor inputs are those saves in that order. None when that graph is not there (another
    torch, another backend) or its inputs do not match ``saved`` one by one in dtype and shape:
    then nothing is said rather than something wrong."""
    info = getattr(getattr(node, "_forward_cls", None), "_lazy_backward_info", None)
    graph = getattr(getattr(info, "bw_module", None), "graph", None)
    if graph is None:
        return None
    try:
        inputs = [n for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    except Exception:  # noqa: BLE001 - a graph of another shape: say nothing
        return None
    if len(inputs) < len(saved) or not all(t is not None and _same_layout(p.meta["val"], t)
                                           for p, t in zip(inputs, saved)):
        return None
    return [_origin(p) for p in inputs[:len(saved)]]


def donated_saves(node: Any) -> Optional[frozenset[int]]:
    """Positions in a compiled region node's saved tensors whose memory its compiled backward may reuse
    for its own results (AOTAutograd's donated buffers: written without a version bump), or None when
    the node does not say (then any may be)."""
    metadata = getattr(getattr(node, "_forward_cls", None), "metadata", None)
    donated = getattr(metadata, "bw_donated_idxs", None)
    if donated is None:
        return None
    try:
        return frozenset(int(i) for i in donated)
    except (TypeError, ValueError):
        return None


class CompilingOnMeta:
    """While entered, a region ``torch.compile`` compiles on the meta device is traced and partitioned
    as on a device, where two things differ by themselves:

    - AOTAutograd traces with the Python dispatcher on, under which a CompositeImplicitAutograd op that
      torch also gives a Python meta kernel (``aten.nll_loss``, ``where``, ``relu6``, ``selu``, ``var``
      and ~100 more: ``_composite_ops_with_python_meta``) runs that kernel for meta tensors instead of
      decomposing, as it does for CPU and CUDA ones; in a region whose input is not a leaf (a block
      compiled on its own, the part after a graph break) the op's output then loses its gradient
      (``torch.compile(F.nll_loss)(logits, labels)`` on meta returns a loss without ``grad_fn``, on torch
      2.11, 2.14 and 2.15). Those meta kernels are set aside, so the op decomposes as on the device
      (eager dispatch never uses them: nothing else changes);
    - a graph handed to inductor with meta inputs goes to ``aot_eager_decomp_partition``: AOTAutograd
      with inductor's decompositions and its min-cut partitioner, the same choice of what the region
      saves for backward, without inductor's code generation (which, given meta inputs, makes code
      whose region saves nothing). ``inductor_regions``: how many graphs went there.

    Both are restored on leaving; graphs with inputs on a device compile as they would. While entered,
    the change is process-wide (another thread tracing on meta at the same time sees it too)."""

    def __init__(self) -> None:
        self.inductor_regions = 0
        self._wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
        self._call: Any = None
        self._kernels: list[tuple[Any, Any]] = []

    def __enter__(self) -> "CompilingOnMeta":
        if "torch._dynamo" not in sys.modules:
            return self  # nothing compiles without it (torch.compile imports it): nothing to set right
        meta = torch._C.DispatchKey.Meta
        for op in _composite_ops_with_python_meta():
            kernel = op.py_kernels.pop(meta, None)
            if kernel is not None:
                self._kernels.append((op, kernel))
                op._dispatch_cache.clear()
        wrapper = self._wrapper
        if wrapper is not None:
            self._call = call = wrapper.__call__
            outer = self

            def partitioned_on_meta(self: Any, model_: Any, inputs_: Any, **kwargs: Any) -> Any:
                tensors = [t for t in inputs_ if isinstance(t, torch.Tensor)]
                if tensors and all(t.device.type == "meta" for t in tensors):
                    from torch._dynamo.backends.debugging import aot_eager_decomp_partition

                    outer.inductor_regions += 1
                    return aot_eager_decomp_partition(model_, inputs_)
                return call(self, model_, inputs_, **kwargs)

            wrapper.__call__ = partitioned_on_meta
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._call is not None:
            self._wrapper.__call__ = self._call
            self._call = None
        meta = torch._C.DispatchKey.Meta
        for op, kernel in self._kernels:
            op.py_kernels[meta] = kernel
            op._dispatch_cache.clear()
        self._kernels.clear()


_COMPOSITES: Optional[list[Any]] = None


def _composite_ops_with_python_meta() -> list[Any]:
    """The aten ops with a CompositeImplicitAutograd kernel and a Python meta kernel (found once)."""
    global _COMPOSITES
    if _COMPOSITES is None:
        import torch._decomp  # noqa: F401 (registers the Python meta kernels, as compiling does)
        import torch._meta_registrations  # noqa: F401

        meta, found = torch._C.DispatchKey.Meta, []
        for name in torch._C._dispatch_get_all_op_names():
            namespace, _, rest = name.partition("::")
            if namespace != "aten":
                continue
            packet_name, _, overload = rest.partition(".")
            packet = getattr(torch.ops.aten, packet_name, None)
            op = getattr(packet, overload or "default", None) if packet is not None else None
            if (op is not None and meta in getattr(op, "py_kernels", {})
                    and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")):
                found.append(op)
        _COMPOSITES = found
    return _COMPOSITES


def keeping_graphs() -> Any:
    """A context in which a region torch.compile compiles keeps its backward graph on its autograd
    function (``saved_origins`` reads it): AOTAutograd's cache of compiled graphs is off, since a
    region loaded from it carries no graph. Only where it compiles is anything different (it
    compiles anew instead of loading); the setting is restored on leaving."""
    config = getattr(getattr(torch, "_functorch", None), "config", None)
    if config is None or not hasattr(config, "enable_autograd_cache"):
        return contextlib.nullcontext()
    return config.patch(enable_autograd_cache=False)
