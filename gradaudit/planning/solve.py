"""The checkpoint planner's cost model and solver: plain data and arithmetic, no torch.

A chain of blocks (the modules a plan may checkpoint, in the order the forward runs them). Each
block either keeps what its ops save (``internal``: storage ids) or, checkpointed, keeps only the
tensors it was passed (``inputs``) and recomputes its forward in backward (``flops``). Everything
outside the blocks keeps what it saves (``outside``). Bytes are counted once per storage, so what a
plan holds is the size of a union::

    held(S) = bytes(outside | U_{b not in S} internal(b) | U_{b in S} inputs(b))

Under ``gradaudit.trim`` a save trim drops holds nothing (it is in no set), and a save trim
bit-packs holds a packed copy of its view (``Block.packed``, ``Chain.outside_packed``: ids into
``Chain.bits``) instead of its storage. A copy costs its bytes only while no save the plan keeps
holds its storage whole (trim gives a bit-packed save its tensor back when another save keeps the
storage), and a storage's copies cost at most the storage (``Accountant.freed_by_storage``'s rule:
trim frees a storage only when the copies are smaller). Without trim both are empty.

``Chain.held`` computes it exactly for any set of blocks. ``solve`` finds, for every budget at
once, the plans with the least recompute: a dynamic program over the chain whose state is whether
the previous block is checkpointed and whether any block so far is. It charges every storage
exactly when the blocks that can hold it are one block, two neighbours, or (held only as an
input) all of them; any other storage is charged as always held whole (``Chain.assumed``), which
can only overstate a plan's bytes, never understate them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

# a frontier larger than this per state is thinned (the plan is then no longer proven optimal)
FRONTIER_LIMIT = 50_000


@dataclass(frozen=True)
class Block:
    """One module a plan may checkpoint."""

    path: str
    module_class: str
    calls: int  # how many times the forward ran it (each call is one checkpoint region)
    flops: int  # forward FLOPs of all its calls: what checkpointing it recomputes per step
    internal: frozenset[int]  # storages its ops' saves hold whole (held kinds only)
    inputs: frozenset[int]  # storages of the tensors passed to it (held kinds only)
    packed: frozenset[int] = frozenset()  # under trim: the bit-packed copies its ops' saves hold (Chain.bits)


@dataclass(frozen=True)
class Point:
    """One plan on the memory/compute frontier."""

    held_bytes: int  # exact (Chain.held)
    extra_flops: int
    chosen: frozenset[int]  # indices into Chain.blocks


@dataclass
class Chain:
    blocks: list[Block]
    nbytes: dict[int, int]  # storage id -> bytes, for every storage of a held kind
    outside: frozenset[int]  # storages held whole by saves outside every block
    assumed: dict[int, int] = field(default_factory=dict)  # storages the solver charges as always held
    # under trim: bit-packed copy id -> (its storage, its bytes); one per distinct bit-packed view
    bits: dict[int, tuple[int, int]] = field(default_factory=dict)
    outside_packed: frozenset[int] = frozenset()  # copies held by saves outside every block

    def held(self, chosen: Iterable[int]) -> int:
        """Exact bytes held after the forward with the blocks ``chosen`` checkpointed."""
        chosen = set(chosen)
        kept = set(self.outside)
        copies = set(self.outside_packed)
        for i, block in enumerate(self.blocks):
            if i in chosen:
                kept |= block.inputs
            else:
                kept |= block.internal
                copies |= block.packed
        return self.bytes_of(kept, copies)

    def bytes_of(self, whole: Iterable[int], copies: Iterable[int] = ()) -> int:
        """Bytes of the storages ``whole`` plus the bit-packed ``copies`` of the other storages
        (a storage's copies together cost at most the storage)."""
        whole = set(whole)
        packed: dict[int, int] = {}
        for copy in copies:
            storage, size = self.bits[copy]
            if storage not in whole:
                packed[storage] = packed.get(storage, 0) + size
        return sum(self.nbytes[s] for s in whole) + sum(min(size, self.nbytes[s]) for s, size in packed.items())

    def extra_flops(self, chosen: Iterable[int]) -> int:
        return sum(self.blocks[i].flops for i in set(chosen))


def _pareto(points: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(flops, bytes, mask) points, none beaten on both: cheapest first, bytes strictly falling."""
    best: list[tuple[int, int, int]] = []
    for flops, nbytes, mask in sorted(points, key=lambda p: (p[0], p[1], p[2])):
        if not best or nbytes < best[-1][1]:
            best.append((flops, nbytes, mask))
    if len(best) > FRONTIER_LIMIT:
        step = len(best) / FRONTIER_LIMIT
        best = [best[int(k * step)] for k in range(FRONTIER_LIMIT)] + [best[-1]]
    return best


def solve(chain: Chain) -> tuple[list[Point], bool]:
    """The memory/compute frontier of ``chain``: every plan no other plan beats on both held bytes
    and recompute, cheapest first. Returns (points, exact): ``exact`` is False when some storage
    had to be charged as always held or the frontier was thinned (then a point's bytes are still
    exact, but a cheaper plan under the same budget may exist)."""
    n = len(chain.blocks)
    local = [[0, 0] for _ in range(n)]  # local[i][x]: bytes only block i decides, x = checkpointed?
    pair = [[[0, 0], [0, 0]] for _ in range(n)]  # pair[i][x][y]: decided by blocks i and i+1
    any_chosen = 0  # bytes held exactly when at least one block is checkpointed
    constant = sum(chain.nbytes[s] for s in chain.outside)
    chain.assumed = {}
    # per storage: the blocks holding it whole when kept, the blocks holding copies of it when
    # kept (copy ids per block), the blocks holding it when checkpointed, and copies held outside
    whole: dict[int, set[int]] = {}
    copies: dict[int, dict[int, set[int]]] = {}
    passed: dict[int, set[int]] = {}
    outside_copies: dict[int, set[int]] = {}
    for i, block in enumerate(chain.blocks):
        for s in block.internal:
            whole.setdefault(s, set()).add(i)
        for c in block.packed:
            copies.setdefault(chain.bits[c][0], {}).setdefault(i, set()).add(c)
        for s in block.inputs:
            passed.setdefault(s, set()).add(i)
    for c in chain.outside_packed:
        outside_copies.setdefault(chain.bits[c][0], set()).add(c)

    def cost(s: int, x: dict[int, int]) -> int:
        """Bytes storage ``s`` costs when each block it touches is checkpointed (x = 1) or not."""
        if any(x[i] == 0 for i in whole.get(s, ())) or any(x[i] == 1 for i in passed.get(s, ())):
            return chain.nbytes[s]
        held = set(outside_copies.get(s, ()))
        for i, ids in copies.get(s, {}).items():
            if x[i] == 0:
                held |= ids
        return chain.bytes_of((), held)

    for s in set(whole) | set(copies) | set(passed) | set(outside_copies):
        if s in chain.outside:
            continue
        nbytes = chain.nbytes[s]
        inside = whole.get(s, set()) | set(copies.get(s, ()))
        touched = sorted(inside | passed.get(s, set()))
        if whole.get(s, set()) & passed.get(s, set()):  # one block holds it whole either way
            constant += nbytes
        elif not touched:  # copies outside every block only
            constant += cost(s, {})
        elif len(touched) == 1:
            i = touched[0]
            for x in (0, 1):
                local[i][x] += cost(s, {i: x})
        elif len(touched) == 2 and touched[1] == touched[0] + 1:
            i = touched[0]
            for x in (0, 1):
                for y in (0, 1):
                    pair[i][x][y] += cost(s, {i: x, i + 1: y})
        elif not inside and len(touched) == n:  # passed to every block, held inside none
            none = cost(s, dict.fromkeys(touched, 0))
            constant += none
            any_chosen += nbytes - none
        else:
            constant += nbytes
            chain.assumed[s] = nbytes
    exact = not chain.assumed
    # states: (x of the last block, any block checkpointed so far) -> frontier of (flops, bytes, mask)
    states: dict[tuple[int, int], list[tuple[int, int, int]]] = {(0, 0): [(0, constant, 0)]}
    for i, block in enumerate(chain.blocks):
        grown: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for (last, seen), frontier in states.items():
            for x in (0, 1):
                extra_bytes = local[i][x] + (pair[i - 1][last][x] if i > 0 else 0)
                if x and not seen:
                    extra_bytes += any_chosen
                extra_flops = block.flops if x else 0
                bit = (1 << i) if x else 0
                grown.setdefault((x, seen or x), []).extend(
                    (flops + extra_flops, nbytes + extra_bytes, mask | bit) for flops, nbytes, mask in frontier)
        states = {}
        for key, points in grown.items():
            states[key] = _pareto(points)
            if len(states[key]) > FRONTIER_LIMIT:
                exact = False
    final = _pareto(p for frontier in states.values() for p in frontier)
    points = []
    for flops, predicted, mask in final:
        chosen = frozenset(i for i in range(n) if mask >> i & 1)
        held = chain.held(chosen)
        if exact and held != predicted:  # the charges above are the union's, term by term
            raise AssertionError(f"planner: charged {predicted} bytes but the plan holds {held}")
        points.append(Point(held, flops, chosen))
    # the exact bytes of each point can only be lower than charged: keep the frontier monotone
    clean: list[Point] = []
    for point in points:
        if not clean or point.held_bytes < clean[-1].held_bytes:
            clean.append(point)
    return clean, exact


def cheapest_within(points: Sequence[Point], budget: int) -> Optional[Point]:
    """The frontier point with the least recompute that holds at most ``budget`` bytes."""
    fitting = [p for p in points if p.held_bytes <= budget]
    return min(fitting, key=lambda p: (p.extra_flops, p.held_bytes)) if fitting else None


def exhaustive(chain: Chain, budget: int) -> Optional[tuple[int, int]]:
    """(least extra FLOPs, bytes) over every subset of blocks that fits ``budget``, by brute force
    (for tests: 2**len(blocks) plans)."""
    best = None
    for mask in range(1 << len(chain.blocks)):
        chosen = [i for i in range(len(chain.blocks)) if mask >> i & 1]
        held = chain.held(chosen)
        if held <= budget:
            key = (chain.extra_flops(chosen), held)
            if best is None or key < best:
                best = key
    return best
