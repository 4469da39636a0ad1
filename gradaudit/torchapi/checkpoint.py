"""``torch.utils.checkpoint``'s internals: the frames that save a region's inputs, the reentrant
Function, selective checkpointing's cache, and turning a model's own checkpointing off.

A non-reentrant checkpoint saves its region's inputs with whatever saved-tensor hooks are in force
before it installs its own: torch 2.14 in ``_CheckpointFrame.save_inputs`` (a list comprehension,
its own frame before Python 3.12), torch 2.11 to 2.13 through ``_NoopSaveInputs.apply`` called from
the generator. Neither holder is reachable from the outputs. Recognised by code object.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.checkpoint
from torch.utils._pytree import tree_flatten

from .features import FEATURES, require
from .autograd import code_objects
from .dispatch import function_modes, function_modes_entered


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
            codes |= code_objects(function)
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
    if isinstance(function, RecomputedUnder):
        function = function.function
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

    def plain_apply(function: Any, preserve_rng_state: Any, *args: Any) -> Any:
        if getattr(function, KEEP_CHECKPOINTING, False):
            return reentrant.apply(function, preserve_rng_state, *args)
        return function(*args)

    with _checkpoint_replaced(plain_generator, plain_apply):
        yield


@contextlib.contextmanager
def _checkpoint_replaced(generator: Callable[..., Any], apply: Callable[..., Any]) -> Iterator[None]:
    """torch.utils.checkpoint's non-reentrant generator and its reentrant Function's ``apply``
    replaced while in force (it looks both up in its module at each call)."""
    original, reentrant = getattr(_CHECKPOINT, _GENERATOR_NAME), _CHECKPOINT.CheckpointFunction

    class Reentrant:
        pass

    Reentrant.apply = staticmethod(apply)
    setattr(_CHECKPOINT, _GENERATOR_NAME, generator)
    _CHECKPOINT.CheckpointFunction = Reentrant
    try:
        yield
    finally:
        setattr(_CHECKPOINT, _GENERATOR_NAME, original)
        _CHECKPOINT.CheckpointFunction = reentrant


class RecomputedUnder:
    """A checkpointed block as ``recomputing_under`` hands it to torch.utils.checkpoint: each call
    (backward's recomputation; a reentrant checkpoint's forward too) runs under the function modes
    in force where the checkpoint was called. Attributes read through to the block (a
    ``KEEP_CHECKPOINTING`` mark)."""

    def __init__(self, function: Callable[..., Any], modes: list[Any]) -> None:
        self.function, self.modes = function, modes

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with function_modes_entered(self.modes):
            return self.function(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("function", "modes"):  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.function, name)


@contextlib.contextmanager
def recomputing_under(select: Callable[[Any], bool]) -> Iterator[None]:
    """While in force, every ``torch.utils.checkpoint.checkpoint`` call (reentrant or not, a model's
    own included) recomputes its block in backward under the TorchFunctionModes in force at the call
    for which ``select(mode)`` is true. Backward runs with the function mode stack set aside (called
    through ``torch.autograd.backward`` or ``Tensor.backward``, which modes handle), and checkpoint
    restores autocast and the RNG for its recomputation, not such modes: without them a block run
    on meta under an emulation of another device is recomputed as itself (CheckpointError: the
    recomputation saves other tensors than the forward did)."""
    require("checkpoint switch", "recomputing checkpointed blocks under gradaudit's emulation")
    generator, reentrant = getattr(_CHECKPOINT, _GENERATOR_NAME), _CHECKPOINT.CheckpointFunction

    def under(function: Any) -> Any:
        modes = [mode for mode in function_modes() if select(mode)]
        return RecomputedUnder(function, modes) if modes else function

    def generator_under(function: Any, *rest: Any, **keywords: Any) -> Iterator[None]:
        # the generator calls its function only to recompute (checkpoint runs the forward itself)
        return generator(under(function), *rest, **keywords)

    def apply_under(function: Any, preserve_rng_state: Any, *args: Any) -> Any:
        return reentrant.apply(under(function), preserve_rng_state, *args)

    with _checkpoint_replaced(generator_under, apply_under):
        yield


# The device type a checkpoint records the autocast state of (at the forward) and restores it for (in
# the recomputation): torch.utils.checkpoint infers it from the block's tensor arguments, "meta" for a
# forward on meta, whose autocast it cannot record, so a block recomputed in backward would run
# without the target's autocast (CheckpointError: saved bfloat16, recomputed float32).
_INFER_DEVICE_TYPE = getattr(_CHECKPOINT, "_infer_device_type", None)
FEATURES["checkpoint device type"] = _INFER_DEVICE_TYPE is not None


@contextlib.contextmanager
def checkpoint_meta_as(device_type: str) -> Iterator[None]:
    """While in force, torch.utils.checkpoint (reentrant or not) takes a block whose tensors are on
    meta for one on ``device_type``: it records and restores that device's autocast state, as it
    does on the device itself. Its RNG states stay the CPU's: it saves a device's RNG state only once
    that device is initialised, which a machine without it never is."""
    require("checkpoint device type", "a checkpointed forward on meta for a CUDA target")
    infer = _INFER_DEVICE_TYPE

    def as_on_the_device(*args: Any) -> str:
        found = infer(*args)
        return device_type if found == "meta" else found

    _CHECKPOINT._infer_device_type = as_on_the_device
    try:
        yield
    finally:
        _CHECKPOINT._infer_device_type = infer


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
    function = getattr(node, "run_function", None)
    return function.function if isinstance(function, RecomputedUnder) else function
