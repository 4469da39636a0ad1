"""An independent measurement of what autograd holds, for tests and benchmarks.

It shares nothing with the recorder: a TorchDispatchMode weak-references every storage that any op
produces during a plain forward (no saved-tensor hooks). After the forward, with the caller's
references to the outputs dropped, the storages still alive are held by the autograd graph.

One thing no op produces: a Python number passed where an op takes a tensor (``0.5 * x``) becomes a
0-dim "wrapped number" tensor before dispatch, and autograd may save it (8 bytes each). Those are
found by reading the graph's saved attributes plainly (no saved-tensor hooks are installed here).

Parallelised models (one rank's view, in a real process group or a fake one):

- DTensor (tensor/sequence parallelism, FSDP2's sharded parameters): a dispatch mode sees the
  DTensor-level op; the ops on local shards that DTensor runs inside it happen with the mode popped.
  An output DTensor is therefore unwrapped to its local shard, whose storage is what this rank
  holds (the wrapper's own storage is a stand-in of the global size and owns no memory). Parameters,
  buffers and inputs that are DTensors are excluded by their local shards' storages.
- Storages that change size after they were made: FSDP2 gathers each module's parameters into
  buffers it allocates with ``empty`` (an op, seen here) the first time and with
  ``untyped_storage().resize_(n)`` later (not an op), and frees them after the module's forward
  (``resize_(0)``) when it reshards. Every figure reads a storage's bytes as they are when it is
  measured, never as they were when first seen: a gathered parameter saved for backward and freed
  after the forward holds 0 bytes; the peak follows the buffers shrinking and growing back.
- FSDP2's root module does not reshard after the forward by default (``reshard_after_forward=None``:
  True for the others, False for the root), and a module can be told not to: then its gathered
  parameters stay allocated, and FSDP2 registers them on the module in place of the sharded ones.
  They are parameters, alive anyway: the parameters and buffers registered after the forward are
  excluded too, beside those registered before it (what gradaudit counts for such a save: nothing
  held, it is a registered parameter's storage). So a gathered buffer, after the forward, is either
  empty (resharded) or a registered parameter's storage (kept): neither adds to the held figures,
  whether or not the tracker saw it. It does see it, in torch 2.14 on every iteration, also where
  ``resize_`` regrew it outside any op (a second step on the same model): FSDP2 views each buffer
  (``aten.view``) as it copies the gathered shards out, an op whose output is that storage.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from typing import Any, Callable, Iterable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .tensors import iter_tensors, split_inputs, strided_parts, unique
from .torchapi.autograd import is_custom_function, raw_saved_slots
from .torchapi.dispatch import TorchDispatchMode, is_traceable_wrapper_subclass, tree_flatten
from .torchapi.storages import storage_at, storage_id

_PLAIN = (torch.Tensor, torch.nn.Parameter)



def local_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain strided tensors holding what this process holds of ``t``: itself, a sparse tensor's
    index and value tensors, or, for a wrapper tensor subclass (a DTensor, whose inner tensor is its
    local shard; the AsyncCollectiveTensor a functional collective returns), its inner tensors'
    parts: a wrapper's own storage is a stand-in of its shape and owns no memory."""
    if type(t) not in _PLAIN and is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]
        return [part for x in inner if isinstance(x, torch.Tensor) for part in local_parts(x)]
    return strided_parts(t)


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The storages (by address, as StorageWeakRef's ``cdata``) holding ``tensors`` on this process."""
    return {storage_id(part.untyped_storage()) for t in tensors for part in local_parts(t)}


def current_nbytes(cdata: int) -> Optional[int]:
    """The bytes of the storage at ``cdata`` now, None once it was freed (a StorageWeakRef to it
    must be held)."""
    storage = storage_at(cdata)
    return None if storage is None else storage.nbytes()


def alive_anyway(model: torch.nn.Module, inputs: Any = ()) -> set[int]:
    """The storages of the model's parameters and buffers and of the inputs' tensors."""
    return storage_keys([*model.parameters(), *model.buffers(), *iter_tensors(inputs)])


class StorageTracker(TorchDispatchMode):
    """Weak-references every storage produced by an op while active (a DTensor's by its local shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        storages = self.storages
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for part in local_parts(t):
                    storage = part.untyped_storage()
                    key = storage_id(storage)  # a StorageWeakRef's cdata: made only for a new storage
                    if key not in storages:
                        storages[key] = StorageWeakRef(storage)
        return out

    def live_bytes(self, exclude: set[int]) -> int:
        """The bytes, as they are now, of the storages seen that are still alive, but ``exclude``."""
        total = 0
        for cdata in self.storages:
            if cdata not in exclude:
                total += current_nbytes(cdata) or 0
        return total


def held_bytes_after_forward(model: torch.nn.Module, inputs: Any, *, young_only: bool = False) -> int:
    """Bytes the autograd graph keeps alive after ``model(inputs)``, measured without gradaudit.

    Parameters, buffers (those registered before the forward and those registered after it: FSDP2's
    gathered parameters where a module does not reshard) and the inputs are excluded (alive anyway).
    The outputs themselves are dropped first, so an output storage counts only if a backward node
    saved it. Each storage counts with its bytes after the forward (0 for a gathered parameter
    FSDP2 freed); a DTensor counts by its local shard.

    The outputs may sit in reference cycles, so a garbage collection runs after they are dropped.
    ``young_only``: it looks only at the objects made since the forward began (``gc.freeze()``
    sets the older ones aside), not at every object of the process: a full collection costs tens
    of milliseconds once a library like transformers is imported, more than a small forward. It
    misses only a garbage cycle that runs through an object older than the forward (one the
    forward made unreachable). Unused while the process has frozen objects of its own.
    """
    args, kwargs = split_inputs(inputs)
    exclude = alive_anyway(model, (args, kwargs))
    tracker = StorageTracker()
    freeze = young_only and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        with tracker:
            output = model(*args, **kwargs)
        wait_collectives(output)
        roots = graph_roots(output)
        del output
        gc.collect()
    finally:
        if freeze:
            gc.unfreeze()
    exclude |= alive_anyway(model)
    held = tracker.live_bytes(exclude)
    seen = set(tracker.storages) | exclude
    for t in _saved_scalars(roots):
        for part in local_parts(t):
            storage = part.untyped_storage()
            if storage_id(storage) not in seen:
                seen.add(storage_id(storage))
                held += storage.nbytes()
    del roots
    return held


def graph_roots(output: Any) -> list[Any]:
    """The autograd nodes that keep ``output``'s graph alive once ``output`` is dropped. A custom
    Function's node is reached from Python through its ctx object, which torch 2.11 holds weakly
    (once the output is gone its graph is freed and ``next_functions`` raises): such an output is
    summed, and the sum's node, a C++ node held strongly and saving nothing of its input, stands for
    it. Call it outside any tracking (the sum is a new 0-dim tensor)."""
    roots = []
    for t in iter_tensors(output):
        if t.grad_fn is None:
            continue
        roots.append(t.sum().grad_fn if is_custom_function(t.grad_fn) else t.grad_fn)
    return roots


def wait_collectives(output: Any) -> None:
    """Wait for the collectives whose results the output holds unwaited (a functional collective's
    AsyncCollectiveTensor: a rowwise-parallel layer's output). Until waited, the process group's
    registry of work in flight keeps such a result alive: a dropped output would stay alive with
    no autograd node holding it. Using the output (the loss from it) waits; so does this."""
    for t in iter_tensors(output):
        trigger = getattr(type(t), "trigger_wait", None)
        if trigger is not None:
            trigger(t)


def _saved_scalars(roots: list[Any]) -> Any:
    """0-dim tensors saved by the graph under ``roots`` (wrapped Python numbers among them)."""
    stack, visited = list(roots), set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        stack.extend(fn for fn, _ in node.next_functions)
        # the packed objects, never the unpacked values: unpacking a checkpointed slot would
        # recompute its block; a slot packed by anybody's hooks holds no plain tensor here
        for _, raw in raw_saved_slots(node):
            value = raw.data
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.dim() == 0:
                    yield t


class PeakTracker(StorageTracker):
    """StorageTracker that also follows the bytes alive after every op, and their maximum.

    After every op it reads the bytes of every storage it follows as they are then: a storage
    freed leaves, one resized outside any op (FSDP2's gathered parameters, freed by ``resize_(0)``
    after a module's forward and grown back before its backward) counts at its new size.

    ``exclude``: storages alive anyway (parameters, buffers, the caller's inputs), not counted
    when a view of them (a detach when autograd unpacks a saved parameter) passes by.
    """

    def __init__(self, exclude: set[int] = frozenset()) -> None:
        super().__init__()
        self.exclude = exclude
        self.live: dict[int, StorageWeakRef] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.peak = max(self.peak, self._read())
        return out

    def _read(self) -> int:
        """Take the storages the last ops made into the live table and sum its bytes as they are now."""
        live, total, freed = self.live, 0, []
        for cdata, ref in self.storages.items():
            if cdata not in self.exclude and cdata not in live:
                live[cdata] = ref
        self.storages = {}  # the live table takes over; keep the per-op scan short
        for cdata in live:
            nbytes = current_nbytes(cdata)
            if nbytes is None:
                freed.append(cdata)
            else:
                total += nbytes
        for cdata in freed:
            del live[cdata]
        self.current = total
        return total

    def settle(self, exclude: Iterable[int] = ()) -> int:
        """The bytes alive now, but those of the storages ``exclude`` names."""
        current = self._read()
        return current - sum(current_nbytes(cdata) or 0 for cdata in set(exclude) if cdata in self.live)


def forward_backward(model: torch.nn.Module, args: tuple, kwargs: dict,
                     loss_fn: Optional[Callable[[Any], torch.Tensor]] = None) -> tuple[int, int]:
    """(bytes held after the forward, peak bytes through forward and backward), outputs excluded
    from the held figure. CPU: a PeakTracker; CUDA: the caching allocator's counters.

    Held as ``held_bytes_after_forward`` counts it (parameters registered after the forward
    excluded: FSDP2's root keeps its gathered parameters); the peak counts every storage the step
    makes, FSDP2's gathered parameters while they are allocated among them. With ``loss_fn``, the step
    is a training loop's: the loss taken from the output (after the held figure), the output dropped,
    the loss backpropagated; without, every output tensor that requires grad is backpropagated with a
    gradient of ones (a ModelOutput's loss and logits alike)."""
    device = next((t.device for t in [*model.parameters(), *iter_tensors((args, kwargs))]), torch.device("cpu"))
    cuda = device.type == "cuda"
    tracker = None
    before = alive_anyway(model, (args, kwargs))
    if cuda:
        torch.cuda.synchronize(device)
        gc.collect()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        tracker = PeakTracker(before)
        tracker.__enter__()
    try:
        output = model(*args, **kwargs)
        wait_collectives(output)
        outputs = unique([t for t in iter_tensors(output) if t.requires_grad and t.grad_fn is not None])
        if loss_fn is None:
            del output
        else:  # kept for the loss; its tensors that need no grad are outputs too, not held
            outputs = unique([*outputs, *iter_tensors(output)])
        gc.collect()
        # not held: the outputs' storages and those registered in the forward (FSDP2's kept gathered parameters)
        registered = [*model.parameters(), *model.buffers()]
        if cuda:
            parts = {storage_id(part.untyped_storage()): part for t in [*outputs, *registered] for part in local_parts(t)}
            held = torch.cuda.memory_allocated(device) - base - sum(
                part.untyped_storage().nbytes() for key, part in parts.items() if key not in before)
        else:
            held = tracker.settle(storage_keys(outputs) | storage_keys(registered))
        del registered
        if loss_fn is not None:
            loss = loss_fn(output)
            del output, outputs
            gc.collect()
            loss.backward()
            del loss
        elif outputs:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        outputs = None
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = tracker.peak
    return held, peak


def data_parallel_modules(model: torch.nn.Module) -> list[Any]:
    """The DistributedDataParallel modules in ``model`` (itself included)."""
    return [m for m in model.modules() if isinstance(m, torch.nn.parallel.DistributedDataParallel)]


def record_buckets(model: torch.nn.Module) -> None:
    """Give every DistributedDataParallel in ``model`` a communication hook that records the buckets it
    is handed (``ddp._measured_buckets``, by bucket index), for ``measured_step_peak``: in a real process
    group it then all-reduces them as DDP's default does (PyTorch's ``allreduce_hook``: the bucket
    divided by the world's size in place, then summed); in PyTorch's fake one, whose all-reduce returns
    nothing, it returns the bucket as it is."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    fake = dist.get_backend() == "fake"
    for ddp in data_parallel_modules(model):
        recorded: dict[int, torch.Tensor] = {}

        def hook(state, bucket, recorded=recorded):  # (DDP checks annotations: none)
            recorded[bucket.index()] = bucket.buffer()
            if not fake:
                return allreduce_hook(state, bucket)
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        ddp._measured_buckets = recorded
        ddp.register_comm_hook(None, hook)


def measured_step_peak(model: torch.nn.Module, inputs: Any, make_optimizer: Callable[[Any], torch.optim.Optimizer],
                       loss_fn: Callable[[Any], torch.Tensor], autocast: Optional[torch.dtype] = None,
                       accumulation: int = 1) -> int:
    """The peak bytes alive through one steady-state training step of ``model`` on ``inputs`` on the CPU,
    measured as a training loop runs it: a warm-up step (the optimizer's state exists afterwards),
    then forward, loss, backward and the optimizer step under a PeakTracker, plus what is alive
    throughout (parameters, buffers, the batch, the optimizer's state), counted by storage. With
    ``accumulation`` > 1 each step runs that many forwards and backwards of ``inputs`` (the loss
    divided by it) before the optimizer's. It shares nothing with gradaudit.fit's own following of the
    step (fitting/). The model trains for real; its weights (and buffers) are put back afterwards.

    A model with DistributedDataParallel needs ``record_buckets(model)`` first: its warm-up is two steps
    (DDP rebuilds its buckets in the second's forward), its buckets are alive throughout (those the
    hook recorded in the second), and the micro-batches but the last run under ``no_sync``."""
    args, kwargs = split_inputs(inputs)
    weights = copy.deepcopy(model.state_dict())
    # the parameters that train; where none does, the inputs that require grad (an adversarial loop)
    inputs_optimized = [t for t in iter_tensors((args, kwargs)) if t.is_leaf and t.requires_grad]
    optimized = [p for p in model.parameters() if p.requires_grad] or inputs_optimized
    originals = [t.detach().clone() for t in inputs_optimized]
    optimizer = make_optimizer(optimized)

    def forward() -> torch.Tensor:
        region = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with region:
            output = model(*args, **kwargs)
            loss = loss_fn(output)
            if accumulation > 1:
                loss = loss / accumulation
        del output
        gc.collect()
        return loss

    def micro_batches() -> torch.Tensor:
        """The micro-batches' forwards and backwards; the last loss (alive through the optimizer's step,
        as a training loop's). With DDP, a training loop accumulates all but the last under no_sync."""
        loss = None
        for k in range(accumulation):
            with contextlib.ExitStack() as stack:
                if k < accumulation - 1:
                    for ddp in data_parallel_modules(model):
                        stack.enter_context(ddp.no_sync())
                loss = forward()  # (the previous loss alive through this forward, as a loop's)
                loss.backward()
        return loss

    # warm-up: the optimizer's state exists afterwards; with DDP two steps (its buckets are rebuilt in
    # the second's forward, after which they stay as they are) and the buckets of the second recorded
    buckets = [getattr(ddp, "_measured_buckets", None) for ddp in data_parallel_modules(model)]
    for warm_up in range(2 if buckets else 1):
        for recorded in buckets:
            if recorded is None:
                raise ValueError("a DistributedDataParallel model: call measure.record_buckets(model) after building it")
            recorded.clear()
        loss = micro_batches()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
    always = {}
    state = [t for values in optimizer.state.values() for t in iter_tensors(values)]
    alive = [*model.parameters(), *model.buffers(), *iter_tensors((args, kwargs)), *state,
             *(bucket for recorded in buckets for bucket in recorded.values())]
    for t in alive:
        for part in local_parts(t):
            always[storage_id(part.untyped_storage())] = part.untyped_storage().nbytes()
    del alive
    tracker = PeakTracker(set(always))
    with tracker:
        loss = micro_batches()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del loss
    model.load_state_dict(weights)
    with torch.no_grad():
        for t, original in zip(inputs_optimized, originals):
            t.copy_(original)
            t.grad = None
    return sum(always.values()) + tracker.peak


def measured_schedule_step_peak(schedule: Any, inputs: Any,
                                make_optimizer: Callable[[Any], torch.optim.Optimizer]) -> int:
    """The peak bytes alive on this rank through one steady-state training step of a
    ``torch.distributed.pipelining`` schedule: ``schedule.step(*args, **kwargs)`` on ``inputs`` (what this
    rank's step takes), its output dropped, then the optimizer's step over the stage modules' parameters
    and ``zero_grad(set_to_none=True)``. Two warm-up steps (the first allocates the stage's receive
    buffers; the optimizer's state exists after it), then the step under a PeakTracker, plus what is
    alive throughout: parameters, buffers, the inputs, the optimizer's state and the stage's receive
    buffers (read from the stage: one per micro-batch for the activations it is sent and for the
    gradients sent back). It shares nothing with gradaudit.fit's following of the step. The modules train
    for real; their weights are put back afterwards."""
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    modules = [stage.submod for stage in stages]
    weights = [copy.deepcopy(m.state_dict()) for m in modules]
    args, kwargs = split_inputs(inputs)
    optimizer = make_optimizer([p for m in modules for p in m.parameters() if p.requires_grad])

    def step() -> None:
        output = schedule.step(*args, **kwargs)
        del output

    for _ in range(2):
        step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = [t for values in optimizer.state.values() for t in iter_tensors(values)]
    # a rank running adjacent stages (V-shaped schedules) passes their outputs and gradients in place of a
    # receive: those buffers are the last step's tensors, freed when this step replaces them
    here = {stage.stage_index for stage in stages}
    infos = [info for stage in stages for per in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
             for info in (per if isinstance(per, (tuple, list)) else (per,))
             if isinstance(getattr(info, "buffer", None), torch.Tensor)]
    buffers = [info.buffer for info in infos if getattr(info, "source", None) not in here]
    passed = [info.buffer for info in infos if getattr(info, "source", None) in here]
    always = {}
    for t in [*(p for m in modules for p in m.parameters()), *(b for m in modules for b in m.buffers()),
              *iter_tensors((args, kwargs)), *state, *buffers]:
        for part in local_parts(t):
            always[storage_id(part.untyped_storage())] = part.untyped_storage().nbytes()
    tracker = PeakTracker(set(always))
    # followed from the start, until freed (a comprehension: a loop's variable would keep the last alive)
    tracker.live.update({storage_id(t.untyped_storage()): StorageWeakRef(t.untyped_storage()) for t in passed})
    del buffers, passed, infos
    with tracker:
        step()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for module, saved in zip(modules, weights):
        module.load_state_dict(saved)
    return sum(always.values()) + tracker.peak
