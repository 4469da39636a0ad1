"""The independent measurement ``gradaudit.fit`` is checked against: a real training step on the CPU,
the way a training loop runs it, its peak taken by ``measure.PeakTracker`` (which shares nothing with
fitting/: it scans weak references after every op) plus what is alive throughout (parameters,
buffers, the batch, the optimizer's state), counted by storage.

The model trains for real here (a warm-up step, then the measured one), and its weights are put back
afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from typing import Any, Callable, Optional

import torch

from gradaudit.measure import PeakTracker
from gradaudit.tensors import iter_tensors, split_inputs, storage_key


def measured_step_peak(model: torch.nn.Module, inputs: Any, make_optimizer: Callable[[Any], torch.optim.Optimizer],
                       loss_fn: Callable[[Any], torch.Tensor], autocast: Optional[torch.dtype] = None) -> int:
    """The peak bytes alive through one steady-state step of ``model`` on ``inputs`` on the CPU."""
    args, kwargs = split_inputs(inputs)
    weights = copy.deepcopy(model.state_dict())
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])

    def forward() -> torch.Tensor:
        region = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with region:
            output = model(*args, **kwargs)
            loss = loss_fn(output)
        del output
        gc.collect()
        return loss

    loss = forward()  # warm-up: the optimizer's state exists afterwards
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del loss
    always = {}
    state = [t for values in optimizer.state.values() for t in iter_tensors(values)]
    for t in [*model.parameters(), *model.buffers(), *iter_tensors((args, kwargs)), *state]:
        always[storage_key(t)] = t.untyped_storage().nbytes()
    tracker = PeakTracker(set(always))
    with tracker:
        loss = forward()
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del loss
    model.load_state_dict(weights)
    return sum(always.values()) + tracker.peak
