"""The checkpoint planner's cost model and solver: plain data and arithmetic, no torch.

A chain of blocks (the modules a plan may checkpoint, in the order the forward runs them). Each
block has options: keep what its ops save (``internal``: storage ids); checkpointed, keep only the
tensors it was passed (``inputs``) and recompute its forward in backward (``flops``); or, where it
has one, checkpointed selectively (op level): keep its inputs and the outputs of its costly ops
(``cached``: matrix products, convolutions, attention) and recompute only the rest
(``flops - kept_flops``). Everything outside the blocks keeps what it saves (``outside``). Bytes
are counted once per storage, so what a plan holds is the size of a union::

    held = bytes(outside | U_{b kept} internal(b) | U_{b checkpointed} inputs(b)
                 | U_{b selective} inputs(b) | cached(b))

Under ``gradaudit.trim`` a save trim drops holds nothing (it is in no set), and a save trim
bit-packs holds a packed copy of its view (``Block.packed``, ``Chain.outside_packed``: ids into
``Chain.bits``) instead of its storage, while its block is kept. A copy costs its bytes only while
no save the plan keeps holds its storage whole (trim gives a bit-packed save its tensor back when
another save keeps the storage), and a storage's copies cost at most the storage
(``Accountant.freed_by_storage``'s rule: trim frees a storage only when the copies are smaller).
Without trim both are empty.

``Chain.held`` computes it exactly for any choice. ``solve`` finds, for every budget at once, the
plans with the least recompute: a dynamic program over the chain whose state is the previous
block's option and whether any block so far is checkpointed. It charges every storage exactly when
the blocks that can hold it are one block, two neighbours, or (held exactly when checkpointed) all
of them; any other storage is charged as always held whole (``Chain.assumed``), which can only
overstate a plan's bytes, never understate them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

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
    # checkpointed selectively: the storages of the op outputs the policy keeps (None: no such option)
    cached: Optional[frozenset[int]] = None
    kept_flops: int = 0  # forward FLOPs of those ops: what selective recompute does not redo
    packed: frozenset[int] = frozenset()  # under trim: the bit-packed copies its ops' saves hold (Chain.bits)

    def options(self) -> list[tuple[int, frozenset[int], frozenset[int]]]:
        """(recompute FLOPs, storages held whole, bit-packed copies held) per option: KEEP,
        CHECKPOINT and, where there is one, SELECTIVE (inside a checkpoint trim sees no save)."""
        found = [(0, self.internal, self.packed), (self.flops, self.inputs, frozenset())]
        if self.cached is not None:
            found.append((self.flops - self.kept_flops, self.inputs | self.cached, frozenset()))
        return found


KEEP, CHECKPOINT, SELECTIVE = 0, 1, 2


@dataclass(frozen=True)
class Point:
    """One plan on the memory/compute frontier."""

    held_bytes: int  # exact (Chain.held)
    extra_flops: int
    chosen: frozenset[int]  # indices into Chain.blocks: the checkpointed blocks
    selective: frozenset[int] = frozenset()  # those of them checkpointed selectively (op level)


@dataclass
class Chain:
    blocks: list[Block]
    nbytes: dict[int, int]  # storage id -> bytes, for every storage of a held kind
    outside: frozenset[int]  # storages held whole by saves outside every block
    assumed: dict[int, int] = field(default_factory=dict)  # storages the solver charges as always held
    # under trim: bit-packed copy id -> (its storage, its bytes); one per distinct bit-packed view
    bits: dict[int, tuple[int, int]] = field(default_factory=dict)
    outside_packed: frozenset[int] = frozenset()  # copies held by saves outside every block

    def _option(self, i: int, chosen: set[int], selective: set[int]) -> int:
        if i in selective:
            if i not in chosen or self.blocks[i].cached is None:
                raise ValueError(f"block {i} cannot be checkpointed selectively")
            return SELECTIVE
        return CHECKPOINT if i in chosen else KEEP

    def held(self, chosen: Iterable[int], selective: Iterable[int] = ()) -> int:
        """Exact bytes held after the forward with the blocks ``chosen`` checkpointed (those also
        in ``selective`` selectively)."""
        chosen, selective = set(chosen), set(selective)
        kept, copies = set(self.outside), set(self.outside_packed)
        for i, block in enumerate(self.blocks):
            _, whole, packed = block.options()[self._option(i, chosen, selective)]
            kept |= whole
            copies |= packed
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

    def extra_flops(self, chosen: Iterable[int], selective: Iterable[int] = ()) -> int:
        chosen, selective = set(chosen), set(selective)
        return sum(self.blocks[i].options()[self._option(i, chosen, selective)][0] for i in chosen)


def _pareto(points: Iterable[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """(flops, bytes, mask, selective mask) points, none beaten on both: cheapest first, bytes
    strictly falling."""
    best: list[tuple[int, int, int, int]] = []
    for point in sorted(points):
        if not best or point[1] < best[-1][1]:
            best.append(point)
    if len(best) > FRONTIER_LIMIT:
        step = len(best) / FRONTIER_LIMIT
        best = [best[int(k * step)] for k in range(FRONTIER_LIMIT)] + [best[-1]]
    return best


def solve(chain: Chain) -> tuple[list[Point], bool]:
    """The memory/compute frontier of ``chain``: every plan no other plan beats on both held bytes
    and recompute, cheapest first. Returns (points, exact): ``exact`` is False when some storage
    had to be charged as always held or the frontier was thinned (then a point's bytes are still
    exact, but a cheaper plan under the same budget may exist)."""
    options = [block.options() for block in chain.blocks]
    charges = _charge(chain, options)
    exact = not chain.assumed
    # states: (option of the last block, any block checkpointed so far) -> frontier of
    # (flops, bytes, mask of checkpointed blocks, mask of the selective ones)
    states: dict[tuple[int, bool], list[tuple[int, int, int, int]]] = {(KEEP, False): [(0, charges.constant, 0, 0)]}
    for i, opts in enumerate(options):
        grown: dict[tuple[int, bool], list[tuple[int, int, int, int]]] = {}
        for (last, seen), frontier in states.items():
            for x, (recompute, _, _) in enumerate(opts):
                extra_bytes = charges.local[i][x] + (charges.pair[i - 1][last][x] if i > 0 else 0)
                if x != KEEP and not seen:
                    extra_bytes += charges.any_chosen
                bit = (1 << i) if x != KEEP else 0
                sbit = (1 << i) if x == SELECTIVE else 0
                grown.setdefault((x, seen or x != KEEP), []).extend(
                    (flops + recompute, nbytes + extra_bytes, mask | bit, smask | sbit)
                    for flops, nbytes, mask, smask in frontier)
        states = {}
        for key, points in grown.items():
            states[key] = _pareto(points)
            if len(states[key]) > FRONTIER_LIMIT:
                exact = False
    final = _pareto(p for frontier in states.values() for p in frontier)
    return _points(chain, final, exact), exact


@dataclass
class _Charges:
    """What each storage costs, split by the blocks whose options decide it: ``local[i][x]`` the bytes
    only block i decides (x its option), ``pair[i][x][y]`` those blocks i and i+1 decide together,
    ``any_chosen`` the bytes held exactly when at least one block is checkpointed, ``constant`` the rest."""

    local: list[list[int]]
    pair: list[list[list[int]]]
    any_chosen: int = 0
    constant: int = 0


def _charge(chain: Chain, options: Sequence[Sequence[Any]]) -> _Charges:
    """Each storage's bytes charged to the blocks that decide them (``chain.assumed``: those charged as
    always held, since more than two blocks, not all, decide them)."""
    n = len(options)
    charges = _Charges([[0] * len(opts) for opts in options],
                       [[[0] * len(options[i + 1]) for _ in options[i]] for i in range(n - 1)],
                       constant=sum(chain.nbytes[s] for s in chain.outside))
    chain.assumed = {}
    holders = _Holders(chain, options)
    for s in holders.storages():
        if s in chain.outside:
            continue
        nbytes = chain.nbytes[s]
        touched = sorted(set(holders.whole.get(s, {})) | set(holders.copies.get(s, {})))
        holding = holders.whole.get(s, {})
        if any(len(holding.get(i, ())) == len(options[i]) for i in touched):  # held whole whatever it does
            charges.constant += nbytes
        elif not touched:  # copies outside every block only
            charges.constant += holders.cost(s, {})
        elif len(touched) == 1:
            i = touched[0]
            for x in range(len(options[i])):
                charges.local[i][x] += holders.cost(s, {i: x})
        elif len(touched) == 2 and touched[1] == touched[0] + 1:
            i = touched[0]
            for x in range(len(options[i])):
                for y in range(len(options[i + 1])):
                    charges.pair[i][x][y] += holders.cost(s, {i: x, i + 1: y})
        elif len(touched) == n and all(holding.get(i, set()) == set(range(1, len(options[i]))) for i in touched):
            # passed to every block and held inside none: whole exactly when one is checkpointed
            none = holders.cost(s, dict.fromkeys(touched, KEEP))
            charges.constant += none
            charges.any_chosen += nbytes - none
        else:
            charges.constant += nbytes
            chain.assumed[s] = nbytes
    return charges


class _Holders:
    """Per storage: the blocks holding it whole under some option, and under which (``whole``); the
    blocks holding copies of it under some option (``copies``: copy ids per block and option); the
    copies held outside every block (``outside``)."""

    def __init__(self, chain: Chain, options: Sequence[Sequence[Any]]) -> None:
        self.chain = chain
        self.whole: dict[int, dict[int, set[int]]] = {}
        self.copies: dict[int, dict[int, dict[int, set[int]]]] = {}
        self.outside: dict[int, set[int]] = {}
        for i, opts in enumerate(options):
            for x, (_, holds, packed) in enumerate(opts):
                for s in holds:
                    self.whole.setdefault(s, {}).setdefault(i, set()).add(x)
                for c in packed:
                    self.copies.setdefault(chain.bits[c][0], {}).setdefault(i, {}).setdefault(x, set()).add(c)
        for c in chain.outside_packed:
            self.outside.setdefault(chain.bits[c][0], set()).add(c)

    def storages(self) -> set[int]:
        return set(self.whole) | set(self.copies) | set(self.outside)

    def cost(self, s: int, choice: dict[int, int]) -> int:
        """Bytes storage ``s`` costs when each block it touches takes the option ``choice[i]``."""
        if any(choice[i] in xs for i, xs in self.whole.get(s, {}).items()):
            return self.chain.nbytes[s]
        held = set(self.outside.get(s, ()))
        for i, per_option in self.copies.get(s, {}).items():
            held |= per_option.get(choice[i], set())
        return self.chain.bytes_of((), held)


def _points(chain: Chain, final: Sequence[tuple[int, int, int, int]], exact: bool) -> list[Point]:
    """The frontier's points, each plan's held bytes taken from the chain (checked against the charges
    where they are exact), monotone: the exact bytes can only be lower than charged."""
    n = len(chain.blocks)
    points = []
    for flops, predicted, mask, smask in final:
        chosen = frozenset(i for i in range(n) if mask >> i & 1)
        selective = frozenset(i for i in range(n) if smask >> i & 1)
        held = chain.held(chosen, selective)
        if exact and held != predicted:  # the charges above are the union's, term by term
            raise AssertionError(f"planner: charged {predicted} bytes but the plan holds {held}")
        points.append(Point(held, flops, chosen, selective))
    clean: list[Point] = []
    for point in points:
        if not clean or point.held_bytes < clean[-1].held_bytes:
            clean.append(point)
    return clean


def cheapest_within(points: Sequence[Point], budget: int) -> Optional[Point]:
    """The frontier point with the least recompute that holds at most ``budget`` bytes."""
    fitting = [p for p in points if p.held_bytes <= budget]
    return min(fitting, key=lambda p: (p.extra_flops, p.held_bytes)) if fitting else None


def exhaustive(chain: Chain, budget: int) -> Optional[tuple[int, int]]:
    """(least extra FLOPs, bytes) over every choice of options that fits ``budget``, by brute
    force (for tests: 2 or 3 options per block)."""
    import itertools

    best = None
    for choice in itertools.product(*[range(len(block.options())) for block in chain.blocks]):
        chosen = [i for i, x in enumerate(choice) if x != KEEP]
        selective = [i for i, x in enumerate(choice) if x == SELECTIVE]
        held = chain.held(chosen, selective)
        if held <= budget:
            key = (chain.extra_flops(chosen, selective), held)
            if best is None or key < best:
                best = key
    return best
