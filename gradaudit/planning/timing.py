"""Measured time as the checkpoint planner's cost (``plan(..., cost="time")``): each candidate
block's forward time and one whole step's, measured on the model's device.

Recomputing a checkpointed block in backward costs one more run of its forward, so a block's cost
is its forward time, summed over its calls (each call is one checkpoint region). Forward pre- and
post-hooks read the clock around each call; on CUDA (and other asynchronous devices) the device is
synchronized before each reading, so the clock sees the kernels finish, not only their launch.
Every figure is the median of ``REPEATS`` runs after one warm-up step (first calls pay for
allocation, kernel selection and caches); the step runs and the hooked forwards alternate, so a
machine that slows down part-way slows both. The solver works on integers: times are nanoseconds.

The caller runs this under the same context as the FLOP count (``conditions.as_audited``: the
what-if trainable patterns applied, the model's own checkpointing off, the model put back as
found afterwards: gradients, buffers, RNG state).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..errors import GradauditError
from ..records import Cost
from ..tensors import default_loss, iter_tensors, split_inputs

REPEATS = 5  # timed runs per figure (odd: the median is one of them)

# the clock, in nanoseconds; a module attribute so that tests can put a deterministic one in
clock: Callable[[], int] = time.perf_counter_ns


def check_cost(cost: Any, on_meta: bool) -> Cost:
    """``cost`` as a Cost (a name such as "time", or a Cost); an unknown cost is refused, and so is
    time on the meta device (which computes nothing to time)."""
    if cost not in tuple(Cost):
        raise GradauditError(f"cost must be one of {', '.join(repr(str(c)) for c in Cost)}, not {cost!r}")
    cost = Cost(cost)
    if cost == Cost.TIME and on_meta:
        raise GradauditError("cost='time' measures the forward on the model's device, and the meta device computes "
                             "nothing: build the model and inputs on a real device (cpu, cuda), or use cost='flops'")
    return cost


def _synchronizer(model: nn.Module, tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
    """Waits for every device the model and inputs are on (CPU work is done when it returns)."""
    devices = {t.device for t in [*model.parameters(), *model.buffers(), *tensors] if t.device.type != "cpu"}
    waits = []
    for device in devices:
        if device.type == "cuda":
            waits.append(lambda device=device: torch.cuda.synchronize(device))
        else:  # mps, xpu, ...: their module's synchronize(), where there is one
            wait = getattr(getattr(torch, device.type, None), "synchronize", None)
            if wait is not None:
                waits.append(wait)

    def synchronize() -> None:
        for wait in waits:
            wait()

    return synchronize


def _median(values: list[int]) -> int:
    return sorted(values)[len(values) // 2]


def measure(model: nn.Module, inputs: Any, paths: Sequence[str], repeats: int = REPEATS,
            loss: Optional[Callable[[Any], torch.Tensor]] = None) -> tuple[dict[str, int], int]:
    """(forward nanoseconds of each module in ``paths``, all its calls in one forward; nanoseconds
    of one whole step as a training loop runs it: the forward, ``loss`` of its output (or the
    default loss) and its backward), each the median of ``repeats`` runs after a warm-up step.
    Gradients are cleared before each step (as ``zero_grad`` does), so every step allocates them as a
    training step would; the caller puts the model's own back."""
    args, kwargs = split_inputs(inputs)
    tensors = list(iter_tensors(inputs))
    leaves = [t for t in tensors if t.is_leaf and t.requires_grad]
    parameters = list(model.parameters())
    synchronize = _synchronizer(model, tensors)
    modules = dict(model.named_modules())

    def step() -> None:
        for t in [*parameters, *leaves]:
            t.grad = None
        value = (loss or default_loss)(model(*args, **kwargs))
        if value.requires_grad:
            value.backward()

    # per block: the start of each call in progress (a stack: a module may call itself) and the
    # nanoseconds of the forward being timed
    started: dict[str, list[int]] = {path: [] for path in paths}
    spent = dict.fromkeys(paths, 0)

    def hooks(path: str) -> tuple[Callable[..., None], Callable[..., None]]:
        def pre(module: nn.Module, args: Any) -> None:
            synchronize()
            started[path].append(clock())

        def post(module: nn.Module, args: Any, output: Any) -> None:
            synchronize()
            spent[path] += clock() - started[path].pop()

        return pre, post

    step()  # warm-up
    steps: list[int] = []
    forwards: dict[str, list[int]] = {path: [] for path in paths}
    for _ in range(repeats):
        synchronize()
        start = clock()
        step()
        synchronize()
        steps.append(clock() - start)
        handles = []
        try:
            for path in paths:
                pre, post = hooks(path)
                handles.append(modules[path].register_forward_pre_hook(pre))
                handles.append(modules[path].register_forward_hook(post))
            spent.update(dict.fromkeys(paths, 0))
            output = model(*args, **kwargs)  # with grad enabled, as the step's forward (and a recomputation) runs
            del output
        finally:
            for handle in handles:
                handle.remove()
        for path in paths:
            forwards[path].append(spent[path])
    return {path: _median(forwards[path]) for path in paths}, _median(steps)
