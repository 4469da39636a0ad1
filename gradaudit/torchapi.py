"""Every private PyTorch API gradaudit uses, behind one door.

Each feature is looked up once, when this module is imported; a missing one becomes a
``GradauditError`` that names the feature, the installed torch and what to do, raised where a
caller needs it (``require``), never an AttributeError deep inside a hook. Enum values are taken
by name, and hooks are recognised by identity (a code object), not by a substring of a name.

Tested on torch 2.11, 2.14 and 2.15 (CI runs the suite on each); tests/test_torchapi.py pins each feature.
"""

from __future__ import annotations

import contextlib
import importlib
import functools
import sys
from itertools import repeat
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.utils.checkpoint  # noqa: F401  (its internals are recognised below)
import torch.utils.hooks  # noqa: F401  (RemovableHandle's id counter: add_forward_hooks)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (the storage trackers' base)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass  # noqa: F401  (measure's wrappers)
from torch.utils._pytree import tree_flatten, tree_map  # noqa: F401

from .errors import GradauditError
from .records import Manager

_AUTOGRAD = torch._C._autograd

# -- features -------------------------------------------------------------------------------------
FEATURES: dict[str, bool] = {
    # a callback for every autograd node as it is created (gradaudit.trim; the recorder's sites)
    "node creation hook": hasattr(_AUTOGRAD, "_push_node_creation_hook")
    and hasattr(_AUTOGRAD, "_pop_node_creation_hook"),
    "sequence numbers": hasattr(_AUTOGRAD, "_get_sequence_nr"),
    "graph task id": hasattr(torch._C, "_current_graph_task_id"),
    "saved-tensor hook state": hasattr(_AUTOGRAD, "_saved_tensors_hooks_is_enabled")
    and hasattr(_AUTOGRAD, "_top_saved_tensors_default_hooks"),
    "SDPA kernel choice": hasattr(torch, "_fused_sdp_choice"),
    # torch.compiler.set_stance("force_eager"): run torch.compile'd code eagerly
    "compiler stance": hasattr(getattr(torch, "compiler", None), "set_stance"),
}


def has(feature: str) -> bool:
    return FEATURES[feature]


# the first torch release with each feature, for the error message
SINCE = {"node creation hook": "2.14"}


def require(feature: str, who: str) -> None:
    """Raise a GradauditError when ``feature`` is missing from the installed torch."""
    if not FEATURES[feature]:
        since = f" (torch >= {SINCE[feature]})" if feature in SINCE else ""
        raise GradauditError(f"{who} needs PyTorch's {feature}{since}, which torch {torch.__version__} does not "
                             f"have; upgrade torch to use it (audits work without it)")


# -- storages ---------------------------------------------------------------------------------------
def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a strided tensor's storage (the StorageImpl address), valid while it lives.
    A DTensor's is its local shard's (``local_of``)."""
    return storage_id(local_of(tensor).untyped_storage())


def storage_id(storage: Any) -> int:
    """The same identity for an untyped storage object (``storage_key(t) == storage_id(t.untyped_storage())``)."""
    return storage._cdata


def sparse_coo_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """A COO tensor's index and value tensors, coalesced or not."""
    return [t._indices(), t._values()]


def version_counter(tensor: torch.Tensor) -> int:
    """The tensor's version counter (bumped by every in-place write; views share their base's)."""
    return tensor._version


# -- distributed tensors and ranks -----------------------------------------------------------------
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _dtensor_class() -> Any:
    """torch.distributed.tensor.DTensor once something imported it (no tensor is a DTensor before:
    importing it here would cost every audit a second), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(tensor: Any) -> bool:
    if type(tensor) in _PLAIN:
        return False
    cls = _dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local shard (its wrapper owns no memory:
    its storage is a stand-in of the global size), through any wrapper subclass of one inner tensor
    (``__tensor_flatten__``: the AsyncCollectiveTensor a collective returns unwaited); any other
    tensor itself (a wrapper of several inner tensors too)."""
    for _ in range(4):  # wrappers of wrappers: an unwaited collective's result inside a DTensor
        if type(tensor) in _PLAIN:
            return tensor
        if is_dtensor(tensor):
            tensor = tensor._local_tensor
            continue
        flatten = getattr(tensor, "__tensor_flatten__", None)
        if flatten is None:
            return tensor
        try:
            names, _ = flatten()
        except Exception:  # a subclass whose flattening needs a tracing context: leave it whole
            return tensor
        if len(names) != 1:
            return tensor
        inner = getattr(tensor, names[0], None)
        if not isinstance(inner, torch.Tensor):
            return tensor
        tensor = inner
    return tensor


def wait_unwaited(tensors: Iterable[Any]) -> None:
    """Wait the functional collectives whose results ``tensors`` hold unwaited (the
    AsyncCollectiveTensor a rowwise-parallel layer returns): an audit uses the model's output no
    further, and work left in the process group's registry is warned about when the process ends."""
    for t in tensors:
        trigger = getattr(type(t), "trigger_wait", None)
        if trigger is not None:
            trigger(t)


def distributed_rank() -> Optional[tuple[int, int]]:
    """(world size, rank) of this process's default process group, None without one."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_world_size(), dist.get_rank()


def fake_process_group(world_size: int, rank: int) -> None:
    """``init_process_group`` with PyTorch's fake backend (collectives do nothing; every shape is
    as a real run's), for this process as ``rank`` of ``world_size``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def clear_dtensor_caches() -> None:
    """Forget what DTensor cached about meshes (sharding propagation, redistribution plans): a cache
    filled in one process group (a DeviceMesh compares equal across groups) would send the next
    group's collectives to the previous one's subgroups. Each cache is cleared where this torch has it."""
    tensor = sys.modules.get("torch.distributed.tensor")
    if tensor is None:
        return
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's
    if native is not None:
        native()
    propagator = getattr(getattr(tensor.DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    for cache in (getattr(propagator, "propagate_op_sharding", None),
                  getattr(type(propagator), "_propagate_tensor_meta_cached", None) if propagator is not None else None):
        if cache is not None and hasattr(cache, "cache_clear"):
            cache.cache_clear()
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    for name in ("clear_redistribute_planner_cache",):
        if callable(getattr(redistribute, name, None)):
            getattr(redistribute, name)()
    for name in ("_gen_transform_infos", "_gen_transform_infos_non_cached"):
        cache = getattr(redistribute, name, None)
        if cache is not None and hasattr(cache, "cache_clear"):
            cache.cache_clear()
    utils = sys.modules.get("torch.distributed.tensor._collective_utils")
    topology = getattr(getattr(utils, "MeshTopoInfo", None), "build_from_mesh", None)
    if topology is not None and hasattr(topology, "cache_clear"):
        topology.cache_clear()


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s modules that FSDP2 (``fully_shard``) manages, outermost first; none, without a walk,
    where FSDP2 was never imported (every audit asks)."""
    if "torch.distributed.fsdp._fully_shard" not in sys.modules:
        return []
    return [m for m in model.modules() if getattr(m, "_get_fsdp_state", None) is not None]


def fsdp_states(model: torch.nn.Module) -> list[Any]:
    """The FSDP2 states of ``model``'s modules, outermost first."""
    return [module._get_fsdp_state() for module in fsdp_modules(model)]


def fsdp_unsharded_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(parameter name, unsharded parameter) of every FSDP2 parameter of ``model`` gathered at least
    once: the leaf a forward's gradients flow to (FSDP2 reduce-scatters it into the sharded one)."""
    names = {id(p): name for name, p in model.named_parameters()}
    found = []
    for state in fsdp_states(model):
        group = getattr(state, "_fsdp_param_group", None)
        for param in getattr(group, "fsdp_params", ()):
            unsharded = getattr(param, "_unsharded_param", None)
            if isinstance(unsharded, torch.Tensor):
                sharded = getattr(param, "sharded_param", None)
                found.append((names.get(id(sharded), getattr(param, "_param_fqn", "") or ""), unsharded))
    return found


def fsdp_unsharded_storages(model: torch.nn.Module) -> dict[int, tuple[str, int]]:
    """Storage key -> (parameter name, bytes when gathered) of every FSDP2 unsharded parameter of
    ``model`` (the storages FSDP2 gathers into before a forward or backward and, resharding, resizes
    to nothing after it). Read after the forward: a parameter never gathered has none."""
    found: dict[int, tuple[str, int]] = {}
    gathered_into = {}  # the unsharded parameter's storage -> the all-gather output it views (padded)
    for state in fsdp_states(model):
        group = getattr(state, "_fsdp_param_group", None)
        for param in getattr(group, "fsdp_params", ()):
            unsharded = getattr(param, "_unsharded_param", None)
            for output in getattr(param, "all_gather_outputs", None) or ():
                if isinstance(unsharded, torch.Tensor) and storage_key(output) == storage_key(local_of(unsharded)):
                    # a storage resized to nothing keeps the tensor's shape: its numel is the gathered size,
                    # dim 0 padded to a multiple of the world size (a 127-row weight over 2 ranks: 128 rows)
                    gathered_into[storage_key(output)] = output.numel() * output.element_size()
    for name, t in fsdp_unsharded_parameters(model):
        t = local_of(t)
        key = storage_key(t)
        found.setdefault(key, (name, gathered_into.get(key, t.numel() * t.element_size())))
    return found


def fsdp_reshard(model: torch.nn.Module) -> None:
    """Reshard every FSDP2 module of ``model`` (``FSDPModule.reshard``): a forward without its
    backward leaves the root's gathered parameters registered (the root does not reshard after the
    forward); an audit puts the model back as it found it, sharded."""
    for module in fsdp_modules(model):
        if callable(getattr(module, "reshard", None)):
            module.reshard()


@contextlib.contextmanager
def fsdp_storage_events(resized: Callable[[Any], None]) -> Iterator[None]:
    """Call ``resized(storage)`` after FSDP2 gives a gathered parameter's storage its bytes (before an
    all-gather) and after it takes them back (resharding): it resizes storages in place, which no
    dispatch mode sees and no weak reference's callback reports. Nothing where FSDP2 is not loaded."""
    module = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param")
    if module is None:
        yield
        return
    cls = module.FSDPParam
    alloc, free = cls.alloc_all_gather_outputs, cls.free_unsharded_param

    def storages(param: Any) -> list[Any]:
        tensors = [*param.all_gather_outputs, *getattr(param, "_unsharded_inner_tensors", ())]
        return list({storage_id(s): s for s in (t.untyped_storage() for t in tensors)}.values())

    def alloc_all_gather_outputs(self: Any) -> None:
        alloc(self)
        for storage in storages(self):
            resized(storage)

    def free_unsharded_param(self: Any) -> None:
        held = storages(self)
        free(self)
        for storage in held:
            resized(storage)

    cls.alloc_all_gather_outputs, cls.free_unsharded_param = alloc_all_gather_outputs, free_unsharded_param
    try:
        yield
    finally:
        cls.alloc_all_gather_outputs, cls.free_unsharded_param = alloc, free


@contextlib.contextmanager
def fsdp_on_meta() -> Iterator[None]:
    """Let FSDP2 (``fully_shard``) run with parameters on the meta device: it refuses them at its
    lazy initialisation and takes its device (for the gathered parameters) from the mesh, so the
    check is skipped, the device is meta, and the meta device borrows the CPU's no-op streams."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fully_shard
    group = _fsdp_param_group.FSDPParamGroup
    saved = (group._validate_no_meta_params, _fully_shard._get_device_from_mesh, getattr(torch, "meta", None))
    group._validate_no_meta_params = lambda self: None
    _fully_shard._get_device_from_mesh = lambda mesh: torch.device("meta")
    torch.meta = torch.cpu  # device_mesh._get_device_handle("meta"): getattr(torch, "meta")
    try:
        yield
    finally:
        group._validate_no_meta_params, _fully_shard._get_device_from_mesh = saved[:2]
        if saved[2] is None:
            del torch.meta
        else:
            torch.meta = saved[2]


# -- modules ----------------------------------------------------------------------------------------
def module_slots(module: torch.nn.Module) -> tuple[dict, dict, dict]:
    """The module's own (parameters, buffers, submodules) dictionaries, live: what ``setattr``
    changes and what an audit restores."""
    return module._parameters, module._buffers, module._modules


def hook_counts(module: torch.nn.Module) -> tuple[int, ...]:
    """How many forward, forward-pre, backward and backward-pre hooks the module has."""
    return (len(module._forward_hooks), len(module._forward_pre_hooks), len(module._backward_hooks),
            len(getattr(module, "_backward_pre_hooks", {})))


_NO_HOOKS: dict = {}
_REGISTER_PRE = torch.nn.Module.register_forward_pre_hook
_REGISTER_POST = torch.nn.Module.register_forward_hook
_Handle = torch.utils.hooks.RemovableHandle


def add_forward_hooks(module: torch.nn.Module, pre: Callable, post: Callable) -> tuple:
    """Give ``module`` a forward pre-hook and an always-called forward hook, as
    ``register_forward_pre_hook(pre)`` and ``register_forward_hook(post, always_call=True)`` do:
    the same dictionary entries under ids from torch's own counter, without the two handle
    objects (an audit hooks every module of the model, every time). A class that overrides either
    method gets its own method called. Returns what ``remove_forward_hooks`` takes."""
    cls = type(module)
    if cls.register_forward_pre_hook is not _REGISTER_PRE or cls.register_forward_hook is not _REGISTER_POST:
        return (module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True))
    key = _Handle.next_id
    _Handle.next_id = key + 2
    pres, posts, always = module._forward_pre_hooks, module._forward_hooks, module._forward_hooks_always_called
    pres[key] = pre
    posts[key + 1] = post
    always[key + 1] = True
    return (key, pres, posts, always)


def remove_forward_hooks(added: tuple) -> None:
    """Remove the hooks ``add_forward_hooks`` gave a module."""
    if len(added) == 2:
        for handle in added:
            handle.remove()
        return
    key, pres, posts, always = added
    pres.pop(key, None)
    posts.pop(key + 1, None)
    always.pop(key + 1, None)


def hook_counts_of(modules: Iterable[torch.nn.Module]) -> list[tuple[int, ...]]:
    """``hook_counts`` of every module, in one pass (an audit takes them twice for every module)."""
    return [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
             len(getattr(m, "_backward_pre_hooks", _NO_HOOKS))) for m in modules]


# -- autograd nodes ---------------------------------------------------------------------------------
NO_SEQUENCE = (1 << 64) - 1  # AccumulateGrad nodes report this sequence number


def sequence_number() -> int:
    """The sequence number the next autograd node created on this thread will get."""
    return int(_AUTOGRAD._get_sequence_nr())


def node_sequence_number(node: Any) -> int:
    return node._sequence_nr()


def input_metadata(node: Any) -> Any:
    """Shape, dtype and device of the gradients ``node`` receives, one entry per output."""
    return node._input_metadata


def node_type_exists(name: str) -> bool:
    """Whether the installed torch defines a built-in autograd node type of this name."""
    return hasattr(torch._C._functions, name)


def is_custom_function(node: Any) -> bool:
    """Whether ``node`` is the backward of a Python ``torch.autograd.Function``."""
    return isinstance(node, torch.autograd.function.BackwardCFunction)


_slot_names: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def slot_names(node: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tensor slot names, scalar attribute names) of a built-in node type, cached per type."""
    kind = type(node)
    names = _slot_names.get(kind)
    if names is None:
        listing = dir(node)
        tensors = tuple(n[len("_raw_saved_"):] for n in listing if n.startswith("_raw_saved_"))
        scalars = tuple(
            n[len("_saved_"):] for n in listing
            if n.startswith("_saved_") and n[len("_saved_"):] not in tensors
        )
        names = _slot_names[kind] = (tensors, scalars)
    return names


_slot_attributes: dict[type, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]] = {}


def _slot_attributes_of(node: Any) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """``slot_names(node)`` with the node attribute each is read from: ((name, "_raw_saved_" +
    name), ...) for the tensor slots, ((name, "_saved_" + name), ...) for the scalars; per type."""
    kind = type(node)
    found = _slot_attributes.get(kind)
    if found is None:
        tensors, scalars = slot_names(node)
        found = _slot_attributes[kind] = (tuple((n, "_raw_saved_" + n) for n in tensors),
                                          tuple((n, "_saved_" + n) for n in scalars))
    return found


def raw_slot(node: Any, attr: str) -> Any:
    """The raw SavedVariable (or list of them) behind tensor slot ``attr`` (reading it unpacks nothing)."""
    return getattr(node, "_raw_saved_" + attr)


def raw_saved_slots(node: Any) -> Iterator[tuple[str, Any]]:
    """Yield (attribute name, raw SavedTensor) for every tensor slot a node saved."""
    if is_custom_function(node):
        raws = node._raw_saved_tensors or ()
        for i, raw in enumerate(raws):
            if raw is not None:
                yield f"saved_tensors[{i}]", raw
        return
    for attr, name in _slot_attributes_of(node)[0]:
        raw = getattr(node, name)  # raw_slot(node, attr)
        if isinstance(raw, (list, tuple)):
            for i, item in enumerate(raw):
                if item is not None:
                    yield f"{attr}[{i}]", item
        elif raw is not None:
            yield attr, raw


def saved_values(node: Any) -> Iterator[tuple[str, Any]]:
    """(attribute, value) of every saved slot, tensors unpacked: only for graphs nobody else's
    hooks packed (reading a checkpointed slot recomputes its block)."""
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                yield name[len("_saved_"):], getattr(node, name)
            except Exception:  # released or unreadable slots hold nothing
                continue


_SCALAR_TYPES = (bool, int, float, str)


def node_scalars(node: Any, names: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """The node's non-tensor saved values (BN's ``training``, threshold values, strides...).

    ``names``: read only these (a caller on a hot path that knows which ones matter).
    Reading these never runs an unpack hook: only tensor slots are packed.
    """
    if is_custom_function(node):
        return {}
    values: dict[str, Any] = {}
    scalars = (_slot_attributes_of(node)[1] if names is None
               else [(attr, "_saved_" + attr) for attr in names])
    for attr, name in scalars:
        try:
            value = getattr(node, name)
        except Exception:  # some symbolic-size attributes cannot be read on every device
            continue
        if isinstance(value, _SCALAR_TYPES) or value is None:
            values[attr] = value
        elif isinstance(value, (tuple, list)) and all(map(isinstance, value, repeat(_SCALAR_TYPES))):
            values[attr] = list(value)
    return values


def called_from_autograd(callback: Callable[..., Any]) -> Callable[..., Any]:
    """``callback`` as a hook autograd calls from C++ (saved-tensor pack/unpack, node creation):
    never compiled. Inside a torch.compile'd region TorchDynamo would otherwise compile each call of
    it as a frame of its own, recompiling on every guard it fails (the count of saves so far) until
    its cache limit, with a warning each time. Costs about 0.2 us per call."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:
        return callback
    wrapped = disable(callback)
    code = getattr(wrapped, "__code__", None)
    if code is not None and code is not getattr(callback, "__code__", None):
        _WRAPPER_CODES.add(code)
    return wrapped


_WRAPPER_CODES: set[Any] = set()


def caller_frame(depth: int = 1) -> Any:
    """The frame ``depth`` levels above the caller, not counting ``called_from_autograd``'s wrapper."""
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_code in _WRAPPER_CODES:
        frame = frame.f_back
    return frame


def push_node_creation_hook(callback: Callable[[Any], None], who: str) -> None:
    require("node creation hook", who)
    _AUTOGRAD._push_node_creation_hook(callback)


def pop_node_creation_hook() -> None:
    _AUTOGRAD._pop_node_creation_hook()


def in_backward() -> bool:
    """Whether an autograd graph task is running on this thread."""
    return torch._C._current_graph_task_id() != -1


# -- saved-tensor hooks -----------------------------------------------------------------------------
def saved_tensors_hooks_enabled() -> bool:
    return bool(_AUTOGRAD._saved_tensors_hooks_is_enabled())


def top_saved_tensors_hooks() -> Optional[tuple[Callable, Callable]]:
    """The innermost (pack, unpack) pair of ``saved_tensors_hooks`` in force, or None."""
    return _AUTOGRAD._top_saved_tensors_default_hooks(True)


def _nested_codes(function: Any) -> set[Any]:
    code = getattr(function, "__code__", None)
    return {c for c in (code.co_consts if code else ()) if hasattr(c, "co_code")}


# save_on_cpu's unpack hook is a closure made in its __init__: recognised by its code object
_OFFLOAD_CODES = _nested_codes(torch.autograd.graph.save_on_cpu.__init__)
_CHECKPOINT_MODULE = "torch.utils.checkpoint"


def manager_of(unpack_hook: Any) -> Manager:
    """Who manages a save packed by someone else's hooks: "checkpoint" (torch.utils.checkpoint),
    "offload" (torch.autograd.graph.save_on_cpu) or "hooks" (anybody else's)."""
    if (getattr(unpack_hook, "__module__", "") or "") == _CHECKPOINT_MODULE:
        return Manager.CHECKPOINT
    if getattr(unpack_hook, "__code__", None) in _OFFLOAD_CODES:
        return Manager.OFFLOAD
    return Manager.HOOKS


def packed_by_checkpoint(pack_hook: Any) -> bool:
    return (getattr(pack_hook, "__module__", "") or "") == _CHECKPOINT_MODULE


# -- torch.compile ----------------------------------------------------------------------------------
COMPILED_NODE = "CompiledFunctionBackward"  # one node per compiled region in the autograd graph


def compiled_original(module: Any) -> Optional[torch.nn.Module]:
    """The eager module behind a ``torch.compile``'d one (``OptimizedModule._orig_mod``), else None.
    Recognised without importing torch._dynamo (importing it is slow)."""
    if type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None),
                                                                 torch.nn.Module):
        return module._orig_mod
    return None


_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def compiling() -> bool:
    """Whether TorchDynamo is tracing the code that calls this (it folds the answer into the graph:
    a hook can skip what dynamo cannot trace without breaking the graph)."""
    return _IS_COMPILING()


def force_eager(who: str) -> Any:
    """A context in which torch.compile'd modules and functions run eagerly."""
    require("compiler stance", who)
    return torch.compiler.set_stance("force_eager")


# -- torch.utils.checkpoint's internals -------------------------------------------------------------
# A non-reentrant checkpoint saves its region's inputs with whatever saved-tensor hooks are in force
# before it installs its own: torch 2.14 in ``_CheckpointFrame.save_inputs`` (a list comprehension,
# its own frame before Python 3.12), torch 2.11 to 2.13 through ``_NoopSaveInputs.apply`` called from the
# generator. Neither holder is reachable from the outputs. Recognised by code object.
def _codes_of(owner: Any, *names: str) -> set[Any]:
    codes = set()
    for name in names:
        function = getattr(owner, name, None)
        code = getattr(function, "__code__", None)
        if code is not None:
            codes.add(code)
            codes |= _nested_codes(function)
    return codes


_CHECKPOINT = torch.utils.checkpoint
_INPUT_SAVER_CODES = (_codes_of(getattr(_CHECKPOINT, "_CheckpointFrame", None), "save_inputs")
                      | _codes_of(_CHECKPOINT, "_checkpoint_without_reentrant_generator",
                                  "_checkpoint_without_reentrant_generator_impl"))
_FUNCTION_APPLY_CODE = getattr(getattr(torch.autograd.Function.apply, "__func__", None), "__code__", None)
# reentrant checkpointing: ``CheckpointFunction.forward(ctx, run_function, ...)`` runs the block
# under no_grad; ``ctx`` is the CheckpointFunctionBackward node the output gets (when an input
# requires grad), and ``ctx.run_function`` the block
_REENTRANT_FORWARD_CODE = getattr(getattr(getattr(_CHECKPOINT, "CheckpointFunction", None), "forward", None),
                                  "__code__", None)
REENTRANT_CHECKPOINT_NODE = "CheckpointFunctionBackward"
FEATURES["checkpoint internals"] = bool(_INPUT_SAVER_CODES) and _REENTRANT_FORWARD_CODE is not None


def saving_checkpoint_inputs(frame: Any) -> bool:
    """Whether a pack called from Python frame ``frame`` is a non-reentrant checkpoint saving its
    region's inputs (held until backward, to recompute the region)."""
    code = frame.f_code
    if code is _FUNCTION_APPLY_CODE and frame.f_back is not None:  # torch 2.11 to 2.13: _NoopSaveInputs.apply
        code = frame.f_back.f_code
    return code in _INPUT_SAVER_CODES


def checkpoint_placeholder(frame: Any, tensor: torch.Tensor) -> bool:
    """Whether a checkpoint-input pack (``saving_checkpoint_inputs``) is the empty tensor torch 2.11
    to 2.13 save first (``_NoopSaveInputs.apply(dummy, kwargs, *args)``, ``dummy`` a 0-element leaf
    that requires grad so that the saver becomes a node): no input of the region, 0 bytes."""
    return (frame.f_code is _FUNCTION_APPLY_CODE and tensor.numel() == 0 and tensor.is_leaf
            and tensor.requires_grad)


_GENERATOR_CODES = _codes_of(_CHECKPOINT, "_checkpoint_without_reentrant_generator",
                             "_checkpoint_without_reentrant_generator_impl")


def checkpoint_arguments(frame: Any) -> Optional[tuple[Any, Any]]:
    """(args, kwargs) a non-reentrant checkpoint was called with, from the frame of a pack that
    saves its inputs (``saving_checkpoint_inputs``): the checkpoint keeps all of them until backward
    (its tensor arguments through saved-tensor hooks; tensors inside other arguments and keyword
    arguments through plain references, which no hook sees). None when not found."""
    frame = _checkpoint_generator_frame(frame)
    if frame is None:
        return None
    local = frame.f_locals
    args, kwargs = local["args"], local.get("kwargs") or {}
    function = local.get("fn")
    # arguments bound into the block (Hugging Face checkpoints partial(layer.__call__, **kwargs))
    while isinstance(function, functools.partial):
        args, kwargs = (*function.args, *args), {**function.keywords, **kwargs}
        function = function.func
    return args, kwargs


def _checkpoint_generator_frame(frame: Any) -> Any:
    """The frame of the non-reentrant checkpoint generator a few frames above ``frame`` (the pack
    that saves its inputs), whose locals hold the call's arguments and context; None if not found."""
    for _ in range(6):
        if frame is None:
            return None
        if frame.f_code in _GENERATOR_CODES and "args" in frame.f_locals:
            return frame
        frame = frame.f_back
    return None


# Turning a model's own checkpointing off for a while (the planner plans from what the model holds
# without it): torch.utils.checkpoint looks these names up in its module at each call, the
# non-reentrant generator (torch 2.14 on: the ``_impl`` one; 2.11 to 2.13: the other) and the reentrant Function.
_GENERATOR_NAME = next((name for name in ("_checkpoint_without_reentrant_generator_impl",
                                          "_checkpoint_without_reentrant_generator")
                        if hasattr(_CHECKPOINT, name)), None)
FEATURES["checkpoint switch"] = _GENERATOR_NAME is not None and hasattr(_CHECKPOINT, "CheckpointFunction")
KEEP_CHECKPOINTING = "__gradaudit_keep_checkpoint__"  # an attribute on a block function: its checkpoint stays


@contextlib.contextmanager
def checkpointing_off() -> Iterator[None]:
    """Every ``torch.utils.checkpoint.checkpoint`` call (reentrant or not, ``checkpoint_sequential``
    and ``functools.partial``s of it included) runs its block as a plain call while this is
    entered; a block function marked with ``KEEP_CHECKPOINTING`` keeps its checkpoint."""
    require("checkpoint switch", "planning a model that already checkpoints")
    generator, reentrant = getattr(_CHECKPOINT, _GENERATOR_NAME), _CHECKPOINT.CheckpointFunction

    def plain_generator(function: Any, *rest: Any, **keywords: Any) -> Iterator[None]:
        if getattr(function, KEEP_CHECKPOINTING, False):
            yield from generator(function, *rest, **keywords)
        else:
            yield  # checkpoint calls the function between the two steps; nothing else happens

    class Reentrant:
        @staticmethod
        def apply(function: Any, preserve_rng_state: Any, *args: Any) -> Any:
            if getattr(function, KEEP_CHECKPOINTING, False):
                return reentrant.apply(function, preserve_rng_state, *args)
            return function(*args)

    setattr(_CHECKPOINT, _GENERATOR_NAME, plain_generator)
    _CHECKPOINT.CheckpointFunction = Reentrant
    try:
        yield
    finally:
        setattr(_CHECKPOINT, _GENERATOR_NAME, generator)
        _CHECKPOINT.CheckpointFunction = reentrant


def without_dispatch_modes() -> Any:
    """A context in which no TorchDispatchMode sees the ops run (gradaudit's own bookkeeping tensors,
    which storage trackers must not count)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def function_modes() -> list[Any]:
    """The TorchFunctionModes in force, outermost first."""
    return list(torch.overrides._get_current_function_mode_stack())


@contextlib.contextmanager
def function_modes_entered(modes: Sequence[Any]) -> Iterator[None]:
    """Enter those of ``modes`` not in force now, in order (a torch function being handled runs with
    the mode stack set aside: a backward called through ``torch.autograd.backward`` does)."""
    active = {id(m) for m in function_modes()}
    with contextlib.ExitStack() as stack:
        for mode in modes:
            if id(mode) not in active:
                stack.enter_context(mode)
        yield


_SAC_MODE = getattr(_CHECKPOINT, "_CachingTorchDispatchMode", None)
FEATURES["selective checkpoint cache"] = _SAC_MODE is not None


def checkpoint_cache(frame: Any) -> Optional[Any]:
    """The cache of a selective (op-level) non-reentrant checkpoint, from the frame of a pack that
    saves its inputs: the dict its caching dispatch mode fills with the outputs the policy keeps
    (``create_selective_checkpoint_contexts``), held until backward and seen by no saved-tensor
    hook. None for a plain checkpoint."""
    frame = _checkpoint_generator_frame(frame)
    context = frame.f_locals.get("forward_context") if frame is not None else None
    if _SAC_MODE is not None and isinstance(context, _SAC_MODE):
        return getattr(context, "storage", None)
    return None


def cached_tensors(cache: Any) -> list[torch.Tensor]:
    """The tensors a selective checkpoint's cache holds (each op output it keeps, in its wrapper)."""
    found = []
    for entries in list(cache.values()) if isinstance(cache, dict) else []:
        for tree in list(entries.values()) if isinstance(entries, dict) else list(entries):
            for leaf in tree_flatten(tree)[0]:
                value = getattr(leaf, "val", None)
                if isinstance(value, torch.Tensor):
                    found.append(value)
    return found


def mutated_cached(cache: Any) -> int:
    """How many of the op outputs a selective checkpoint's cache keeps were changed in place after
    it kept them: backward raises on each ("Tensor cached during selective activation checkpoint
    has been mutated")."""
    mutated = 0
    for entries in list(cache.values()) if isinstance(cache, dict) else []:
        for tree in list(entries.values()) if isinstance(entries, dict) else list(entries):
            for leaf in tree_flatten(tree)[0]:
                value, version = getattr(leaf, "val", None), getattr(leaf, "version", None)
                if isinstance(value, torch.Tensor) and version is not None and value._version != version:
                    mutated += 1
    return mutated


def reentrant_checkpoint_frames(frame: Any) -> Iterator[tuple[Any, Any]]:
    """(frame, ctx) of every reentrant ``CheckpointFunction.forward`` running at ``frame`` or
    below it, innermost first (``ctx``: the node being built)."""
    if _REENTRANT_FORWARD_CODE is None:
        return
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD_CODE:
            ctx = frame.f_locals.get("ctx")
            if ctx is not None:
                yield frame, ctx
        frame = frame.f_back


def checkpoint_run_function(node: Any) -> Any:
    """The block a reentrant checkpoint node recomputes in backward (None when not readable)."""
    return getattr(node, "run_function", None)


# -- kernels ----------------------------------------------------------------------------------------
# gradaudit's backend names -> the name in torch._C's _get_<name>_sdp_enabled
_SDP_FLAGS = {"flash": "flash", "efficient": "mem_efficient", "cudnn": "cudnn", "math": "math",
              "overrideable": "overrideable", "fa3": "fa3"}


def sdp_backend_name(choice: int) -> str:
    """"flash", "efficient", "cudnn", "math"... for a backend number (by the enum's names)."""
    backend = getattr(getattr(torch.nn, "attention", None), "SDPBackend", None)
    names = {int(getattr(backend, n)): n for n in dir(backend) if n.isupper()} if backend is not None else {}
    name = names.get(int(choice), "unknown").lower()
    return {"flash_attention": "flash", "efficient_attention": "efficient", "cudnn_attention": "cudnn"}.get(name, name)


def cpu_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                        is_causal: bool, *, attn_mask: Any = None, scale: Any = None) -> torch.Tensor:
    """The output of the CPU flash-attention kernel (its meta implementation on meta tensors)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


# CUDA's attention kernels and fused dropout, called on meta tensors (gradaudit/cuda_choices.py): each
# op's meta implementation returns outputs of the GPU kernel's shapes and dtypes, and autograd builds the
# node the GPU builds, with its saves (logsumexp, random-number state).
_ATEN = torch.ops.aten
FEATURES["CUDA attention kernels"] = all(
    hasattr(_ATEN, name) for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                      "_scaled_dot_product_cudnn_attention", "_safe_softmax", "native_dropout"))
FEATURES["SDPA settings"] = all(hasattr(torch._C, f"_get_{flag}_sdp_enabled")
                                for flag in ("flash", "mem_efficient", "cudnn", "math")) \
    and hasattr(torch._C, "_get_sdp_priority_order")


def cuda_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                         is_causal: bool, scale: Optional[float]) -> torch.Tensor:
    """The output of CUDA's flash-attention op (ScaledDotProductFlashAttentionBackward0)."""
    return _ATEN._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                     scale=scale)[0]


def cuda_efficient_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Optional[torch.Tensor],
                             logsumexp: bool, dropout_p: float, is_causal: bool,
                             scale: Optional[float]) -> torch.Tensor:
    """The output of CUDA's memory-efficient attention op (ScaledDotProductEfficientAttentionBackward0)."""
    return _ATEN._scaled_dot_product_efficient_attention(query, key, value, bias, logsumexp, dropout_p, is_causal,
                                                         scale=scale)[0]


def cuda_cudnn_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Optional[torch.Tensor],
                         logsumexp: bool, dropout_p: float, is_causal: bool, scale: Optional[float]) -> torch.Tensor:
    """The output of cuDNN's attention op (ScaledDotProductCudnnAttentionBackward0)."""
    return _ATEN._scaled_dot_product_cudnn_attention(query, key, value, bias, logsumexp, dropout_p, is_causal, False,
                                                     scale=scale)[0]


def safe_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """ATen's ``_safe_softmax`` (the softmax of SDPA's math kernel: rows masked entirely give 0)."""
    return _ATEN._safe_softmax(x, dim)


def native_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """The output of ATen's fused dropout in training (NativeDropoutBackward0, which saves a bool mask)."""
    return _ATEN.native_dropout(x, p, True)[0]


def mul_scalar(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x * factor`` as C++ multiplies by a Scalar (MulBackward1, which saves no tensor)."""
    return _ATEN.mul.Scalar(x, factor)


def sdp_enabled() -> dict[str, bool]:
    """Which attention backends torch's global settings (``torch.backends.cuda.enable_*_sdp``,
    ``torch.nn.attention.sdpa_kernel``) leave enabled, by gradaudit's names, and "fa3" (FlashAttention-3)."""
    # a flag this torch does not have (FlashAttention-3's, the overrideable backend's) is off
    return {name: bool(getattr(torch._C, f"_get_{flag}_sdp_enabled", lambda: False)())
            for name, flag in _SDP_FLAGS.items()}


def sdp_priority_order() -> tuple[str, ...]:
    """The order in which torch tries the attention backends (``sdpa_kernel(..., set_priority=True)``
    changes it), by gradaudit's names."""
    return tuple(sdp_backend_name(choice) for choice in torch._C._get_sdp_priority_order())


def math_sdp_low_precision_reduction() -> bool:
    """Whether SDPA's math kernel may reduce in float16/bfloat16 (else it computes in float32)."""
    return bool(torch._C._get_math_sdp_allow_fp16_bf16_reduction())


def cudnn_version() -> Optional[int]:
    """The cuDNN version the installed torch loads (9.24.0 is 92400), None where it has none."""
    try:
        return torch.backends.cudnn.version()
    except Exception:  # a build without cuDNN
        return None


def cudnn_batch_norm(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, running_mean: Any,
                     running_var: Any, training: bool, momentum: float, eps: float) -> torch.Tensor:
    """The output of ATen's cuDNN batch norm. On meta tensors its meta implementation builds the
    CudnnBatchNormBackward0 node with the saves cuDNN makes, the reserve space empty (its size on
    a GPU is cuDNN's to say)."""
    return torch.ops.aten.cudnn_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)[0]


def suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """What ATen's ``Tensor::suggest_memory_format()`` says of ``t``: channels-last (2-d or 3-d) for
    strides like those, else contiguous."""
    from torch._prims_common import suggest_memory_format as suggest

    return suggest(t)


_AUTOCAST_CLASS = torch.amp.autocast_mode.autocast
# torch.autocast("cuda") asks this module's amp_definitely_not_available() whether to turn itself off
_AMP_COMMON = getattr(getattr(torch.cuda, "amp", None), "common", None)


@contextlib.contextmanager
def cuda_autocast_without_cuda() -> Iterator[None]:
    """While on, ``torch.autocast("cuda")`` (and ``torch.cuda.amp.autocast``) switch themselves on as on
    a GPU that supports bfloat16, also where no CUDA device is present (torch turns them off there,
    with a warning, and refuses bfloat16). Only the construction of an autocast context sees the
    difference: ``torch.cuda.is_available()`` and everything else answer as before. A no-op where
    CUDA is present (autocast works as it is) or where torch's check is not found."""
    check = getattr(_AMP_COMMON, "amp_definitely_not_available", None)
    if check is None or not check():
        yield
        return
    original = _AUTOCAST_CLASS.__init__

    @functools.wraps(original)
    def init_as_on_a_gpu(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        if device_type != "cuda":
            original(self, device_type, *args, **kwargs)
            return
        bf16 = torch.cuda.is_bf16_supported
        _AMP_COMMON.amp_definitely_not_available = lambda: False
        torch.cuda.is_bf16_supported = lambda including_emulation=True: True
        try:
            original(self, device_type, *args, **kwargs)
        finally:
            _AMP_COMMON.amp_definitely_not_available = check
            torch.cuda.is_bf16_supported = bf16

    _AUTOCAST_CLASS.__init__ = init_as_on_a_gpu
    try:
        yield
    finally:
        _AUTOCAST_CLASS.__init__ = original


# the base class of BatchNorm*d and InstanceNorm*d (running statistics, affine weight and bias)
BATCH_NORM_BASE = torch.nn.modules.batchnorm._NormBase


def fused_sdp_choice(*args: Any, **kwargs: Any) -> int:
    """The attention backend the dispatcher would choose for these (CPU) arguments."""
    return int(torch._fused_sdp_choice(*args, **kwargs))


def op_namespaces() -> tuple[Any, ...]:
    """torch's C namespaces of functions (F's builtins, the _VF ops) as a TorchFunctionMode gets them."""
    return tuple(space for space in (getattr(torch._C, "_nn", None), getattr(torch._C, "_VariableFunctions", None))
                 if space is not None)


def any_autocast_enabled(device_types: Iterable[str]) -> bool:
    """Whether some autocast context is on (torch's one check where it has it, else per device type)."""
    check = getattr(torch._C, "_is_any_autocast_enabled", None)
    if check is not None:
        return bool(check())
    return any(torch.is_autocast_enabled(d) for d in device_types)


def overload_packet(op: Any) -> Any:
    """The overload packet of an operator overload (``aten.mm.default`` -> ``aten.mm``); a packet as it is."""
    return getattr(op, "_overloadpacket", op)


def op_schema(op: Any) -> Any:
    """An operator overload's schema (its arguments' alias information says which it writes)."""
    return op._schema


def first_overload_schema(packet: Any) -> Optional[Any]:
    """The schema of an overload packet's first overload (its ``returns`` say which alias an input);
    None where the packet has no overload or schema to read."""
    try:
        return getattr(packet, packet.overloads()[0])._schema
    except (AttributeError, IndexError, RuntimeError):
        return None


# -- optimizers on meta ---------------------------------------------------------------------------
_OPTIMIZER_MODULE = importlib.import_module("torch.optim.optimizer")
FEATURES["fused optimizers on meta"] = hasattr(_OPTIMIZER_MODULE, "_get_fused_kernels_supported_devices")


@contextlib.contextmanager
def fused_optimizers_on_meta() -> Iterator[None]:
    """While in force, torch.optim's fused implementations (``fused=True``) take meta tensors: their
    kernels have meta versions (Adam, AdamW), and only the optimizers' device check, which reads
    ``_get_fused_kernels_supported_devices``, leaves meta out. A fused optimizer without a meta kernel
    still raises when it steps."""
    if not FEATURES["fused optimizers on meta"]:
        yield
        return
    original = _OPTIMIZER_MODULE._get_fused_kernels_supported_devices
    _OPTIMIZER_MODULE._get_fused_kernels_supported_devices = lambda: [*original(), "meta"]
    try:
        yield
    finally:
        _OPTIMIZER_MODULE._get_fused_kernels_supported_devices = original
