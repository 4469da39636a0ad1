"""Per rank: a model parallelised with FSDP2, tensor or sequence parallelism, audited on one CPU.

The user's factory runs inside a fake process group (PyTorch's ``fake`` backend: every collective
is a no-op with the shapes of a real one) as one rank of the world, builds its DeviceMesh there and
parallelises the model as their training code does; the audit, plan or fit then sees exactly the
tensors that rank would hold: DTensor saves by their local shards, FSDP2's gathered parameters
freed after the forward (resharded). One rank at a time, each on a freshly built model.

What is not modelled: communication buffers beyond the tensors the collectives return, NCCL's own
memory, and the overlap of communication with computation (a real run may hold a layer's gathered
parameters while the previous one computes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any, Callable, Generic, Iterator, Optional, Sequence, TypeVar

import torch

from .errors import GradauditError
from .torchapi.distributed import clear_dtensor_caches, fake_process_group
from .torchapi.fsdp import fsdp_on_meta

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class World:
    """The fake world a factory runs in: its size, this process's rank, and whether FSDP2 keeps
    its gathered parameters on the meta device."""

    size: int
    rank: int
    meta: bool = False


def check_world(world_size: Any, ranks: Optional[Sequence[int]] = None) -> tuple[int, list[int]]:
    """``world_size`` and ``ranks`` checked (ranks default: every rank), each an error saying what to give."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise GradauditError(f"world size must be a whole number >= 1, not {world_size!r}")
    if isinstance(ranks, int):
        ranks = [ranks]
    chosen = list(range(world_size)) if ranks is None or len(ranks) == 0 else list(ranks)
    for rank in chosen:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise GradauditError(f"rank {rank!r} is not a rank of a world of {world_size} (ranks are 0 to "
                                 f"{world_size - 1})")
    return world_size, sorted(set(chosen))


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0, *, device: Optional[str] = None) -> Iterator[World]:
    """Run the block as ``rank`` of a world of ``world_size`` processes, in this one process.

    Inside it ``torch.distributed`` is initialised with PyTorch's fake backend: a DeviceMesh can be
    built (``init_device_mesh("cpu", ...)``; on ``device="meta"`` a "cuda" mesh works too),
    ``fully_shard`` and ``parallelize_module`` run, and the model's forward and backward run with
    every collective a no-op of the right shapes. Build the model inside the block, and audit,
    plan or fit it there: collectives need the group.

    device: "meta" lets FSDP2 run on meta parameters (it refuses them otherwise, and gathers
    parameters on the mesh's device: here the meta device). Default: the model's own device.

    The group is destroyed when the block ends. A process group that is already initialised (a
    real distributed run) is refused rather than replaced.
    """
    check_world(world_size, [rank])
    if device not in (None, "cpu", "meta"):
        raise GradauditError(f"fake_world(device=...) must be 'cpu' or 'meta' (the audit runs on this machine), "
                             f"not {device!r}")
    if not torch.distributed.is_available():
        raise GradauditError(f"this torch ({torch.__version__}) is built without torch.distributed; "
                             f"per-rank audits need it")
    if torch.distributed.is_initialized():
        raise GradauditError("a torch.distributed process group is already initialised in this process; gradaudit's "
                             "fake world would replace it: audit per rank in a process of its own, not inside a "
                             "distributed run")
    world = World(world_size, rank, device == "meta")
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rankN]: ", and never unwraps it
    fake_process_group(world_size, rank, meta=world.meta)
    try:
        with fsdp_on_meta() if world.meta else contextlib.nullcontext():
            yield world
    finally:
        torch.distributed.destroy_process_group()
        clear_dtensor_caches()  # they hold this group's subgroups, which the next world lacks
        sys.excepthook = hook


@dataclasses.dataclass
class RankResults(Generic[T]):
    """What ``per_rank`` returned for each rank, and the ranks that came out alike."""

    world_size: int
    results: dict[int, T]
    groups: list[list[int]]  # ranks with equal results (``same``), in rank order; the first stands for them

    def __getitem__(self, rank: int) -> T:
        return self.results[rank]

    def distinct(self) -> list[tuple[list[int], T]]:
        """One (ranks, result) per group of alike ranks."""
        return [(ranks, self.results[ranks[0]]) for ranks in self.groups]


def per_rank(build: Callable[[], Any], world_size: int, run: Callable[[Any, Any], T], *,
             ranks: Optional[Sequence[int]] = None, device: Optional[str] = None,
             inputs: Any = None, same: Optional[Callable[[T], Any]] = None,
             progress: Optional[Callable[[str], None]] = None) -> RankResults[T]:
    """Build and run the model once per rank, each in its own fake world.

    build: called with no arguments inside ``fake_world(world_size, rank, device=device)``; it
        returns the parallelised model, or (model, inputs). It may ask which rank it is building
        through ``torch.distributed.get_rank()`` (as training code does).
    run: called as ``run(model, inputs)`` inside the same world: ``gradaudit.audit``,
        ``gradaudit.plan`` or ``gradaudit.fit`` with the options wanted, e.g.
        ``lambda model, x: gradaudit.audit(model, x)``.
    ranks: which ranks (default: every rank). inputs: used where ``build`` returns only the model.
    same: a key per result; ranks whose keys are equal form one group (default: each its own).
    """
    size, _ = check_world(world_size, ranks)

    def one(rank: int) -> T:
        if progress:
            progress(f"rank {rank} of {size}: building and running")
        built = build()
        model, batch = built if isinstance(built, tuple) and len(built) == 2 else (built, inputs)
        if batch is None:
            raise GradauditError("the factory returned no inputs: return (model, inputs), or pass inputs=")
        return run(model, batch)

    results = each_rank(world_size, one, ranks=ranks, device=device)
    return RankResults(size, results,
                       alike_ranks(list(results), None if same is None else lambda rank: same(results[rank])))


def each_rank(world_size: int, run: Callable[[int], T], *, ranks: Optional[Sequence[int]] = None,
              device: Optional[str] = None) -> dict[int, T]:
    """``run(rank)`` once per rank (default: every rank), each inside its own ``fake_world``, in rank
    order; what each returned, by rank."""
    size, chosen = check_world(world_size, ranks)
    results: dict[int, T] = {}
    for rank in chosen:
        with fake_world(size, rank, device=device):
            results[rank] = run(rank)
    return results


def alike_ranks(ranks: Sequence[int], key: Optional[Callable[[int], Any]]) -> list[list[int]]:
    """``ranks`` in groups whose ``key(rank)`` are equal, each in rank order, groups in the order of
    their first rank; with no key, each rank its own group."""
    if key is None:
        return [[rank] for rank in ranks]
    groups: dict[Any, list[int]] = {}
    for rank in ranks:
        groups.setdefault(key(rank), []).append(rank)
    return list(groups.values())


def rank_list(ranks: Sequence[int]) -> str:
    """"0-3, 5" for [0, 1, 2, 3, 5]."""
    parts, start = [], None
    ordered = sorted(ranks)
    for i, rank in enumerate(ordered):
        if start is None:
            start = rank
        if i + 1 == len(ordered) or ordered[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(parts)
