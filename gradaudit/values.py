"""Real values beside meta tensors: what a forward on the meta device reads, answered where it can be.

Meta tensors have shapes but no values, and model code reads values while it builds masks and
positions: Hugging Face's mask helpers call ``padding_mask.all()`` and look for packed sequences in the
position ids, and a model may take ``.item()`` of an index. Those reads decide what autograd saves
(whether attention gets a mask, which kernel runs), so an audit on meta must answer them as the CPU
would.

``Values`` keeps a CPU copy of every meta storage whose contents can be known: written by a
deterministic factory (``torch.arange``, ``zeros``, ``full``, ``torch.tensor``), given by the user (a CPU
tensor beside a meta model), or computed by an op from known storages (a mask, position ids). Views
need nothing: a meta tensor's value is its storage's copy seen through the tensor's own sizes, strides
and offset. In-place ops are applied to the copy; a write the mode cannot compute, or one made outside
it (the storage's version counter moved), forgets the copy. Values that follow from the weights
(anything computed from a parameter) stay unknown: a value read that meets one is answered by an
assumption the ``Values`` object records (``reads``), which the audit reports as a note.

Only storages up to ``MAX_ELEMENTS`` elements get a copy: masks and indices, not activations.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .torchapi.compiler import InlinedMode, compiling, traced_setter
from .torchapi.dispatch import TorchDispatchMode, op_schema, tree_map, without_dispatch_modes
from .torchapi.storages import storage_key, version_counter

# a copy is kept for storages up to this many elements (a 4 x 4096 mask is 16,384; a causal 4-D mask
# of 8 x 4096 x 4096 is 134M, and is never read)
MAX_ELEMENTS = 1 << 20

_aten = torch.ops.aten
# ops that leave memory uninitialised: their values are unknown, not zeros
_UNINITIALISED = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                  _aten.new_empty.default, _aten.new_empty_strided.default}
# ops that hand a value to Python (not a tensor): answered from the copy
_READS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default}


_ASSUMED = "on meta, a value was assumed:"


def is_assumption_note(note: str) -> bool:
    """Whether a report's note says a value read on meta was answered by an assumption."""
    return note.startswith(_ASSUMED)


@dataclass(frozen=True)
class ValueRead:
    """A value read on the meta device that no known value answered, and what was assumed."""

    op: str  # the aten op that read it ("aten._local_scalar_dense", "aten.nonzero", ...)
    shape: tuple[int, ...]
    dtype: str
    assumed: str  # what the audit assumed in its place
    where: str  # the model's source line that asked, or "unknown"


def _version(t: torch.Tensor) -> int:
    # inference-mode tensors keep no version counter (and cannot be written outside inference mode)
    return -1 if t.is_inference() else version_counter(t)


class _Copy:
    __slots__ = ("meta", "cpu", "version")

    def __init__(self, meta: Any, cpu: Any, version: int) -> None:
        self.meta, self.cpu, self.version = meta, cpu, version


class Values:
    """The CPU copies of meta storages, process-wide (weakly keyed: a copy dies with its storage)."""

    def __init__(self) -> None:
        self._copies: dict[int, _Copy] = {}

    def _entry(self, t: torch.Tensor) -> Optional[_Copy]:
        entry = self._copies.get(storage_key(t))
        if entry is None:
            return None
        if entry.meta.expired() or entry.version != _version(t):
            return None  # the storage died (its address reused) or was written where no copy followed
        return entry

    def known(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (not t.is_meta or (
            t.layout == torch.strided and self._entry(t) is not None))

    def value(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The CPU tensor holding ``t``'s values (a view of its storage's copy), or None when unknown.
        A tensor on a real device is its own value."""
        if t.device.type != "meta":
            return t
        if t.layout != torch.strided:
            return None
        entry = self._entry(t)
        if entry is None:
            return None
        out = torch.empty(0, dtype=t.dtype, device="cpu")
        return out.set_(entry.cpu, t.storage_offset(), t.size(), t.stride())

    def remember(self, meta: torch.Tensor, cpu: torch.Tensor) -> None:
        """Keep ``cpu``'s values as those of ``meta``'s storage (same shape); over the size limit, nothing."""
        if meta.device.type != "meta" or meta.layout != torch.strided:
            return
        storage = meta.untyped_storage()
        if storage.nbytes() > MAX_ELEMENTS * max(meta.element_size(), 1):
            return
        copy = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu").untyped_storage()
        view = torch.empty(0, dtype=meta.dtype, device="cpu").set_(copy, meta.storage_offset(), meta.size(), meta.stride())
        with torch.no_grad():
            view.copy_(cpu.detach())
        self._copies[storage_key(meta)] = _Copy(StorageWeakRef(storage), copy,
                                                         _version(meta))

    def written(self, meta: torch.Tensor) -> None:
        """``meta``'s storage was written and its copy followed: take its new version."""
        entry = self._copies.get(storage_key(meta))
        if entry is not None:
            entry.version = _version(meta)

    def forget(self, meta: torch.Tensor) -> None:
        self._copies.pop(storage_key(meta), None)

    def prune(self) -> None:
        for key in [k for k, entry in self._copies.items() if entry.meta.expired()]:
            del self._copies[key]

    def __len__(self) -> int:
        return len(self._copies)


VALUES = Values()


def _meta_tensors(values: list) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor) and v.is_meta]


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "meta":
        return torch.device("cpu")
    if isinstance(value, str) and value == "meta":
        return "cpu"
    return value


class KnownValues(TorchDispatchMode):
    """Carries values through a forward (or a factory) on meta: every op whose inputs are all known
    is also run on their CPU copies; value reads are answered from the copies.

    A read of a value nobody knows (one that follows from the weights, or a meta input built without
    this mode) is answered as if the tensor held ones, the convention of torch's own meta ``nonzero``
    fallback: ``mask.all()`` is True, ``nonzero`` finds every element, ``.item()`` gives 1. Each such
    read is recorded (``reads``) with the model's source line that asked, and the audit reports it.
    With ``assume=False`` the read raises as meta does.
    """

    def __init__(self, values: Values = VALUES, assume: bool = True,
                 kernels: Optional[Callable[[Any, tuple, dict], Any]] = None) -> None:
        """``kernels(func, args, kwargs)``: what runs each op beneath (a device's kernel choices,
        ``meta.DeviceKernelsOnMeta.run``) where it would otherwise be a dispatch mode of its own below
        this one: one mode where two did one job (each mode costs every op ~3 us of Python)."""
        super().__init__()
        self.values = values
        self.assume = assume
        self._run = kernels if kernels is not None else _call
        # ``observer(func, args, out)`` after each op this mode answers (tracking.Lifetimes rides on it
        # so, where it would be a dispatch mode of its own right above this one)
        self.observer: Optional[Callable[[Any, tuple, Any], None]] = None
        self.reads: list[ValueRead] = []
        self._written: list[torch.Tensor] = []  # in-place targets whose version moves after the op

    @property
    def notes(self) -> list[str]:
        """One note per distinct unknown read: which, where, what was assumed."""
        seen: dict[tuple[str, str, str], int] = {}
        for read in self.reads:
            key = (read.op, read.where, read.dtype)
            seen[key] = seen.get(key, 0) + 1
        notes = []
        for (op, where, dtype), count in seen.items():
            times = f" ({count} times)" if count > 1 else ""
            notes.append(f"{_ASSUMED} {op} read the values of a {dtype} tensor nobody knows at {where}{times} (they follow "
                         f"from the weights, or from a meta input without values): assumed all ones; what autograd "
                         f"saves after that point may depend on it. Pass the real values (CPU tensors beside the meta "
                         f"model) to remove the assumption")
        return notes

    def _assumed(self, func: Any, t: torch.Tensor) -> torch.Tensor:
        from .sites import user_source_line  # noqa: WPS433 (the read's site, only when one is assumed)

        where = user_source_line(sys._getframe(1)) or "unknown"
        self.reads.append(ValueRead(str(func).removesuffix(".default"), tuple(t.shape),
                                    str(t.dtype).removeprefix("torch."), "all ones", where))
        return torch.ones(t.shape, dtype=t.dtype, device="cpu")

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """True: TorchDynamo compiles a ``torch.compile``'d region under this mode (without it, a
        dispatch mode on the stack makes it run the region eagerly). It steps the mode aside while it
        traces on fake tensors; the compiled region's ops then pass through it as eager ones do."""
        return True

    def __enter__(self) -> "KnownValues":
        self.values.prune()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        self._settle()
        return super().__exit__(*exc)

    def _settle(self) -> None:
        # autograd bumps an in-place target's version after the op returns: take it now
        for t in self._written:
            self.values.written(t)
        self._written.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = self._dispatch(func, args, kwargs or {})
        if self.observer is not None:
            self.observer(func, args, out)
        return out

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        # (every op of a meta step passes here: the op's traits are looked up once, in _traits)
        if self._written:
            self._settle()
        flat = _tensors_of(args, kwargs)
        metas = any(t.is_meta for t in flat)
        if not metas and not _factory(func, kwargs):
            return self._run(func, args, kwargs)  # nothing on meta reaches it
        traits = _TRAITS.get(func) or _traits(func)
        if metas and (traits.reads or (func is _TO_COPY and _leaves_meta(kwargs.get("device")))):
            return self._read(func, args, kwargs, flat)
        known = True
        for t in flat:
            if not self.values.known(t):
                known = False
                break
        try:
            out = self._run(func, args, kwargs)
        except (NotImplementedError, RuntimeError):
            if not (metas and traits.dynamic_shape):
                raise
            # nonzero, masked_select, unique, indexing with a bool mask: the output's shape depends
            # on values, which meta does not have
            return self._data_dependent(func, args, kwargs, flat, known)
        if known and traits.computes:
            self._follow(func, args, kwargs, out)
        elif traits.writes:
            for t in _written_arguments(func, args, kwargs):
                self.values.forget(t)
        return out

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        written = _written_arguments(func, args, kwargs)
        outs = _meta_tensors(_outputs(out))
        fresh = [t for t in outs if not self.values.known(t)]
        if not written and not fresh:
            return  # a view of known storage: nothing to compute
        if any(t.numel() > MAX_ELEMENTS for t in fresh + written):
            for t in written:
                self.values.forget(t)
            return
        try:
            cpu_out = self._with_values(func, args, kwargs, _tensors_of(args, kwargs))  # all known: none assumed
        except Exception:  # noqa: BLE001  (the op's CPU kernel refuses what meta accepted: stay unknown)
            for t in written:
                self.values.forget(t)
            return
        self._written.extend(written)
        cpu_outs = _outputs(cpu_out)
        meta_outs = _outputs(out)
        if len(cpu_outs) != len(meta_outs):
            return
        for meta, cpu in zip(meta_outs, cpu_outs):
            if meta.is_meta and not self.values.known(meta) and meta.shape == cpu.shape:
                self.values.remember(meta, cpu)

    def _read(self, func: Any, args: tuple, kwargs: dict, flat: list) -> Any:
        if not self.assume and not all(self.values.known(t) for t in _meta_tensors(flat)):
            return self._run(func, args, kwargs)  # raises as meta does
        return self._with_values(func, args, kwargs, flat)

    def _with_values(self, func: Any, args: tuple, kwargs: dict, flat: list) -> Any:
        """``func`` run on the CPU values of its meta arguments; an unknown one is assumed (and
        recorded), for this call only: nothing computed from an assumption is remembered as known."""
        substitutes = {}
        for t in _meta_tensors(flat):
            if id(t) not in substitutes:
                value = self.values.value(t)
                substitutes[id(t)] = value if value is not None else self._assumed(func, t)

        def swap(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and id(v) in substitutes:
                return substitutes[id(v)]
            return _to_cpu(v)

        with torch.no_grad():
            return func(*tree_map(swap, args), **tree_map(swap, kwargs))

    def _data_dependent(self, func: Any, args: tuple, kwargs: dict, flat: list, known: bool) -> Any:
        if not known and not self.assume:
            return self._run(func, args, kwargs)  # raises as meta does
        cpu_out = self._with_values(func, args, kwargs, flat)

        def as_meta(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            meta = torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device="meta")
            if known:  # a shape and values that follow from an assumption stay unknown
                self.values.remember(meta, v)
            return meta

        return tree_map(as_meta, cpu_out)


class _Traits:
    """What ``KnownValues`` asks of an op on every call, answered once per op."""

    __slots__ = ("reads", "dynamic_shape", "computes", "writes")

    def __init__(self, func: Any) -> None:
        tags = getattr(func, "tags", ())
        # hands a value to Python, or its output depends on values (answered from the copies)
        self.reads = func in _READS or torch.Tag.data_dependent_output in tags
        self.dynamic_shape = torch.Tag.dynamic_output_shape in tags
        # its outputs' values follow from its inputs' (not uninitialised memory, not random)
        self.computes = func not in _UNINITIALISED and not _random(func)
        self.writes = bool(_mutable(func))  # writes an argument in place


_TRAITS: dict[Any, _Traits] = {}
_TO_COPY = _aten._to_copy.default


def _traits(func: Any) -> _Traits:
    traits = _TRAITS[func] = _Traits(func)
    return traits


def _call(func: Any, args: tuple, kwargs: dict) -> Any:
    return func(*args, **kwargs)


def _leaves_meta(device: Any) -> bool:
    """Whether a ``device=`` argument names a real device (a copy out of meta reads values)."""
    return device is not None and torch.device(device).type != "meta"


def _factory(func: Any, kwargs: dict) -> bool:
    """An op with no tensor arguments that makes a tensor on meta (arange, zeros, full)."""
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


def _random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _tensors_of(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments (tensors, lists of tensors: an op's schema nests no
    deeper), faster than a pytree walk on every op of a forward."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _outputs(out: Any) -> list[torch.Tensor]:
    return _tensors_of(tuple(out) if isinstance(out, (tuple, list)) else (out,), {})


_MUTABLE: dict[Any, tuple[tuple[int, str], ...]] = {}


def _mutable(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument ``func``'s schema says it writes in place."""
    mutable = _MUTABLE.get(func)
    if mutable is None:
        mutable = _MUTABLE[func] = tuple(
            (i, argument.name) for i, argument in enumerate(op_schema(func).arguments)
            if argument.alias_info is not None and argument.alias_info.is_write)
    return mutable


def _written_arguments(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The meta tensors ``func`` writes in place (its schema's mutable arguments)."""
    mutable = _mutable(func)
    written = []
    for i, name in mutable:
        value = args[i] if i < len(args) else kwargs.get(name)
        for t in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(t, torch.Tensor) and t.is_meta:
                written.append(t)
    return written


class LiteralsOnMeta(InlinedMode):
    """``torch.tensor(...)`` / ``torch.as_tensor(...)`` on meta, and a list used as an index
    (``ids[:, [-1, 0]]``), build a CPU tensor and move it without an op a dispatch mode sees: build it
    on CPU here, and keep its values beside the meta tensor (an index list stays a CPU tensor, which
    indexing a meta tensor accepts)."""

    # a checkpoint's recomputation in backward runs under it again, as the forward did (planning/apply.py)
    reenter_on_recompute = True

    def __init__(self, values: Values = VALUES) -> None:
        super().__init__()
        self.values = values

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        setting = traced_setter(func)
        if setting is not None:
            return setattr(args[0], setting, args[1])
        if func in _INDEXING and len(args) > 1 and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            args = (args[0], _lists_as_tensors(args[1]), *args[2:])
            return func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor) and compiling():
            return _traced_literal(func, args, kwargs)
        if func in (torch.tensor, torch.as_tensor):
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.device.type == "meta" and out.numel() <= MAX_ELEMENTS:
                cpu_kwargs = dict(kwargs, device="cpu")
                cpu_kwargs.pop("requires_grad", None)
                # the copy is gradaudit's bookkeeping: no storage tracker may count it
                with without_dispatch_modes():
                    try:
                        cpu = func(*args, **cpu_kwargs)
                    except Exception:  # noqa: BLE001  (stays unknown)
                        return out
                    self.values.remember(out, cpu)
            return out
        return func(*args, **kwargs)


def to_meta(inputs: Any, values: Values = VALUES) -> Any:
    """``inputs`` with every tensor on a real device replaced by a meta tensor of the same shape,
    strides, dtype and requires_grad whose values are kept (CPU token ids, masks, positions beside a
    meta model). Sharing survives the move: one tensor given twice (``{"input_ids": ids, "labels":
    ids}``) becomes one meta tensor, and tensors that share a storage (views of one batch) become views
    of one meta storage of the whole storage's size, as the CPU counts them (a tensor that requires
    grad gets a storage of its own: a view of another would not be a leaf). Meta tensors, and
    everything that is not a tensor, stay as they are."""
    moved: dict[int, torch.Tensor] = {}  # id(tensor) -> its meta tensor (``inputs`` holds the tensors)
    bases: dict[int, torch.Tensor] = {}  # the CPU storage's key -> a meta byte tensor over its whole size

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return t
        if id(t) in moved:
            return moved[id(t)]
        meta = None
        if t.layout == torch.strided and not t.requires_grad:
            storage, key = t.untyped_storage(), storage_key(t)
            base = bases.get(key)
            if base is None:
                base = bases[key] = torch.empty(storage.nbytes(), dtype=torch.uint8, device="meta")
                values.remember(base, torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)))
            if base.numel() % t.element_size() == 0:
                # views of the one base share its version counter, as the values kept for it expect
                meta = base.view(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset())
        if meta is None:
            meta = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
            values.remember(meta, t)
            if t.requires_grad:
                meta.requires_grad_(True)
        moved[id(t)] = meta
        return meta

    return tree_map(move, inputs)


def knowing_values() -> Any:
    """The modes that give meta tensors made meanwhile their values where they can be known (a
    factory building the model and its inputs on meta)."""
    stack = contextlib.ExitStack()
    stack.enter_context(KnownValues())
    stack.enter_context(LiteralsOnMeta())
    return stack


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """``with gradaudit.meta_device(): model = build()``: ``torch.device("meta")`` for building a model
    and its batch without memory, where tensors whose contents can be known (``torch.arange``,
    ``zeros``, ``torch.tensor``, what is computed from them) keep their values: constructors that
    read them (torchvision's RegNet sizes its stages with ``.tolist()``) work, and a batch made inside
    (a padded mask) is audited as its values say. ``gradaudit scan --device meta`` builds this way."""
    with torch.device("meta"), knowing_values():
        yield


_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        (isinstance(v, (int, bool)) and not isinstance(v, torch.Tensor)) or _int_list(v) for v in value)


def _traced_literal(func: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.tensor`` / ``torch.as_tensor`` of Python data as TorchDynamo traces it in a region being
    compiled (the graph's constant: nothing is remembered, which would break the graph). Made for the
    meta device, TorchDynamo gives the graph a real meta tensor rather than a fake one, and the next op
    fails to trace (``torch.compile(f)`` of ``torch.where(m, x, torch.tensor(v, device=x.device))`` on meta
    raises, on torch 2.11, 2.14 and 2.15): such a literal is made on the CPU and moved, which traces."""
    device = kwargs.get("device")
    if device is None or torch.device(device).type != "meta" or (args and isinstance(args[0], torch.Tensor)):
        return func(*args, **kwargs)
    requires_grad = bool(kwargs.get("requires_grad", False))
    on_cpu = {k: v for k, v in kwargs.items() if k != "requires_grad"}
    on_cpu["device"] = "cpu"
    out = func(*args, **on_cpu).to("meta")
    return out.requires_grad_(True) if requires_grad else out


def _lists_as_tensors(index: Any) -> Any:
    """An index with its lists of ints or bools as CPU tensors (the same advanced indexing)."""
    if _int_list(index):
        return torch.tensor(index, device="cpu")
    if isinstance(index, tuple):
        return tuple(torch.tensor(i, device="cpu") if _int_list(i) else i for i in index)
    return index
