"""gradaudit's storage tracker: when each storage is made and freed, and what it is.

``Lifetimes`` notes every storage an op produces while it is active, with the op after which it exists
and the op by which it is gone (a weak reference's callback says so the moment the storage is freed:
nothing is scanned per op; FSDP2's in-place resizes are followed as frees and allocations). Each
storage's ``Life`` is put in a ``Category`` afterwards; the bytes alive after any op, by category,
follow from those intervals (``sweep``). ``fit`` follows its whole training step with it, the planner
and ``trim.compare`` a forward and backward (``forward_backward``), the audit a forward
(``held_after_forward``).

The tests' independent measurement (``gradaudit.measure``) shares none of this.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from .collecting import collecting_only_new
from .records import Name
from .tensors import iter_tensors, split_inputs, storage_key, strided_parts, unique
from .torchapi.autograd import graph_nodes, is_custom_function, raw_saved_slots
from .torchapi.dispatch import TorchDispatchMode, overload_packet, top_dispatch_mode, tree_flatten
from .torchapi.ddp import buckets_seen
from .torchapi.distributed import wait_unwaited
from .torchapi.fsdp import fsdp_storage_events
from .torchapi.storages import storage_id


class Category(Name):
    """What a storage of a step is (a ``Life``'s category; a row of fit's breakdown and timeline)."""

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    INPUTS = "inputs"
    OPTIMIZER_STATE = "optimizer_state"
    WORKSPACES = "workspaces"  # on CUDA: cuBLAS's and cuBLASLt's, cached from the first step on
    GRADIENT_BUCKETS = "gradient_buckets"  # DistributedDataParallel's flat buckets (torchapi/ddp.py)
    PIPELINE_BUFFERS = "pipeline_buffers"  # a pipeline stage's receive buffers (torchapi/pipelining.py)
    GRADIENTS = "gradients"
    ACTIVATIONS = "activations"  # made in a forward, alive into its backward
    TEMPORARIES = "temporaries"  # the rest: made and freed within a phase, the loss
    UNSPLIT_BLOCKS = "unsplit_blocks"  # on CUDA: what the caching allocator hands out beyond the requests


@dataclass
class Life:
    """One storage: its size, the sample (op count) from which it is alive and the one from which it
    is not (None: alive when the tracking ended), the category it is put in afterwards, and what made
    it: the op, the module whose forward was running ("" outside any submodule's) and the user's
    source line (None where no line of the user's called the op: backward, the optimizer's step)."""

    key: int
    nbytes: int
    born: int
    died: Optional[int] = None
    category: Optional[Category] = None
    op: str = ""
    module: str = ""
    source: Optional[str] = None


_OP_NAMES: dict[Any, tuple[Any, str]] = {}  # op overload -> (its packet, its name as lives carry it)


class Lifetimes(TorchDispatchMode):
    """Every storage an op produces while active, on a device ``counts`` accepts, and not in
    ``exclude`` (what is alive anyway: parameters, buffers, inputs, optimizer state). After op n
    completes, sample n is taken: a storage made by op n is alive in it; one freed before op n+1
    completes is not alive in sample n+1."""

    def __init__(self, exclude: Iterable[int], counts: Callable[[torch.device], bool] = lambda where: True,
                 where: Optional[Callable[[], tuple[str, Optional[str]]]] = None,
                 observe: Optional[Callable[[Any, tuple], None]] = None) -> None:
        """``where()``: (the module running, the user's source line) when an op makes a storage.
        ``observe(packet, args)``: called for every op (fit counts the matrix products in it)."""
        super().__init__()
        self.exclude = set(exclude)
        self.counts = counts
        self.where = where
        self.observe = observe
        self._op = ""
        self.samples = 0
        self.live: dict[int, Life] = {}
        self.lives: list[Life] = []
        self._references: dict[int, Any] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.after(func, args, out)
        return out

    def after(self, func: Any, args: Any, out: Any) -> None:
        """Op ``func`` returned ``out``: the next sample, and the storages it made."""
        self.samples += 1
        named = _OP_NAMES.get(func)
        if named is None:
            packet = overload_packet(func)
            named = _OP_NAMES[func] = (packet, str(packet).removeprefix("aten."))
        if self.observe is not None:
            self.observe(named[0], args)
        self._op = named[1]
        for t in op_leaves(out):
            if type(t) is torch.Tensor and t.layout == torch.strided:  # (nearly every output: at once)
                self._note(t.untyped_storage())
            elif isinstance(t, torch.Tensor):
                for part in strided_parts(t):
                    self._note(part.untyped_storage())

    def __enter__(self) -> "Lifetimes":
        # FSDP2 gives its gathered parameters' storages their bytes and takes them back in place
        self._resizes = fsdp_storage_events(self._resized)
        self._resizes.__enter__()
        # right above a mode that offers to tell what each op returned (the meta emulation's
        # KnownValues, whose ``observer`` is free), ride on it: every op this mode would see reaches
        # that one next, so the samples and storages are the same, for one dispatch mode fewer
        from .values import KnownValues  # (values imports nothing of the tracker's)

        below = top_dispatch_mode()
        if isinstance(below, KnownValues) and below.observer is None:
            below.observer, self._host = self.after, below
            return self
        self._host = None
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._host is not None:
                self._host.observer, self._host = None, None
            else:
                super().__exit__(*exc)
        finally:
            self._resizes.__exit__(*exc)

    def _resized(self, storage: Any) -> None:
        """A storage resized in place: emptied, it is freed now; filled, it is made now."""
        self._op = "FSDP2 all-gather buffer"
        key = storage_id(storage)
        if storage.nbytes() == 0:
            self._freed(key, None)
        elif key in self.live and self.live[key].nbytes != storage.nbytes():
            self._freed(key, None)
            self._note(storage)
        else:
            self._note(storage)

    def _note(self, storage: Any) -> None:
        key = storage_id(storage)
        if key in self.live or key in self.exclude or not self.counts(storage.device):
            return
        life = Life(key, storage.nbytes(), self.samples, op=self._op)
        if self.where is not None:
            life.module, life.source = self.where()
        self.live[key] = life
        self.lives.append(life)
        # the storage's Python object lives exactly as long as the storage (torch keeps it while the
        # storage lives): its weak reference's callback runs when the storage is freed
        self._references[key] = weakref.ref(storage, functools.partial(self._freed, key))

    def adopt(self, tensors: Iterable[torch.Tensor], op: str) -> list[Life]:
        """Follow the storages of ``tensors``, made before the tracking began (by ``op``), as alive from
        the first sample until freed: what a previous step left that this one frees. Their lives."""
        self._op = op
        tensors = list(tensors)
        for t in tensors:
            for part in strided_parts(t):
                self._note(part.untyped_storage())
        adopted = [self.live[key] for key in keys_of(tensors) if key in self.live]
        for life in adopted:
            life.born = max(life.born, 1)  # sample 1 is the first a sweep counts
        return adopted

    def _freed(self, key: int, _reference: Any) -> None:
        life = self.live.pop(key, None)
        self._references.pop(key, None)
        if life is not None:
            life.died = self.samples + 1

    def close(self) -> None:
        """Stop following frees: the storages alive now stay alive in every figure (until the caller
        says otherwise)."""
        self._references.clear()
        self.live.clear()


def sweep(lives: Sequence[Life], samples: int, categories: Sequence[Category],
          size: Callable[[int], int]) -> list[list[int]]:
    """Bytes alive in each sample 1..``samples``, by category (rows in the order of ``categories``;
    each life's bytes as ``size`` counts them, e.g. an allocator's rounding)."""
    index = {c: i for i, c in enumerate(categories)}
    changes = [[0] * (samples + 2) for _ in categories]
    for life in lives:
        row = changes[index[life.category]]
        nbytes = size(life.nbytes)
        row[life.born] += nbytes
        row[min(life.died, samples + 1) if life.died is not None else samples + 1] -= nbytes
    totals = []
    for row in changes:
        running, column = 0, []
        for change in row[1:samples + 1]:
            running += change
            column.append(running)
        totals.append(column)
    return totals


def op_leaves(out: Any) -> Any:
    """The leaves of an op's output: a tensor, or a plain tuple or list of tensors (and numbers, None)
    as they are; anything nested through pytree."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if type(out) in (tuple, list) and not any(isinstance(v, (tuple, list, dict)) for v in out):
        return out
    return tree_flatten(out)[0]


def peak_of(lives: Sequence[Life], samples: int) -> int:
    """The most bytes ``lives`` hold together in any sample 1..``samples`` (0 for none)."""
    changes = [0] * (samples + 2)
    for life in lives:
        changes[life.born] += life.nbytes
        changes[min(life.died, samples + 1) if life.died is not None else samples + 1] -= life.nbytes
    peak = running = 0
    for change in changes[1:samples + 1]:
        running += change
        peak = max(peak, running)
    return peak


def keys_of(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The storages holding ``tensors`` on this process (a DTensor's by its local shard)."""
    return {storage_key(part) for t in tensors for part in strided_parts(t)}


def forward_backward(model: torch.nn.Module, args: tuple, kwargs: dict,
                     loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
                     watch: Optional[Callable[[str], Any]] = None) -> tuple[int, int]:
    """(bytes held after the forward, peak bytes through forward and backward), beside what is alive
    anyway (parameters, buffers, inputs); the outputs are not counted as held. CPU and meta: the
    tracker; CUDA: the caching allocator's counters.

    With ``loss_fn``, the step is a training loop's: the loss taken from the output (after the held
    figure), the output dropped, the loss backpropagated; without, every output tensor that requires
    grad is backpropagated with a gradient of ones. ``watch(phase)``: a context manager in force
    around the forward ("forward") and around the loss and backward ("backward"), inside the tracker
    (a mode that allocates nothing: the planner counts the step's FLOPs so)."""
    device = next((t.device for t in [*model.parameters(), *iter_tensors((args, kwargs))]), torch.device("cpu"))
    if device.type == "cuda":
        return _on_the_allocator(model, args, kwargs, loss_fn, device, watch or _unwatched)
    step = TrackedStep(model, args, kwargs, loss_fn, watch)
    with collecting_only_new():
        with step.forward():
            output = model(*args, **kwargs)
            wait_unwaited(iter_tensors(output))
        holder = step.forward_done(output)
        del output
        step.backward(holder)
    return step.figures()


class TrackedStep:
    """``forward_backward``'s step on CPU and meta in its phases, for a forward run by someone else (the
    planner's audit, ``auditing.audit_then_step``): the model's call within ``forward()``, then
    ``forward_done(output)`` (no op between), ``backward(holder)`` and ``figures()``. What runs between
    the phases outside them is not followed; it must hold no tensor of the step's into its backward."""

    def __init__(self, model: torch.nn.Module, args: tuple, kwargs: dict,
                 loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
                 watch: Optional[Callable[[str], Any]] = None) -> None:
        self.model, self.loss_fn, self.watch = model, loss_fn, watch or _unwatched
        self.lifetimes = Lifetimes(keys_of([*model.parameters(), *model.buffers(), *iter_tensors((args, kwargs))]))
        self.buckets: list[torch.Tensor] = []
        self.held: dict[int, int] = {}

    @contextlib.contextmanager
    def forward(self) -> Any:
        """In force around the model's call (on meta inside the emulation, whose KnownValues it rides)."""
        with self.lifetimes, buckets_seen() as buckets, self.watch("forward"):
            yield
        self.buckets += buckets

    def forward_done(self, output: Any) -> list:
        """Right after the forward returned ``output``: garbage cycles collected, what is held (not the
        outputs' storages nor those registered in the forward: FSDP2's kept gathered parameters) taken;
        returns the holder ``backward`` takes the output from (without ``loss_fn``, its tensors that
        require grad: the caller drops its own references)."""
        holder, outputs = _held_output(output, self.loss_fn)
        apart = keys_of([*outputs, *self.model.parameters(), *self.model.buffers()])
        self.held = {key: life.nbytes for key, life in self.lifetimes.live.items() if key not in apart}
        return holder

    def backward(self, holder: list, around: Any = None) -> None:
        """The loss and its backward (``_backpropagate``), inside ``around`` where given (the emulation
        again, on meta)."""
        with around if around is not None else contextlib.nullcontext(), self.lifetimes, \
                buckets_seen() as buckets, self.watch("backward"):
            _backpropagate(holder, self.loss_fn)
        self.buckets += buckets
        self.lifetimes.close()

    def figures(self) -> tuple[int, int]:
        """(held after the forward, peak through the step), as ``forward_backward`` returns them."""
        # DDP's gradient buckets (in a fake process group, those its hook was handed) are alive anyway, as
        # the parameters are: the tracker sees them when a gradient is copied in (or a rebuild allocates them)
        alive = keys_of(self.buckets)
        lives = [life for life in self.lifetimes.lives if life.died is not None or life.key not in alive]
        return (sum(n for key, n in self.held.items() if key not in alive),
                peak_of(lives, self.lifetimes.samples))


def _unwatched(phase: str) -> Any:
    return contextlib.nullcontext()


def _forward(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Optional[Callable]) -> tuple[list, list]:
    """The forward, and its output as ``_held_output`` holds it."""
    output = model(*args, **kwargs)
    wait_unwaited(iter_tensors(output))
    return _held_output(output, loss_fn)


def _held_output(output: Any, loss_fn: Optional[Callable]) -> tuple[list, list]:
    """The forward's output in a list of one (so that ``_backpropagate`` can take it out of every
    reference before backward: without ``loss_fn``, only its tensors that require grad) and its
    tensors: those that require grad, and with ``loss_fn`` every one (the output is kept for the loss;
    its tensors that need no grad are outputs too, not held). Garbage cycles are collected."""
    outputs = unique([t for t in iter_tensors(output) if t.requires_grad and t.grad_fn is not None])
    if loss_fn is None:
        output = list(outputs)
    else:
        outputs = unique([*outputs, *iter_tensors(output)])
    gc.collect()
    return [output], outputs


def _backpropagate(holder: list, loss_fn: Optional[Callable]) -> None:
    """Backward from the output ``holder`` holds, taken out of it first, as a training loop drops its
    output once it has the loss: from the loss ``loss_fn`` takes from it; without ``loss_fn``, from
    its tensors (those requiring grad) with gradients of ones."""
    if loss_fn is not None:
        tensors, gradients = [loss_fn(holder.pop())], None
        gc.collect()
    else:
        tensors = holder.pop()
        gradients = [torch.ones_like(t) for t in tensors]
    if tensors:
        torch.autograd.backward(tensors, gradients)


def _on_the_allocator(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Optional[Callable],
                      device: torch.device, watch: Callable[[str], Any]) -> tuple[int, int]:
    """``forward_backward`` on a CUDA device, by the caching allocator's counters."""
    before = keys_of([*model.parameters(), *model.buffers(), *iter_tensors((args, kwargs))])
    torch.cuda.synchronize(device)
    gc.collect()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with watch("forward"):
        output, outputs = _forward(model, args, kwargs, loss_fn)
    parts = {storage_key(part): part for t in [*outputs, *model.parameters(), *model.buffers()]
             for part in strided_parts(t)}
    held = torch.cuda.memory_allocated(device) - base - sum(
        part.untyped_storage().nbytes() for key, part in parts.items() if key not in before)
    del outputs, parts
    with watch("backward"):
        _backpropagate(output, loss_fn)
    torch.cuda.synchronize(device)
    return held, torch.cuda.max_memory_allocated(device) - base


def held_after_forward(model: torch.nn.Module, inputs: Any) -> int:
    """Bytes the autograd graph keeps alive after ``model(inputs)`` with its outputs dropped, beside
    what is alive anyway (parameters and buffers, those registered in the forward too; the inputs),
    each storage with its bytes after the forward; 0-dim tensors autograd saved that no op made
    (wrapped Python numbers) included. Garbage cycles made by the forward are collected."""
    args, kwargs = split_inputs(inputs)
    lifetimes = Lifetimes(keys_of([*model.parameters(), *model.buffers(), *iter_tensors((args, kwargs))]))
    with collecting_only_new():
        with lifetimes:
            output = model(*args, **kwargs)
            wait_unwaited(iter_tensors(output))
        roots = [t.sum().grad_fn if is_custom_function(t.grad_fn) else t.grad_fn
                 for t in iter_tensors(output) if t.grad_fn is not None]
        del output
        gc.collect()
    apart = keys_of([*model.parameters(), *model.buffers()])
    counted = {key for key in lifetimes.live if key not in apart}
    held = sum(lifetimes.live[key].nbytes for key in counted)
    # (a storage the forward made and freed may have left its address to a wrapped number since)
    seen = set(lifetimes.live) | lifetimes.exclude | apart
    for t in _zero_dim_saves(roots):
        for part in strided_parts(t):
            key = storage_key(part)
            if key not in seen:
                seen.add(key)
                held += part.untyped_storage().nbytes()
    lifetimes.close()
    return held


def _zero_dim_saves(roots: Sequence[Any]) -> Iterable[torch.Tensor]:
    """The 0-dim tensors the graph under ``roots`` saved, read from the packed slots (never unpacked:
    unpacking a checkpointed slot would recompute its block)."""
    packed = (raw.data for node in graph_nodes(roots) for _, raw in raw_saved_slots(node))
    return (t for value in packed for t in (value if isinstance(value, (tuple, list)) else (value,))
            if isinstance(t, torch.Tensor) and t.dim() == 0)
