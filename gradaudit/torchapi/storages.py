"""Storages: identity, weak references, version counters, views."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .distributed import local_of


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


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor's storage (autograd's notion: ``_base`` is set)."""
    return tensor._is_view()


# A live storage from the address a StorageWeakRef keeps (its ``cdata``), or None once it was freed:
# the way torch.multiprocessing's own storage cache reads a weak reference back. The StorageWeakRef
# must be kept while its address is used: it keeps the StorageImpl (not its memory) from being
# reused for another storage.
_FROM_WEAK = torch.UntypedStorage._new_with_weak_ptr


def storage_at(cdata: int) -> Optional[torch.UntypedStorage]:
    """The storage at address ``cdata`` (``storage_id``'s answer), None once it was freed; a
    StorageWeakRef to it must be held."""
    return _FROM_WEAK(cdata)
