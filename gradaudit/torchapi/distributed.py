"""Distributed tensors, collectives and ranks (DTensor, functional collectives, process groups)."""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional

import torch


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


def in_fake_world() -> bool:
    """Whether this process's default process group is PyTorch's fake backend (``fake_process_group``)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"


def fake_process_group(world_size: int, rank: int, meta: bool = False) -> None:
    """``init_process_group`` with PyTorch's fake backend (collectives do nothing; every shape is
    as a real run's), for this process as ``rank`` of ``world_size``; with ``meta``, for tensors on the
    meta device too (a pipeline's sends and receives of meta tensors look their device's backend up)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist = torch.distributed
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    if meta:  # (the group's name stays "fake", which pipelining checks for to skip its shape vote)
        group = dist.group.WORLD
        group._register_backend(torch.device("meta"), dist.ProcessGroup.BackendType.CUSTOM,
                                group._get_backend(torch.device("cpu")))


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
