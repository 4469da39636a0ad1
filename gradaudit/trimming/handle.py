"""The public handle of ``trim`` and ``compare`` (held and peak bytes, plain against trimmed)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional

from torch import nn

from ..conditions import ModelState
from ..errors import GradauditError
from ..tracking import forward_backward
from ..tensors import iter_tensors, split_inputs, unique
from .session import Session

_TRIMMED: "weakref.WeakKeyDictionary[nn.Module, TrimHandle]" = weakref.WeakKeyDictionary()


def is_trimmed(model: nn.Module) -> bool:
    """Whether ``trim`` is installed on ``model`` now."""
    handle = _TRIMMED.get(model)
    return handle is not None and handle.installed


def handle_of(model: nn.Module) -> Optional["TrimHandle"]:
    """The handle of the ``trim`` installed on ``model`` now, or None."""
    handle = _TRIMMED.get(model)
    return handle if handle is not None and handle.installed else None


class TrimHandle:
    """Returned by ``trim``: ``remove()`` (or leaving the ``with`` block) restores the model."""

    def __init__(self, model: nn.Module, bitpack: bool) -> None:
        self._model_ref = weakref.ref(model)
        self._session = session = Session(model, bitpack)
        self._handles: list[Any] = []
        self._handles.append(model.register_forward_pre_hook(
            lambda module, args, kwargs: session.begin(module, args, kwargs), with_kwargs=True, prepend=True))
        session.modules.__enter__()
        self._handles.append(model.register_forward_hook(
            lambda module, args, output: session.end(output), always_call=True))

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    @property
    def bitpack(self) -> bool:
        """The ``bitpack`` option it was installed with."""
        return self._session.bitpack

    @property
    def stats(self) -> dict[str, int]:
        """Counts since ``trim``: saves kept, dropped, bit-packed, and bit-packed saves given their
        tensor back because a later save kept it (``unpacked_again``)."""
        return dict(self._session.stats)

    @contextlib.contextmanager
    def forward(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        """Trim what the ``with`` block saves, as a call of the model does: for code that runs the model's
        work without calling the model itself (Lightning runs ``training_step``, which may call only the
        model's submodules). ``args``/``kwargs``: the block's inputs (alive anyway, never dropped). A call
        of the model inside the block is part of it."""
        model = self._model_ref()
        if not self.installed or model is None:
            raise GradauditError("this trim handle was removed: trim(model) again to trim a forward")
        self._session.begin(model, args, kwargs)
        try:
            yield
        finally:
            self._session.end()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._session.modules.__exit__(None, None, None)
        model = self._model_ref()
        if model is not None and _TRIMMED.get(model) is self:
            del _TRIMMED[model]

    def __enter__(self) -> "TrimHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        model = self._model_ref()
        name = type(model).__name__ if model is not None else "<gone>"
        return f"<gradaudit.TrimHandle {name} {'installed' if self.installed else 'removed'}>"


def trim(model: nn.Module, *, bitpack: bool = True) -> TrimHandle:
    """Make every forward of ``model`` keep only what backward can need; gradients stay bit-identical.

    Saves backward cannot read are forgotten (backward gets a placeholder of the same shape and strides, never read);
    saves one bit per element can stand for (ReLU results, dropout masks) become bits when
    ``bitpack``; everything else is kept. Decisions come from the static op knowledge
    (gradaudit/knowledge) and are made at every module boundary of the forward, so the peak
    falls too.

    Composes with ``torch.utils.checkpoint`` and ``save_on_cpu``/saved-tensor hooks used inside the
    model (their saves are left alone), with hooks around the model call (unneeded saves are
    dropped before the outer hook's unpack would run; nothing is bit-packed), and with autocast.
    Refuses (GradauditError) when saved-tensor hooks are disabled and in double backward.

    Returns a handle: ``handle.remove()`` restores the model exactly; ``with trim(model): ...``.
    """
    if not isinstance(model, nn.Module):
        raise GradauditError(f"trim() needs a torch.nn.Module, got {type(model).__name__}")
    if model in _TRIMMED:
        raise GradauditError(f"{type(model).__name__} is already trimmed; remove the first handle first")
    handle = TrimHandle(model, bitpack)
    _TRIMMED[model] = handle
    return handle



def compare(model: nn.Module, inputs: Any, *, bitpack: bool = True) -> dict[str, int]:
    """Held bytes after the forward and peak bytes through forward+backward, plain vs trimmed.

    Returns ``{"held_before", "held_after", "peak_before", "peak_after"}`` in bytes. Runs two
    forwards and backwards; the model (``.grad``, buffers, flags, RNG) and the inputs' ``.grad``
    are left as found.
    """
    if not isinstance(model, nn.Module):
        raise GradauditError(f"compare() needs a torch.nn.Module, got {type(model).__name__}")
    if model in _TRIMMED:
        raise GradauditError("compare() measures the model with and without trimming; remove its trim handle first")
    args, kwargs = split_inputs(inputs)
    leaves = [t for t in unique(list(iter_tensors((args, kwargs)))) if t.requires_grad and t.is_leaf]
    input_grads = [(t, t.grad) for t in leaves]
    state = ModelState(model)
    try:
        measured = []
        for trimmed in (False, True):
            # each run starts from the same state: same BN statistics, same dropout masks, and no
            # accumulation into the caller's .grad tensors
            state.restore()
            for t in [*model.parameters(), *leaves]:
                t.grad = None
            if trimmed:
                with trim(model, bitpack=bitpack):
                    measured.append(forward_backward(model, args, kwargs))
            else:
                measured.append(forward_backward(model, args, kwargs))
    finally:
        state.restore()
        for t, grad in input_grads:
            t.grad = grad
    (held_before, peak_before), (held_after, peak_after) = measured
    return {"held_before": held_before, "held_after": held_after,
            "peak_before": peak_before, "peak_after": peak_after}

