"""An estimate of what PyTorch's CUDA caching allocator reserves for a step: its rules
(c10/cuda/CUDACachingAllocator.cpp, with the default settings) replayed over the step's allocations
and frees in order. Requests are rounded up to 512 bytes; those of at most 1 MiB come from a small
pool of 2 MiB segments, larger ones from a large pool whose segments are 20 MiB for requests under
10 MiB and the request rounded up to 2 MiB otherwise. A request takes the smallest cached free block
of its pool that holds it (splitting off the rest when more than 512 bytes stay in the small pool,
more than 1 MiB in the large one); a freed block merges with its free neighbours and stays reserved.

It is an estimate: the real allocator's history before the step (which segments earlier steps left),
other streams, ``max_split_size_mb``, ``expandable_segments`` and garbage-collection thresholds are
not modelled, and the order of frees and allocations within one op is taken as frees first.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Optional

BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to 1 MiB come from the small pool
SMALL_SEGMENT = 2 << 20  # kSmallBuffer
LARGE_SEGMENT = 20 << 20  # kLargeBuffer: for large requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests get a segment of their size rounded up to it


def rounded(nbytes: int) -> int:
    """A request as the allocator rounds it (0 stays 0: an empty storage asks for nothing)."""
    return -(-nbytes // BLOCK) * BLOCK if nbytes else 0


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True


class CachingAllocator:
    """The allocator's two pools, replayed: ``malloc`` returns a handle, ``free`` takes it back;
    ``reserved`` is the bytes of every segment made (they are never given back here)."""

    def __init__(self) -> None:
        self.reserved = 0
        # what torch.cuda.memory_allocated counts: the sizes of the blocks handed out, a block not
        # split (1 MiB or less would remain in the large pool, under 512 bytes in the small one)
        # whole; and the rounded requests beside it
        self.allocated = 0
        self.requested = 0
        self._requests: dict[tuple[int, int], int] = {}
        self._segments = 0
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # small? -> (size, seg, offset)
        self._starts: dict[tuple[int, int], _Block] = {}  # (segment, offset) -> block
        self._ends: dict[tuple[int, int], _Block] = {}  # (segment, offset + size) -> block
        self._small: dict[int, bool] = {}  # segment -> from the small pool

    def _add(self, block: _Block) -> None:
        self._starts[(block.segment, block.offset)] = block
        self._ends[(block.segment, block.offset + block.size)] = block
        if block.free:
            bisect.insort(self._free[self._small[block.segment]], (block.size, block.segment, block.offset))

    def _remove(self, block: _Block) -> None:
        del self._starts[(block.segment, block.offset)]
        del self._ends[(block.segment, block.offset + block.size)]
        if block.free:
            pool = self._free[self._small[block.segment]]
            del pool[bisect.bisect_left(pool, (block.size, block.segment, block.offset))]

    def malloc(self, nbytes: int) -> Optional[tuple[int, int]]:
        size = rounded(nbytes)
        if size == 0:
            return None
        small = size <= SMALL_SIZE
        pool = self._free[small]
        index = bisect.bisect_left(pool, (size, -1, -1))  # the smallest free block that holds it
        if index < len(pool):
            _, segment, offset = pool[index]
            block = self._starts[(segment, offset)]
            self._remove(block)
        else:
            block = _Block(self._segments, 0, segment_size(size))
            self._small[block.segment] = small
            self._segments += 1
            self.reserved += block.size
        remaining = block.size - size
        if (remaining >= BLOCK) if small else (remaining > SMALL_SIZE):
            self._add(_Block(block.segment, block.offset + size, remaining))
            block.size = size
        block.free = False
        self._add(block)
        self.allocated += block.size
        self.requested += size
        self._requests[(block.segment, block.offset)] = size
        return block.segment, block.offset

    def free(self, handle: Optional[tuple[int, int]]) -> None:
        if handle is None:
            return
        block = self._starts[handle]
        self._remove(block)
        self.allocated -= block.size
        self.requested -= self._requests.pop(handle)
        block.free = True
        after = self._starts.get((block.segment, block.offset + block.size))
        if after is not None and after.free:
            self._remove(after)
            block.size += after.size
        before = self._ends.get((block.segment, block.offset))
        if before is not None and before.free:
            self._remove(before)
            block = _Block(block.segment, before.offset, before.size + block.size)
        self._add(block)


def replay(persistent: Iterable[int], lives: Iterable[object], samples: int,
           repeats: int = 2) -> tuple[int, list[int]]:
    """The step's allocations replayed through the allocator: the persistent storages allocated first,
    in the order given (parameters one after another, as ``.to("cuda")`` or loading a checkpoint
    makes them), then ``repeats`` steps' allocations and frees in sample order (a sample's frees
    before its allocations). Returns the bytes reserved by the end (reserved never falls, so it is
    the peak), and for each sample 1..``samples`` of the last step the bytes the allocator hands out
    beyond the rounded requests alive then (blocks left unsplit), which ``memory_allocated`` counts."""
    allocator = CachingAllocator()
    for nbytes in persistent:
        allocator.malloc(nbytes)
    lives = list(lives)
    births: dict[int, list] = {}
    deaths: dict[int, list] = {}
    for life in lives:
        births.setdefault(life.born, []).append(life)
        if life.died is not None:
            deaths.setdefault(life.died, []).append(life)
    unsplit: list[int] = []
    for _ in range(repeats):
        handles: dict[int, Optional[tuple[int, int]]] = {}
        unsplit = []
        for sample in range(1, samples + 2):
            for life in deaths.get(sample, ()):
                allocator.free(handles.pop(id(life), None))
            for life in births.get(sample, ()):
                handles[id(life)] = allocator.malloc(life.nbytes)
            if sample <= samples:
                unsplit.append(allocator.allocated - allocator.requested)
        for handle in handles.values():  # what outlives the step (the loss) is gone before the next
            allocator.free(handle)
    return allocator.reserved, unsplit
