"""When each storage of a training step is made and freed: ``Lifetimes`` notes every storage an op
produces while it is active, with the op after which it exists and the op by which it is gone (a weak
reference's callback says so the moment the storage is freed: nothing is scanned per op). The bytes
alive after any op, by category, follow from those intervals (``sweep``).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..measure import op_leaves
from ..tensors import strided_parts
from .workspaces import GemmCount, is_convolution, is_gemm, uses_cublaslt
from ..torchapi.dispatch import TorchDispatchMode, overload_packet
from ..torchapi.fsdp import fsdp_storage_events
from ..torchapi.storages import storage_id


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
    category: str = ""
    op: str = ""
    module: str = ""
    source: Optional[str] = None


class Lifetimes(TorchDispatchMode):
    """Every storage an op produces while active, on a device ``counts`` accepts, and not in
    ``exclude`` (what is alive anyway: parameters, buffers, inputs, optimizer state). After op n
    completes, sample n is taken: a storage made by op n is alive in it; one freed before op n+1
    completes is not alive in sample n+1."""

    def __init__(self, exclude: Iterable[int], counts: Callable[[torch.device], bool],
                 where: Optional[Callable[[], tuple[str, Optional[str]]]] = None) -> None:
        """``where()``: (the module running, the user's source line) when an op makes a storage."""
        super().__init__()
        self.exclude = set(exclude)
        self.counts = counts
        self.where = where
        self._op = ""
        self.samples = 0
        self.live: dict[int, Life] = {}
        self.lives: list[Life] = []
        self._references: dict[int, Any] = {}
        self.gemms = GemmCount()  # the matrix products run (on CUDA they hold cuBLAS's workspaces)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.samples += 1
        packet = overload_packet(func)
        if is_gemm(packet):
            self.gemms.cublas += 1
            self.gemms.cublaslt += uses_cublaslt(packet, args)
        elif is_convolution(packet):
            self.gemms.convolutions += 1
        self._op = str(packet).removeprefix("aten.")
        for t in op_leaves(out):
            if isinstance(t, torch.Tensor):
                for part in strided_parts(t):
                    self._note(part.untyped_storage())
        return out

    def __enter__(self) -> "Lifetimes":
        # FSDP2 gives its gathered parameters' storages their bytes and takes them back in place
        self._resizes = fsdp_storage_events(self._resized)
        self._resizes.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
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


def sweep(lives: Sequence[Life], samples: int, categories: Sequence[str],
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
