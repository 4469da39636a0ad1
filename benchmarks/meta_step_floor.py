"""What a meta step of the 80-layer probe costs without gradaudit, and what gradaudit's plan spends per
run of the layers (issue 42): the floor below which no instrumentation can bring a plan that runs them
8 times.

Measured in one process, one thread, CPU seconds, the fastest of ``--rounds`` (the model built first):
- a forward and backward on meta with nothing of gradaudit's (torch's own Python meta kernels), and
  how many aten ops it dispatches;
- the same with only gradaudit's kernel cache beneath it (``kernel_cache.call`` in one dispatch mode);
- that with one and with three dispatch modes above it that do nothing (what a layer of modes costs);
- ``gradaudit.plan(..., budget="4GiB")``, timed phase by phase from its progress messages (each audit
  and each measured step).

    python benchmarks/meta_step_floor.py
    python benchmarks/meta_step_floor.py --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent


class _Cached(TorchDispatchMode):
    """Every op through gradaudit's kernel cache, nothing else."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        from gradaudit import kernel_cache

        return kernel_cache.call(func, args, kwargs or {})


class _Nothing(TorchDispatchMode):
    """A dispatch mode that only passes each op on (and counts them)."""

    ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        _Nothing.ops += 1
        return func(*args, **(kwargs or {}))


def _step_seconds(model: Any, batch: dict, modes: list[Callable[[], Any]], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds + 1):  # the first round warms the kernel cache
        start = time.process_time()
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode())
            model(**batch).loss.backward()
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="timed steps per variant (the fastest counts)")
    options = parser.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "examples"))
    import llama_probe
    from transformers import masking_utils

    import gradaudit

    model, inputs = llama_probe.build()
    steps = {"no gradaudit": [], "kernel cache only": [_Cached], "cache + 1 mode doing nothing": [_Cached, _Nothing],
             "cache + 3 modes doing nothing": [_Cached, _Nothing, _Nothing, _Nothing]}
    batch = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    tracing = masking_utils.is_tracing
    masking_utils.is_tracing = lambda *args, **kwargs: True  # meta batch: Hugging Face's mask checks read no values
    try:
        for name, modes in steps.items():
            print(f"{name:32s} {_step_seconds(model, batch, modes, options.rounds):6.3f} s a step", flush=True)
        _Nothing.ops = 0
        _step_seconds(model, batch, [_Nothing], 0)
        print(f"aten ops a step: {_Nothing.ops:,}")
    finally:
        masking_utils.is_tracing = tracing
    marks: list[tuple[float, str]] = []
    start = time.process_time()
    gradaudit.plan(model, inputs, budget="4GiB", progress=lambda what: marks.append((time.process_time(), what)))
    marks.append((time.process_time(), "done"))
    print(f"gradaudit.plan(budget='4GiB'): {marks[-1][0] - start:.2f} s")
    for (at, what), (then, _) in zip(marks, marks[1:]):
        print(f"  {then - at:6.2f} s  {what}")


if __name__ == "__main__":
    main()
