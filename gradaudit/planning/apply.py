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

With a plan made on top of ``gradaudit.trim`` the handle also installs trim (unless it is installed
already) and removes only the trim it installed. The two compose: inside a checkpointed module
checkpoint's saved-tensor hooks are innermost, so trim leaves those saves alone (backward recomputes
them, untrimmed: trim is not active after the forward), and trim boxes the region's inputs, which
checkpoint saves with the hooks in force outside it, keeping them (trim.session: a save of them
elsewhere is not bit-packed for nothing).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import torchapi
from ..errors import GradauditError
from ..tensors import flatten

_PLANNED: "weakref.WeakKeyDictionary[nn.Module, PlanHandle]" = weakref.WeakKeyDictionary()


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


def _checkpointed(module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def planned_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        tensors, fill, _ = flatten((args, kwargs))
        runs = [0]
        # gradaudit's own meta-device emulation (kernel choices, autocast) applies to the
        # recomputation too: backward, called through torch.autograd.backward, runs with the mode
        # stack set aside (torch restores autocast and the device itself, not such modes)
        modes = [m for m in torchapi.function_modes() if getattr(m, "reenter_on_recompute", False)]

        def run(*inputs: torch.Tensor) -> Any:
            call_args, call_kwargs = fill(inputs)
            runs[0] += 1
            if runs[0] == 1:
                return forward(*call_args, **call_kwargs)
            with _statistics_kept(norms), torchapi.function_modes_entered(modes):  # backward's recomputation
                return forward(*call_args, **call_kwargs)

        setattr(run, torchapi.KEEP_CHECKPOINTING, True)  # a plan's own checkpoint, even where the model's are off
        return checkpoint(run, *tensors, use_reentrant=False, preserve_rng_state=True)

    planned_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    return planned_forward


class PlanHandle:
    """Returned by ``Plan.apply``: ``remove()`` (or leaving the ``with`` block) restores the model."""

    def __init__(self, model: nn.Module, paths: tuple[str, ...], trim: Optional[bool] = None) -> None:
        """``trim``: None for a plan without trim, else the bitpack option of the trim it needs."""
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
        self._model_ref = weakref.ref(model)
        self.paths = paths
        # the trim this handle installed (removed with it); a trim the caller installed stays theirs
        self.trim_handle: Any = None
        if trim is not None and installed is None:
            from ..trimming import trim as install_trim

            self.trim_handle = install_trim(model, bitpack=trim)
        # (module, the instance attribute 'forward' it had, if any)
        self._wrapped: list[tuple[nn.Module, Any]] = []
        for path in paths:
            module = modules[path]
            own = module.__dict__.get("forward")
            module.forward = _checkpointed(module, module.forward)
            self._wrapped.append((module, own))
        _PLANNED[model] = self

    @property
    def installed(self) -> bool:
        return bool(self._wrapped) or self.trim_handle is not None

    def remove(self) -> None:
        for module, own in self._wrapped:
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own
        self._wrapped.clear()
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
    from ..auditing import trimmed_now

    if not trimmed_now(model):
        return None
    from ..trimming.handle import handle_of

    return handle_of(model)
