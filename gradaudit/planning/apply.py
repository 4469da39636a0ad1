"""Putting a plan on a model: each chosen module's forward runs under non-reentrant
``torch.utils.checkpoint``, and comes back exactly as it was on ``remove()``.

What the wrapper guarantees:
- every tensor the module is passed (positionally, by keyword, or inside tuples, lists and dicts)
  goes to checkpoint as a positional input, so checkpoint saves it through saved-tensor hooks and
  the audit counts it (a tensor only the wrapper's closure held would be invisible to both);
- the RNG state is restored for the recomputation (``preserve_rng_state``), so dropout draws the
  same mask and gradients are bit-identical to the unplanned step;
- batch norm in train mode does not update its running statistics a second time when backward
  recomputes the block: they are put back as they were after the first forward;
- with grad disabled (``torch.no_grad``, evaluation) the module runs as it always did.

A module checkpointed selectively (policy ``"selective"``) keeps the outputs of its costly ops (those
torch.utils.flop_counter has a FLOP formula for: matrix products, convolutions, attention) through
``create_selective_checkpoint_contexts`` and recomputes only the rest.

With a plan made on top of ``gradaudit.trim`` the handle also installs trim (unless it is installed
already) and removes only the trim it installed. The two compose: inside a checkpointed module
checkpoint's saved-tensor hooks are innermost, so trim leaves those saves alone (backward recomputes
them, untrimmed: trim is not active after the forward), and trim boxes the region's inputs, which
checkpoint saves with the hooks in force outside it, keeping them (trim.session: a save of them
elsewhere is not bit-packed for nothing).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import flop_registry

from ..conditions import device_type_of, trimmed_now
from ..errors import GradauditError
from ..tensors import flatten
from ..torchapi.checkpoint import KEEP_CHECKPOINTING
from ..torchapi.dispatch import function_modes, function_modes_entered, overload_packet
from ..torchapi.modules import BATCH_NORM
from .switches import cache_config

_PLANNED: "weakref.WeakKeyDictionary[nn.Module, PlanHandle]" = weakref.WeakKeyDictionary()

FULL_POLICY, SELECTIVE_POLICY = "full", "selective"
# whether checkpoint lets the caller choose if a selective checkpoint's cache goes through outer
# saved-tensor hooks (newer torch; before, it never does)
_HOOKS_CHOICE = "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
POLICIES = (FULL_POLICY, SELECTIVE_POLICY)


# batch norm's ops: a selective checkpoint keeps their outputs, so train mode updates the running
# statistics once (recomputing them would update them again, and putting them back would run ops
# the selective checkpoint's replay does not expect)
_NORM_OPS = frozenset(getattr(torch.ops.aten, name) for name in (
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "_batch_norm_with_update",
    "_batch_norm_no_update", "cudnn_batch_norm", "miopen_batch_norm") if hasattr(torch.ops.aten, name))


def kept_by_selective(op: Any) -> bool:
    """Whether a selective checkpoint keeps the output of ``op`` (an overload or its packet): the
    ops torch.utils.flop_counter has a FLOP formula for (matrix products, convolutions,
    attention) and batch norm's."""
    packet = overload_packet(op)
    return packet in flop_registry or packet in _NORM_OPS


def _keep_costly(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if kept_by_selective(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn(policy: str, caches: Optional[list[Any]]) -> Optional[Callable[[], Any]]:
    """checkpoint's context_fn for ``policy``; each selective checkpoint's cache (the dict its
    forward context fills) is appended to ``caches`` when that is a list."""
    if policy == FULL_POLICY:
        return None
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    def contexts() -> Any:
        forward, recompute = create_selective_checkpoint_contexts(_keep_costly)
        if caches is not None:
            caches.append(getattr(forward, "storage", None))
        return forward, recompute

    return contexts


class Forwards:
    """Modules given another ``forward`` (an instance attribute, which ``nn.Module.__call__``
    uses), and each put back as it was by ``restore()``: the class's forward again, or the instance
    attribute the module had before."""

    def __init__(self) -> None:
        self._replaced: list[tuple[nn.Module, Any]] = []  # (module, the instance 'forward' it had, if any)

    def replace(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        self._replaced.append((module, module.__dict__.get("forward")))
        module.forward = forward

    def restore(self) -> None:
        for module, own in reversed(self._replaced):
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own
        self._replaced.clear()

    def __bool__(self) -> bool:
        return bool(self._replaced)


@contextlib.contextmanager
def _statistics_kept(norms: list[nn.Module]) -> Iterator[None]:
    """Train-mode batch norms run as usual (same kernel, same saves: checkpoint checks that the
    recomputation saves what the forward saved) and their running statistics are put back
    afterwards. Through ``.data``, which leaves the buffers' version counters alone: a node of the
    step may have saved them."""
    kept = [(buffer, buffer.detach().clone()) for m in norms if m.training and m.track_running_stats
            for buffer in (m.running_mean, m.running_var, m.num_batches_tracked) if buffer is not None]
    try:
        yield
    finally:
        for buffer, value in kept:
            buffer.data.copy_(value)


@contextlib.contextmanager
def _counts_aside(counters: list[tuple[nn.Module, torch.Tensor]]) -> Iterator[None]:
    """Each batch norm's ``num_batches_tracked`` replaced by its spare tensor, and put back."""
    real = [(m, m.num_batches_tracked) for m, _ in counters]
    try:
        for m, spare in counters:
            m.num_batches_tracked = spare
        yield
    finally:
        for m, counter in real:
            m.num_batches_tracked = counter


def _checkpointed(module: nn.Module, forward: Callable[..., Any], policy: str,
                  caches: Optional[list[Any]]) -> Callable[..., Any]:
    norms = [m for m in module.modules() if isinstance(m, BATCH_NORM)]
    context_fn = _context_fn(policy, caches)
    options = {"context_fn": context_fn} if context_fn is not None else {}
    if options and _HOOKS_CHOICE:
        # what the cache keeps bypasses outer saved-tensor hooks (trim's, gradaudit's): the planner's
        # figures count it so, whatever a later torch makes the default
        options["respect_saved_tensors_hooks"] = False
    if options:
        # a selective checkpoint does not rerun batch norm's kernel (kept_by_selective), so the
        # running mean and variance are updated once; the batch count, incremented in Python, is
        # pointed at a spare tensor while backward recomputes (made now, outside every forward:
        # putting the count back would run an op the selective replay does not expect)
        norms, counters = [], [(m, torch.zeros_like(m.num_batches_tracked)) for m in norms
                               if getattr(m, "num_batches_tracked", None) is not None]
    else:
        counters = []

    def planned_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        tensors, fill, _ = flatten((args, kwargs))

        def run(*inputs: torch.Tensor) -> Any:
            call_args, call_kwargs = fill(inputs)
            return forward(*call_args, **call_kwargs)

        def rerun(*inputs: torch.Tensor) -> Any:  # backward's recomputation
            with _statistics_kept(norms), _counts_aside(counters):
                return run(*inputs)

        return checkpoint(recomputed_as_run(run, rerun), *tensors, use_reentrant=False, preserve_rng_state=True,
                          **options)

    planned_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    return planned_forward


def recomputed_as_run(run: Callable[..., Any], rerun: Optional[Callable[..., Any]] = None) -> Callable[..., Any]:
    """``run`` for ``checkpoint``: its first call is the forward; later ones, backward's recomputation,
    run ``rerun`` (default ``run``) under gradaudit's meta-device emulation as the forward had it
    (kernel choices, autocast, literals' values: backward, called through torch.autograd.backward, runs
    with the function mode stack set aside; torch restores autocast and the device itself, not such
    modes). Marked as gradaudit's own checkpoint, kept where the model's are turned off."""
    modes = [m for m in function_modes() if getattr(m, "reenter_on_recompute", False)]
    calls = [0]

    def checkpointed(*inputs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return run(*inputs)
        with function_modes_entered(modes):
            return (rerun or run)(*inputs)

    setattr(checkpointed, KEEP_CHECKPOINTING, True)
    return checkpointed


class PlanHandle:
    """Returned by ``Plan.apply``: ``remove()`` (or leaving the ``with`` block) restores the model."""

    def __init__(self, model: nn.Module, paths: tuple[str, ...], policies: Optional[Mapping[str, str]] = None,
                 keep_caches: bool = False, trim: Optional[bool] = None, masks: str = "bits") -> None:
        """``policies``: path -> "full" (the default) or "selective"; ``trim``: None for a plan
        without trim, else the bitpack option of the trim it needs (and ``masks`` its masks option)."""
        policies = dict(policies or {})
        unknown = sorted(set(policies.values()) - set(POLICIES))
        if unknown:
            raise GradauditError(f"unknown checkpoint policy {unknown[0]!r}: use one of {', '.join(POLICIES)}")
        modules = dict(model.named_modules())
        missing = [p for p in paths if p not in modules]
        if missing:
            raise GradauditError(f"this plan checkpoints {missing[0]!r}, which the model has no module "
                                 f"named: apply a plan to the model it was made for")
        if model in _PLANNED and _PLANNED[model].installed:
            raise GradauditError("a plan is already applied to this model: remove() it (or leave its "
                                 "`with` block) before applying another")
        installed = _trim_handle(model)
        if trim is None and installed is not None:
            raise GradauditError("this plan's figures are without gradaudit.trim, which is installed on this model: "
                                 "remove the trim handle, or make the plan with trim=True (--trim)")
        if trim is not None and installed is not None and installed.bitpack != trim:
            raise GradauditError(f"this plan's figures are with gradaudit.trim(bitpack={trim}), and trim is installed "
                                 f"on this model with bitpack={installed.bitpack}: remove that handle first")
        if trim and installed is not None:
            there = installed.masks_on(device_type_of(model))
            if there != masks:
                raise GradauditError(f"this plan's figures are with gradaudit.trim(masks={masks!r}), and trim is "
                                     f"installed on this model with masks={installed.masks!r} ({there} here): remove "
                                     f"that handle first")
        self._model_ref = weakref.ref(model)
        self.paths = paths
        self.policies = {path: policies.get(path, FULL_POLICY) for path in paths}
        # keep_caches: per selectively checkpointed path, the caches of its checkpoints (for the
        # planner, which checks that none of their entries was changed in place)
        self.caches: dict[str, list[Any]] = {p: [] for p, policy in self.policies.items()
                                             if keep_caches and policy == SELECTIVE_POLICY}
        # the trim this handle installed (removed with it); a trim the caller installed stays theirs
        self.trim_handle: Any = None
        if trim is not None and installed is None:
            from ..trimming import trim as install_trim

            self.trim_handle = install_trim(model, bitpack=trim, masks=masks)
        # a Hugging Face model asking for a key/value cache: off while checkpointed, as its own
        # gradient checkpointing trains (a checkpointed block passed a cache would fill it again)
        self._cache_config = cache_config(model) if paths else None
        if self._cache_config is not None:
            self._cache_config.use_cache = False
        self._forwards = Forwards()
        for path in paths:
            module = modules[path]
            self._forwards.replace(module, _checkpointed(module, module.forward, self.policies[path],
                                                         self.caches.get(path)))
        _PLANNED[model] = self

    @property
    def installed(self) -> bool:
        """Whether the plan (or the trim it installed) is still in force on the model."""
        return bool(self._forwards) or self.trim_handle is not None

    def remove(self) -> None:
        """Put the model back: its modules' forwards, its cache setting and any trim this plan installed."""
        self._forwards.restore()
        if self._cache_config is not None:
            self._cache_config.use_cache = True
            self._cache_config = None
        if self.trim_handle is not None:
            self.trim_handle.remove()
            self.trim_handle = None
        model = self._model_ref()
        if model is not None and _PLANNED.get(model) is self:
            del _PLANNED[model]

    def __enter__(self) -> "PlanHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        trimmed = " and trim" if self.trim_handle is not None else ""
        return (f"<gradaudit.PlanHandle {len(self.paths)} checkpointed module(s){trimmed} "
                f"{'installed' if self.installed else 'removed'}>")


def _trim_handle(model: nn.Module) -> Any:
    """The trim handle installed on ``model``, or None (without importing trim where nobody did)."""
    if not trimmed_now(model):
        return None
    from ..trimming.handle import handle_of

    return handle_of(model)
