"""DistributedDataParallel: running its backward in a fake process group, and its gradient buckets.

DDP's reducer copies each gradient into a flat bucket (one tensor per bucket: ``bucket_cap_mb``, 25
MiB by default, the first one smaller once the buckets are rebuilt after the first iteration), hands
each full bucket to a communication hook (by default an all-reduce) and, where
``gradient_as_bucket_view=False`` (the default), copies the reduced bucket back into the gradients:
the buckets are memory of their own, as large as the gradients of what trains, alive from the DDP's
construction on. With ``gradient_as_bucket_view=True`` the gradients are views of them instead.

In PyTorch's fake process group an all-reduce completes with no result, which the reducer needs: its
backward fails an internal assert. ``reduce_locally`` gives each DDP of a model a communication hook
that reduces nothing (its future completes with the bucket itself: in a fake world no other rank's
gradients exist, and only shapes matter), so everything else of the reducer runs as it would:
the copies in and out, the bucket rebuild, ``no_sync``. PyTorch allows one hook per DDP, for the
DDP's life, and none can be removed: a DDP bound to a fake process group is used for no real
training, and one whose user registered a hook of their own is refused (that hook's all-reduce
would return nothing too). ``buckets_seen`` collects the buckets the hook is handed.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional

import torch

from ..errors import GradauditError

_HOOKED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the DDPs given gradaudit's hook
_SEEN: list[list[torch.Tensor]] = []  # the innermost ``buckets_seen`` collects


def data_parallel_class() -> Any:
    return torch.nn.parallel.DistributedDataParallel


def data_parallel_modules(model: torch.nn.Module) -> list[Any]:
    """The DistributedDataParallel modules in ``model`` (itself included)."""
    cls = data_parallel_class()
    return [m for m in model.modules() if isinstance(m, cls)]


def _reduce_nothing(state, bucket):  # (no annotations: DDP checks them, and these would be strings)
    """A communication hook with no communication: the bucket, as if reduced (only shapes matter)."""
    buffer = bucket.buffer()
    if _SEEN:
        _SEEN[-1].append(buffer)
    future: "torch.futures.Future[torch.Tensor]" = torch.futures.Future()
    future.set_result(buffer)
    return future


def reduce_locally(model: torch.nn.Module) -> None:
    """Give every DDP in ``model`` gradaudit's no-communication hook, once (see the module's docstring);
    for use in a fake process group only. A DDP with a communication hook of its own is refused."""
    for ddp in data_parallel_modules(model):
        if ddp in _HOOKED:
            continue
        own = [getattr(hook, "__qualname__", repr(hook)) for hook, _ in getattr(ddp, "_comm_hooks", [])]
        if own:
            raise _own_hook_refused(", ".join(own))
        try:
            ddp.register_comm_hook(None, _reduce_nothing)
        except RuntimeError as error:  # a built-in hook (register_builtin_comm_hook) is registered
            if "only be called once" not in str(error):
                raise
            raise _own_hook_refused("a built-in one") from error
        _HOOKED.add(ddp)


def _own_hook_refused(which: str) -> GradauditError:
    return GradauditError(
        f"this DistributedDataParallel has a communication hook of its own ({which}): in a fake process group "
        f"its all-reduce returns nothing, so its backward cannot run; build the DDP without register_comm_hook "
        f"for the audit (gradaudit then counts the default all-reduce's buckets, not what the hook adds)")


@contextlib.contextmanager
def buckets_seen() -> Iterator[list[torch.Tensor]]:
    """The buckets gradaudit's hook is handed while the block runs (one entry per bucket reduced,
    in order; a bucket reduced twice, by two backwards, twice)."""
    seen: list[torch.Tensor] = []
    _SEEN.append(seen)
    try:
        yield seen
    finally:
        _SEEN.remove(seen)


def no_sync(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Every DDP of ``model`` under ``no_sync()`` (its backward accumulates without reducing), as a
    training loop runs the micro-batches of an accumulated step but the last; nothing without DDP."""
    stack = contextlib.ExitStack()
    for ddp in data_parallel_modules(model):
        stack.enter_context(ddp.no_sync())
    return stack


def bucket_view_setting(model: torch.nn.Module) -> Optional[bool]:
    """Whether the DDPs of ``model`` keep gradients as views of their buckets (None: no DDP; False where
    any does not)."""
    modules = data_parallel_modules(model)
    if not modules:
        return None
    return all(bool(getattr(ddp, "gradient_as_bucket_view", False)) for ddp in modules)
