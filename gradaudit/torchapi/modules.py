"""``nn.Module``'s own dictionaries and forward hooks; the batch-norm base classes."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.utils.hooks  # RemovableHandle's id counter: add_forward_hooks


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


def add_forward_hooks(module: torch.nn.Module, pre: Callable, post: Callable, *, post_first: bool = False) -> tuple:
    """Give ``module`` a forward pre-hook and an always-called forward hook, as
    ``register_forward_pre_hook(pre)`` and ``register_forward_hook(post, always_call=True)`` do:
    the same dictionary entries under ids from torch's own counter, without the two handle
    objects (an audit hooks every module of the model, every time). A class that overrides either
    method gets its own method called. ``post_first``: the forward hook runs before the module's
    other forward hooks (it sees the output the forward returned, before a hook replaces it).
    Returns what ``remove_forward_hooks`` takes."""
    cls = type(module)
    if cls.register_forward_pre_hook is not _REGISTER_PRE or cls.register_forward_hook is not _REGISTER_POST:
        return (module.register_forward_pre_hook(pre),
                module.register_forward_hook(post, always_call=True, prepend=post_first))
    key = _Handle.next_id
    _Handle.next_id = key + 2
    pres, posts, always = module._forward_pre_hooks, module._forward_hooks, module._forward_hooks_always_called
    pres[key] = pre
    posts[key + 1] = post
    if post_first:
        posts.move_to_end(key + 1, last=False)
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


# the base class of BatchNorm*d and InstanceNorm*d (running statistics, affine weight and bias)
BATCH_NORM_BASE = torch.nn.modules.batchnorm._NormBase
# the base class of BatchNorm*d, LazyBatchNorm*d and SyncBatchNorm (not InstanceNorm*d)
BATCH_NORM = torch.nn.modules.batchnorm._BatchNorm
