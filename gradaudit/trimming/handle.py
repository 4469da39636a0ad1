"""The public handle of ``trim`` and ``compare`` (held and peak bytes, plain against trimmed)."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from .. import torchapi
from ..conditions import ModelState
from ..errors import GradauditError
from ..tracking import forward_backward
from ..tensors import iter_tensors, split_inputs, unique
from ..torchapi.autograd import packed_by_checkpoint, saved_tensors_hooks_enabled, top_saved_tensors_hooks
from . import fused, steady
from .codec import KERNELS, MASK_FORMATS, mask_form
from .session import DROPPED, PACKED, Session

_TRIMMED: "weakref.WeakKeyDictionary[nn.Module, TrimHandle]" = weakref.WeakKeyDictionary()


def is_trimmed(model: nn.Module) -> bool:
    """Whether ``trim`` is installed on ``model`` now."""
    handle = _TRIMMED.get(model)
    return handle is not None and handle.installed


def handle_of(model: nn.Module) -> Optional["TrimHandle"]:
    """The handle of the ``trim`` installed on ``model`` now, or None."""
    handle = _TRIMMED.get(model)
    return handle if handle is not None and handle.installed else None


class _Running(threading.local):
    """The trim engines whose forward is running on this thread (a trimmed module inside a trimmed
    model stands aside: the outer one covers it)."""

    def __init__(self) -> None:
        self.engines: list["Engine"] = []


_RUNNING = _Running()


def _autocast_devices() -> tuple[str, ...]:
    """The device types whose autocast state this torch reports (some builds refuse some)."""
    known = []
    for device in ("cpu", "cuda"):
        try:
            torch.is_autocast_enabled(device)
            torch.get_autocast_dtype(device)
        except (RuntimeError, ValueError, TypeError):
            continue
        known.append(device)
    return tuple(known)


_AUTOCAST_DEVICES = _autocast_devices()


class Engine:
    """Chooses, per forward of the model, how trim runs it: fully decided (``Session``: every save
    boxed, every node decided; the first forward, and whenever what the decisions depend on changed,
    ``conditions``), or by the steady plan the last such forward left (``steady``: only the saves it
    changed are touched)."""

    def __init__(self, model: nn.Module, bitpack: bool, masks: str = "auto", kernels: str = "torch") -> None:
        self.session = Session(model, bitpack, masks, kernels)
        self.plan: Optional[steady.SteadyPlan] = None
        self.mode: Optional[str] = None  # "full" or "steady" while a forward runs
        self.depth = 0
        self.key: Any = None
        self.can_steady = torchapi.has("saved tensor hooks per save")
        self.parameters: Optional[list[nn.Parameter]] = None
        self.modules: Optional[list[nn.Module]] = None
        self.dropouts: list[nn.Module] = []
        self.forwards = {"full": 0, "steady": 0}

    def conditions(self, model: nn.Module, args: Any, kwargs: Any) -> Any:
        """What the decisions depend on: which parameters and inputs need a gradient, their dtypes and
        devices, train/eval, dropout probabilities, autocast. (Grad mode is on in every forward trim
        runs.) A change makes the
        next forward decide fully again; the steady plan also checks every node it changes, so a
        change missed here costs memory, never a wrong gradient."""
        if self.parameters is None:
            self.parameters = list(model.parameters())
            self.modules = list(model.modules())
            self.dropouts = [m for m in self.modules if isinstance(m, steady.STOCK_DROPOUTS)]
        return (tuple([(p.requires_grad, p.dtype, p.device) for p in self.parameters]),
                tuple([m.training for m in self.modules]),
                tuple([m.p for m in self.dropouts]),  # a dropout mask's value follows from p
                tuple([(t.requires_grad, t.dtype, t.device) for t in iter_tensors((args, kwargs))]),
                tuple([(torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES]))

    def begin(self, model: nn.Module, args: Any, kwargs: Any) -> None:
        if self.mode is not None:
            self.depth += 1  # the model calls itself; the outer call covers it
            return
        if _RUNNING.engines or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        if not saved_tensors_hooks_enabled():
            raise GradauditError(
                "gradaudit.trim cannot work here: saved-tensor hooks are disabled around this forward "
                "(torch.compile and some distributed wrappers do this). Remove the trim handle")
        top = top_saved_tensors_hooks()
        if top is not None:
            home = getattr(top[0], "__module__", "") or ""
            if home.startswith("gradaudit.") or packed_by_checkpoint(top[0]):
                # gradaudit is auditing this forward, or checkpoint holds nothing here and needs
                # every pack it counted
                return
            # the caller's own hooks around the model (save_on_cpu...): every save goes through
            # them, so the boxes wrap what they pack, and no steady plan is made or used
            self.session.begin(model, args, kwargs, top, record=False)
            self.mode = "full"
        else:
            key = self.conditions(model, args, kwargs) if self.can_steady else None
            if self.plan is not None and self.plan.key == key:
                self.plan.begin()
                self.mode = "steady"
            else:
                self.key = key
                self.session.begin(model, args, kwargs, None, record=self.can_steady)
                self.mode = "full"
        self.forwards[self.mode] += 1
        _RUNNING.engines.append(self)

    def end(self, output: Any = None) -> None:
        if self.mode is None:
            return
        if self.depth:
            self.depth -= 1
            return
        mode, self.mode = self.mode, None
        _RUNNING.engines.remove(self)
        if mode == "steady":
            self.plan.end(output)
            return
        session = self.session
        session.end(output)
        if session.record:
            self.drop_plan()
            try:
                self.plan = steady.build(session, self.key, DROPPED, PACKED)
                self.plan.install()
            finally:
                for call in session.calls:
                    call.release()
                session.calls, session.changed = [], []

    def drop_plan(self) -> None:
        if self.plan is not None:
            self.plan.remove()
            self.plan = None


class TrimHandle:
    """Returned by ``trim``: ``remove()`` (or leaving the ``with`` block) restores the model."""

    def __init__(self, model: nn.Module, bitpack: bool, masks: str = "auto", kernels: str = "torch") -> None:
        self._model_ref = weakref.ref(model)
        self._engine = engine = Engine(model, bitpack, masks, kernels)
        self._session = engine.session
        self._handles: list[Any] = []
        self._handles.append(model.register_forward_pre_hook(
            lambda module, args, kwargs: engine.begin(module, args, kwargs), with_kwargs=True, prepend=True))
        self._handles.append(model.register_forward_hook(
            lambda module, args, output: engine.end(output), always_call=True))

    @property
    def installed(self) -> bool:
        """Whether trim is still installed on the model (False after ``remove()``)."""
        return bool(self._handles)

    @property
    def bitpack(self) -> bool:
        """The ``bitpack`` option it was installed with."""
        return self._session.bitpack

    @property
    def masks(self) -> str:
        """The ``masks`` option it was installed with: ``"auto"``, ``"bits"`` or ``"bytes"``."""
        return self._session.masks

    def masks_on(self, device_type: str) -> str:
        """What its masks are on a device of that type: ``"bits"`` or ``"bytes"`` (``codec.mask_form``)."""
        return mask_form(self._session.masks, device_type, self._session.kernels)

    @property
    def kernels(self) -> str:
        """The ``kernels`` option it was installed with: ``"torch"`` or ``"triton"``."""
        return self._session.kernels

    @property
    def stats(self) -> dict[str, int]:
        """Counts since ``trim``: saves dropped and bit-packed; and, in the forwards it decided fully
        (the first, and those after a change of what the decisions depend on: ``forwards``), saves
        kept and bit-packed saves given their tensor back because a later save kept it
        (``unpacked_again``). A steady forward touches only the saves the plan changes, so it
        counts no kept ones."""
        return dict(self._session.stats)

    @property
    def forwards(self) -> dict[str, int]:
        """Forwards trimmed so far: ``full`` (every save looked at, decisions made) and ``steady``
        (the decisions of the last full one applied to the saves they change, nothing else)."""
        return dict(self._engine.forwards)

    @contextlib.contextmanager
    def forward(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        """Trim what the ``with`` block saves, as a call of the model does: for code that runs the model's
        work without calling the model itself (Lightning runs ``training_step``, which may call only the
        model's submodules). ``args``/``kwargs``: the block's inputs (alive anyway, never dropped). A call
        of the model inside the block is part of it."""
        model = self._model_ref()
        if not self.installed or model is None:
            raise GradauditError("this trim handle was removed: trim(model) again to trim a forward")
        self._engine.begin(model, args, kwargs)
        try:
            yield
        finally:
            self._engine.end()

    def remove(self) -> None:
        """Take trim off the model: its hooks removed, the model's forward as it was."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._engine.drop_plan()
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


def settle(model: nn.Module, args: tuple, kwargs: dict, run: Callable[[], Any]) -> None:
    """Where trim is installed on ``model`` and its next forward on these inputs would decide fully, run
    ``run()`` (a forward and backward of them) once first, and put the model back as it was (weights,
    buffers, ``.grad``, flags, RNG): the forward that follows is steady, as a training loop's are from
    its second step on. What measures a trimmed step (plan's and fit's probes) measures that one."""
    handle = handle_of(model)
    if handle is None:
        return
    engine = handle._engine
    if not engine.can_steady or (engine.plan is not None and engine.plan.key == engine.conditions(model, args, kwargs)):
        return
    leaves = [t for t in unique(list(iter_tensors((args, kwargs)))) if t.requires_grad and t.is_leaf]
    input_grads = [(t, t.grad) for t in leaves]
    state = ModelState(model)
    try:
        run()
    finally:
        state.restore()
        for t, grad in input_grads:
            t.grad = grad


def trim(model: nn.Module, *, bitpack: bool = True, masks: str = "auto", kernels: str = "torch") -> TrimHandle:
    """Make every forward of ``model`` keep only what backward can need; gradients stay bit-identical.

    Saves backward cannot read are forgotten (backward gets a placeholder of the same shape and strides, never read);
    saves one bit per element can stand for (ReLU results, dropout masks) become bits when
    ``bitpack``; everything else is kept. Decisions come from the static op knowledge
    (gradaudit/knowledge) and are made at every module boundary of the first forward, so the peak
    falls too. Later forwards follow those decisions and touch only the saves they change, through
    hooks on the modules that make them (a forward where what the decisions depend on changed:
    requires_grad, train/eval, dtype, device, a dropout's p or autocast, decides again; ``TrimHandle.forwards``
    counts both kinds). A node that is not what was decided on is left as autograd made it.

    Composes with ``torch.utils.checkpoint`` and ``save_on_cpu``/saved-tensor hooks used inside the
    model (their saves are left alone), with hooks around the model call (unneeded saves are
    dropped before the outer hook's unpack would run; nothing is bit-packed; every such forward
    is decided fully), and with autocast.
    Refuses (GradauditError) when saved-tensor hooks are disabled and in double backward.

    ``masks``: what a save needed only as a sign or a two-valued mask becomes (with ``bitpack``):
    ``"bits"``, one bit per element, ~97% of a float32 save freed, made and unpacked by several
    operations (numpy's on the CPU; on a GPU each is a kernel launch); ``"bytes"``, one bool per
    element, 75% freed, one operation to make and one to unpack; ``"auto"`` (the default), chosen per
    save by its device: bits on the CPU (and meta), bytes on a GPU, where bits cost more time than their
    extra memory is worth to most steps, unless ``kernels="triton"`` packs them in one kernel
    (``codec.mask_form``). ``plan`` and ``fit`` count what it chooses on their target.

    ``kernels``: what packs and unpacks bits on a GPU: ``"torch"`` (the default), torch operations
    (three elementwise kernels each way); ``"triton"``, one fused Triton kernel each way
    (Triton must be installed), the same bytes, so plans and fits count them alike. Elsewhere (the
    CPU, meta) the torch path runs either way.

    Returns a handle: ``handle.remove()`` restores the model exactly; ``with trim(model): ...``.
    """
    if not isinstance(model, nn.Module):
        raise GradauditError(f"trim() needs a torch.nn.Module, got {type(model).__name__}")
    if masks not in MASK_FORMATS:
        raise GradauditError(f"trim(masks={masks!r}): choose one of {', '.join(map(repr, MASK_FORMATS))}")
    _check_kernels(kernels, bitpack, masks)
    if model in _TRIMMED:
        raise GradauditError(f"{type(model).__name__} is already trimmed; remove the first handle first")
    handle = TrimHandle(model, bitpack, masks, kernels)
    _TRIMMED[model] = handle
    return handle


def _check_kernels(kernels: str, bitpack: bool, masks: str) -> None:
    if kernels not in KERNELS:
        raise GradauditError(f"trim(kernels={kernels!r}): choose one of {', '.join(map(repr, KERNELS))}")
    if kernels == "triton":
        if not bitpack or masks == "bytes":
            raise GradauditError(f"trim(kernels='triton') packs bits; with bitpack={bitpack}, masks={masks!r} there "
                                 f"are none to pack: leave kernels='torch'")
        if not fused.installed():
            raise GradauditError("trim(kernels='triton') needs Triton (pip install triton, which CUDA builds of "
                                 "torch bring), or leave kernels='torch'")



def compare(model: nn.Module, inputs: Any, *, bitpack: bool = True, masks: str = "auto") -> dict[str, int]:
    """Held bytes after the forward and peak bytes through forward+backward, plain vs trimmed.

    Returns ``{"held_before", "held_after", "peak_before", "peak_after"}`` in bytes; the trimmed
    figures are of a steady forward (the second: trim decides in the first). Runs three forwards and
    backwards; the model (``.grad``, buffers, flags, RNG) and the inputs' ``.grad``
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
                with trim(model, bitpack=bitpack, masks=masks):
                    # the first forward decides (every save looked at); what a training loop gets
                    # from then on is the steady forward, measured from the same state
                    settle(model, args, kwargs, lambda: forward_backward(model, args, kwargs))
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

