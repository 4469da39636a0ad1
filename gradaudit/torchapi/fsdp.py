"""FSDP2 (``fully_shard``): the modules it manages, the parameters it gathers and the storages it
resizes, and running it on meta."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch

from .distributed import local_of
from .storages import storage_id, storage_key


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
