"""Plan activation checkpointing to a memory budget: which modules to recompute in backward
instead of holding what their ops save, for the least extra compute.

    plan = gradaudit.plan(model, inputs, budget="8GiB", trainable=["model.layers.40.*"])
    plan.held_bytes, plan.extra_flops, plan.checkpointed
    with plan.apply(model):
        model(**inputs).loss.backward()

    plan = gradaudit.plan(model, inputs, budget="8GiB", cost="time")  # on a real device: measured time
    plan.extra_seconds, plan.step_seconds

How it works: one audit of the model (any device, meta included) watching the candidate blocks
records every storage autograd holds, which block's ops hold it, and the storages each block is
passed; one more forward and backward under ``torch.utils.flop_counter.FlopCounterMode`` gives each
block's forward FLOPs (what recomputing it costs) and a whole step's. With ``cost="time"`` the cost
the solver minimises is instead each block's forward time, measured on the model's device
(timing.py), and the FLOP figures are still reported. ``solve`` (solve.py) turns that into the
memory/compute frontier; the plan is its cheapest point within the budget.

On top of ``gradaudit.trim`` (``trim=True``, or a model trimmed already): the same audit (trim stands
aside while gradaudit audits) says what trim does to each save, since trim decides from the op
knowledge the verdicts come from: a save it drops holds nothing, a save it bit-packs holds a packed
copy of its view, and a storage another save keeps whole costs its whole size (``_chain``). The
figures are then what the model holds with trim and the plan, as an audit of the planned, trimmed
model states (``saved_bytes - reclaimable_with_bitpacking_bytes``) and the storage tracker measures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from .. import torchapi
from ..accounting import Accountant, counted, packed_bits_nbytes
from ..errors import GradauditError
from ..recorder import CHECKPOINT_INPUTS
from ..records import HELD_KINDS, NOT_NEEDED, Manager, StorageKind
from . import segments, timing
from .apply import FULL_POLICY, SELECTIVE_POLICY, PlanHandle, kept_by_selective
from .solve import Block, Chain, Point, cheapest_within, solve

# 2: the cost (FLOPs or measured time) is chosen: ``cost``, ``extra_seconds``, ``step_seconds``;
# ``extra_compute`` and the frontier's entries are in the cost's units
PLAN_SCHEMA_VERSION = 2
HELD_BOUND, PEAK_BOUND = "held", "peak"  # what a budget bounds (plan(bound=...))

__all__ = ["plan", "Plan", "PlanHandle", "BudgetError", "Baseline", "repeated_blocks"]


class BudgetError(GradauditError):
    """No plan of the candidate blocks holds at most the budget. ``smallest`` is the least any
    plan holds (``smallest_plan`` the plan that does); with ``bound="peak"``, that plan's measured
    peak."""

    def __init__(self, message: str, smallest: int, smallest_plan: "Plan") -> None:
        super().__init__(message)
        self.smallest = smallest
        self.smallest_plan = smallest_plan


@dataclass(frozen=True)
class Baseline:
    """A plan a user would otherwise pick, with the same figures as the chosen plan."""

    name: str
    checkpointed: tuple[str, ...]
    held_bytes: int
    extra_flops: int
    peak_bytes: Optional[int] = None  # measured as Plan.peak_bytes is (None: not measured)
    extra_seconds: Optional[float] = None  # with cost="time" (None otherwise)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "checkpointed": list(self.checkpointed), "held_bytes": self.held_bytes,
                "extra_flops": self.extra_flops, "extra_seconds": self.extra_seconds, "peak_bytes": self.peak_bytes}


@dataclass(frozen=True)
class _Costs:
    """Each chain block's forward FLOPs (and of those, the FLOPs an op-level checkpoint does not
    redo) and, with cost="time", its measured forward nanoseconds: the figures of any plan,
    whichever of the two the solver minimised."""

    flops: tuple[int, ...]
    kept: tuple[int, ...]
    nanoseconds: Optional[tuple[int, ...]] = None

    def extra_flops(self, chosen: Iterable[int], selective: Iterable[int] = ()) -> int:
        selective = set(selective)
        return sum(self.flops[i] - (self.kept[i] if i in selective else 0) for i in set(chosen))

    def extra_seconds(self, chosen: Iterable[int]) -> Optional[float]:
        if self.nanoseconds is None:
            return None
        return sum(self.nanoseconds[i] for i in set(chosen)) / 1e9

    def extra(self, chosen: Iterable[int], selective: Iterable[int] = ()) -> Union[int, float]:
        """In the cost's units: FLOPs, or seconds with cost="time" (whole blocks only)."""
        seconds = self.extra_seconds(chosen)
        return self.extra_flops(chosen, selective) if seconds is None else seconds


@dataclass
class Plan:
    """Which modules to checkpoint so that autograd holds at most ``budget`` bytes after the forward."""

    model: str  # class name of the planned model
    device: str
    target: str  # the device type the figures are for (Report.target: on meta, what it stands for)
    budget: int
    held_bytes: int  # held after the forward under the plan: what an audit of the planned model counts
    unplanned_held_bytes: int  # the same without the plan (the audit's saved_bytes)
    extra_flops: int  # FLOPs the recomputation adds per step (forward FLOPs of the checkpointed modules)
    step_flops: int  # FLOPs of one unplanned step (forward and backward)
    checkpointed: tuple[str, ...]  # module paths, in forward order
    # every candidate: path, class, calls, flops, seconds (cost="time"), bytes it holds and is passed
    blocks: tuple[dict[str, Any], ...]
    # (held_bytes, extra cost) of every Pareto plan, cheapest first; the cost in the plan's units:
    # FLOPs (cost="flops") or seconds (cost="time")
    frontier: tuple[tuple[int, Union[int, float]], ...]
    baselines: tuple[Baseline, ...]
    optimal: bool  # False when the solver could not charge every storage exactly (see notes)
    notes: list[str] = field(default_factory=list)
    # bytes alive at the worst moment of one planned step (forward, recomputation and backward,
    # activation and parameter gradients included; parameters, buffers and inputs not), measured by
    # running that step on the model's device: on meta (shapes only, nothing computed) it predicts
    # the real device's figure; None when not measured (measure_peak=False)
    peak_bytes: Optional[int] = None
    unplanned_peak_bytes: Optional[int] = None
    # the modules the model checkpoints itself (the plan replaces that: its figures are without it),
    # and what the model holds with it
    replaces: tuple[str, ...] = ()
    current_held_bytes: Optional[int] = None
    # those of ``checkpointed`` checkpointed op by op: the outputs of their costly ops (matrix
    # products, convolutions, attention) are kept and only the rest is recomputed
    selective: tuple[str, ...] = ()
    # what the solver minimised: "flops" (forward FLOPs, counted) or "time" (forward time, measured
    # on the model's device: the median of timing.REPEATS runs); with "time", the seconds the
    # recomputation adds per step and one unplanned step's (None with "flops")
    cost: str = "flops"
    extra_seconds: Optional[float] = None
    step_seconds: Optional[float] = None
    # what the budget bounds: "held" (bytes held after the forward, exact) or "peak" (the measured
    # peak of one step: the plan is the cheapest frontier point whose peak fits, see _by_peak)
    bound: str = "held"
    # every figure above is with gradaudit.trim installed (with this bitpack option): apply installs it
    trimmed: bool = False
    bitpack: Optional[bool] = None  # trim's option; None without trim
    # the solver's chain, frontier and the blocks' costs, for for_budget (not part of the plan's data)
    _solved: Any = field(default=None, repr=False, compare=False)
    _point: Any = field(default=None, repr=False, compare=False)  # its frontier point

    def for_budget(self, budget: Union[int, str]) -> "Plan":
        """The plan for another budget, from the same audit and frontier: instant (nothing runs
        again, its peak is not measured), except with ``bound="peak"``, which measures the peaks
        its bisection probes (steps already measured are not run again). Raises BudgetError when
        nothing fits."""
        from ..loading import parse_size

        budget_bytes = _budget_bytes(budget, parse_size)
        return self._for(budget_bytes, 0)

    def sweep(self, budgets: Sequence[Union[int, str]], measure_peak: bool = False) -> list["Plan"]:
        """The plans for several budgets (in the order given), from the same audit and frontier.
        Neither held bytes nor, where peaks are measured (``measure_peak``, or ``bound="peak"``), the
        peak ever rises as the budget shrinks: a smaller budget's plan is searched only among the
        points from the larger one's on; with peaks, one whose peak would exceed the larger budget's
        plan's gives way to the next point that peaks no higher (points further on hold less, so
        they fit the budget too; that costs more recompute than the budget alone asks). A budget
        nothing fits gives the least plan (``fits`` False)."""
        from ..loading import parse_size

        wanted = [_budget_bytes(b, parse_size) for b in budgets]
        points, peak_of = self._solved[1], self._solved[4]
        peaks = measure_peak or self.bound == PEAK_BOUND
        found: dict[int, Plan] = {}
        start, ceiling = 0, None
        for budget_bytes in sorted(set(wanted), reverse=True):
            try:
                chosen = self._for(budget_bytes, start)
            except BudgetError as error:
                chosen = error.smallest_plan
            index = points.index(chosen._point)
            if peaks and ceiling is not None and chosen.fits:
                while peak_of(points[index]) > ceiling and index + 1 < len(points):
                    index += 1
                if index != points.index(chosen._point):
                    chosen = self._at(points[index], budget_bytes)
            if peaks:
                chosen.peak_bytes = peak_of(points[index])
                chosen.unplanned_peak_bytes = peak_of(None)
                ceiling = chosen.peak_bytes
            found[budget_bytes] = chosen
            start = index
        return [found[b] for b in wanted]

    def _for(self, budget_bytes: int, start: int) -> "Plan":
        points, peak_of = self._solved[1], self._solved[4]
        if self.bound == PEAK_BOUND:
            index = _by_peak(points, budget_bytes, peak_of, start)
            point = points[index] if index is not None else None
        else:
            point = cheapest_within(points[start:], budget_bytes)
        other = self._at(point if point is not None else points[-1], budget_bytes)
        if point is None:
            raise _budget_error(other, len(self._solved[0].blocks))
        return other

    def _at(self, point: Point, budget_bytes: int) -> "Plan":
        """This plan's figures for another frontier point and budget."""
        chain, _, costs, fixed, peak_of = self._solved
        return dataclasses.replace(
            self, budget=budget_bytes, held_bytes=point.held_bytes,
            extra_flops=costs.extra_flops(point.chosen, point.selective),
            extra_seconds=costs.extra_seconds(point.chosen),
            checkpointed=tuple(chain.blocks[i].path for i in sorted(point.chosen)),
            selective=tuple(chain.blocks[i].path for i in sorted(point.selective)),
            baselines=_baselines(chain, costs, budget_bytes) + fixed, notes=list(self.notes), _point=point,
            peak_bytes=peak_of(point) if self.bound == PEAK_BOUND else None,
            unplanned_peak_bytes=self.unplanned_peak_bytes if self.bound == PEAK_BOUND else None)

    @property
    def fits(self) -> bool:
        """Whether the plan keeps what its budget bounds (``bound``) at or under the budget."""
        if self.bound == PEAK_BOUND:
            return self.peak_bytes is not None and self.peak_bytes <= self.budget
        return self.held_bytes <= self.budget

    @property
    def extra_compute(self) -> float:
        """The recomputation's cost as a fraction of an unplanned step's, in the cost's units (FLOPs,
        or seconds with cost="time")."""
        return self.share(self)

    def share(self, figures: Union["Plan", Baseline]) -> float:
        """What ``figures`` (this plan, or one of its baselines) adds per step, as a fraction of an
        unplanned step, in the plan's cost units."""
        if self.cost == "time":
            return (figures.extra_seconds or 0.0) / self.step_seconds if self.step_seconds else 0.0
        return figures.extra_flops / self.step_flops if self.step_flops else 0.0

    def apply(self, model: nn.Module) -> PlanHandle:
        """Checkpoint the planned modules of ``model`` (non-reentrant ``torch.utils.checkpoint``) and,
        for a plan made with trim, install ``gradaudit.trim`` (with the plan's bitpack) unless it is
        installed already; returns a handle: ``remove()`` or ``with plan.apply(model): ...`` restores
        it (removing trim only where apply installed it)."""
        if self.replaces and getattr(model, "is_gradient_checkpointing", False):
            raise GradauditError("this plan replaces the model's own checkpointing, which is still on: turn it off "
                                 "first (model.gradient_checkpointing_disable())")
        return PlanHandle(model, self.checkpointed, self.policies, trim=self.bitpack if self.trimmed else None)

    @property
    def policies(self) -> dict[str, str]:
        """How each checkpointed module is checkpointed: "full" (everything recomputed) or
        "selective" (costly ops' outputs kept)."""
        return {path: SELECTIVE_POLICY if path in self.selective else FULL_POLICY for path in self.checkpointed}

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "tool": "gradaudit",
            "kind": "plan",
            "model": self.model,
            "device": self.device,
            "target": self.target,
            "budget": self.budget,
            "fits": self.fits,
            "held_bytes": self.held_bytes,
            "unplanned_held_bytes": self.unplanned_held_bytes,
            "cost": self.cost,
            "extra_flops": self.extra_flops,
            "step_flops": self.step_flops,
            "extra_seconds": self.extra_seconds,
            "step_seconds": self.step_seconds,
            "extra_compute": self.extra_compute,
            "peak_bytes": self.peak_bytes,
            "unplanned_peak_bytes": self.unplanned_peak_bytes,
            "replaces": list(self.replaces),
            "current_held_bytes": self.current_held_bytes,
            "trim": {"bitpack": self.bitpack} if self.trimmed else None,
            "bound": self.bound,
            "checkpointed": list(self.checkpointed),
            "selective": list(self.selective),
            "optimal": self.optimal,
            "blocks": [dict(b) for b in self.blocks],
            # the key names the cost's units
            "frontier": [{"held_bytes": h, "extra_seconds" if self.cost == "time" else "extra_flops": c}
                         for h, c in self.frontier],
            "baselines": [b.to_dict() for b in self.baselines],
            "notes": list(self.notes),
        }

    def __repr__(self) -> str:
        selective = f" ({len(self.selective)} selectively)" if self.selective else ""
        return (f"<gradaudit.Plan {self.model}: checkpoint {len(self.checkpointed)}{selective} of {len(self.blocks)} "
                f"blocks, holds {self.held_bytes} of budget {self.budget} bytes{' with trim' if self.trimmed else ''}, "
                f"+{100 * self.extra_compute:.1f}% {'time' if self.cost == 'time' else 'compute'}>")


def repeated_blocks(model: nn.Module) -> list[str]:
    """The modules a plan checkpoints by default: the children of every ``nn.ModuleList`` or
    ``nn.Sequential`` with two or more children of one class (transformer layers, ResNet stages'
    blocks, the layers of a sequential stack), the outermost such container on each branch."""
    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        children = list(module.named_children())
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and children:
            if max(Counter(type(c) for _, c in children).values()) >= 2:
                found.extend(f"{prefix}{name}" for name, _ in children)
                return
        for name, child in children:
            visit(f"{prefix}{name}.", child)

    visit("", model)
    return found


def _candidates(model: nn.Module, blocks: Optional[Sequence[str]]) -> list[str]:
    if blocks is None:
        paths = repeated_blocks(model)
        if not paths:
            raise GradauditError("no repeated blocks found (children of an nn.ModuleList or nn.Sequential "
                                 "that share a class): name the modules to consider with blocks=[GLOB, ...] "
                                 "(--blocks GLOB)")
        return paths
    if isinstance(blocks, str):
        blocks = [blocks]
    names = [path for path, _ in model.named_modules() if path]
    paths = []
    for pattern in blocks:
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise GradauditError(f"blocks: {pattern!r} matches no module (names as in named_modules(), "
                                 f"e.g. {names[0]!r})" if names else "blocks: the model has no submodules")
        paths.extend(matched)
    # the outermost of nested matches: checkpointing a module already recomputes what is inside
    paths = sorted(set(paths))
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p)]


def _budget_bytes(budget: Any, parse_size: Callable[[str], int]) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise GradauditError(f"budget must be bytes (an int) or a size such as '8GiB', not {budget!r}")
    budget_bytes = parse_size(budget) if isinstance(budget, str) else budget
    if budget_bytes < 0:
        raise GradauditError(f"budget must not be negative, got {budget_bytes}")
    return budget_bytes


def _budget_error(least: "Plan", blocks: int) -> "BudgetError":
    if least.bound == PEAK_BOUND:
        return BudgetError(f"no plan's peak fits {least.budget} bytes: checkpointing the {blocks} candidate blocks "
                           f"peaks at {least.peak_bytes} bytes (unplanned {least.unplanned_peak_bytes}); raise the "
                           f"budget or consider more modules (blocks=...)", least.peak_bytes or 0, least)
    return BudgetError(f"no plan fits {least.budget} bytes: checkpointing the {blocks} candidate blocks holds at "
                       f"least {least.held_bytes} bytes (of {least.unplanned_held_bytes} unplanned); raise the "
                       f"budget or consider more modules (blocks=...)", least.held_bytes, least)


def _checkpointed_now(report: Any) -> list[str]:
    """The modules the audited forward checkpointed itself (torch.utils.checkpoint regions)."""
    regions = {n.module or "the model" for n in report.nodes
               if n.name in (CHECKPOINT_INPUTS, torchapi.REENTRANT_CHECKPOINT_NODE)}
    if not regions and any(t.managed_by == Manager.CHECKPOINT for t in report.tensors):
        regions.add("the model")
    return sorted(regions)


def _few(paths: Sequence[str]) -> str:
    return ", ".join(paths[:3]) + (f", ... ({len(paths)} in all)" if len(paths) > 3 else "")


def _inside(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


@contextlib.contextmanager
def _as_audited(model: nn.Module, inputs: Any, trainable: Any, frozen: Any, target: str) -> Iterator[None]:
    """The requires_grad what-if applied and, on meta, the kernel choices and autocast of the
    target device, as the audit has them; the model is left as found afterwards (gradients,
    buffers, RNG state included)."""
    from ..auditing import ModelState, apply_trainable, runs_on_meta
    from ..meta import standing_for
    from ..tensors import first_meta_parameter, iter_tensors

    tensors = list(iter_tensors(inputs))
    on_meta = runs_on_meta(first_meta_parameter(model.parameters()), tensors)
    state = ModelState(model)
    # gradients the caller has are set aside, not accumulated into: backward adds to an existing
    # .grad in place, which putting the same tensor object back would not undo
    leaves = [(t, t.grad) for t in tensors if t.is_leaf and t.requires_grad and t.grad is not None]
    try:
        for p in model.parameters():
            p.grad = None
        for t, _ in leaves:
            t.grad = None
        apply_trainable(model, trainable, frozen)
        with standing_for(target) if on_meta else contextlib.nullcontext():
            yield
    finally:
        state.restore()
        for t, grad in leaves:
            t.grad = grad


# ops that allocate without computing (their outputs are written by the next op) or only reinterpret
# an existing storage without saying so in their schema
_NO_WORK = frozenset(getattr(torch.ops.aten, name) for name in (
    "_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
    "_reshape_alias", "set_", "resize_") if hasattr(torch.ops.aten, name))


def _writes_nothing(op: Any) -> bool:
    """Whether ``op`` (an overload packet) makes no new elements: a view or an allocation only."""
    if op in _NO_WORK:
        return True
    try:
        schema = getattr(op, op.overloads()[0])._schema
    except (AttributeError, IndexError, RuntimeError):
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _elements(*_: Any, out_val: Any = None, **__: Any) -> int:
    from ..tensors import iter_tensors

    return sum(t.numel() for t in iter_tensors(out_val))


def _none(*_: Any, **__: Any) -> int:
    return 0


class _EveryOp(dict):
    """FlopCounterMode's formula table, answering for every op: torch's formula where it has one
    (matrix products, convolutions, attention), else one FLOP per element the op writes. Torch
    counts those ops (activations, norms, softmax, elementwise arithmetic) as 0, which would make
    recomputing them look free; they are memory-bound, and the elements they write are the
    nearest FLOP-like measure of their cost."""

    def __contains__(self, op: object) -> bool:
        return True

    def __missing__(self, op: Any) -> Any:
        formula = _none if _writes_nothing(op) else _elements
        self[op] = formula
        return formula


def _counting() -> Any:
    from torch.utils.flop_counter import FlopCounterMode

    mode = FlopCounterMode(display=False)
    mode.flop_registry = _EveryOp(mode.flop_registry)
    return mode


def _flops(model: nn.Module, inputs: Any, trainable: Any, frozen: Any, target: str,
           paths: Sequence[str]) -> tuple[dict[str, tuple[int, int]], int]:
    """(forward FLOPs, of which in ops a selective checkpoint keeps) of each module in ``paths`` (all its calls) and the
    FLOPs of one whole step (forward and backward), as torch.utils.flop_counter counts them plus one
    per element for the ops it has no formula for; the model is left as found."""
    from ..tensors import iter_tensors, split_inputs, unique

    args, kwargs = split_inputs(inputs)
    with _as_audited(model, inputs, trainable, frozen, target):
        with _counting() as forward:
            output = model(*args, **kwargs)
        outputs = unique([t for t in iter_tensors(output) if t.requires_grad and t.grad_fn is not None])
        with _counting() as backward:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        del output, outputs
    counts = forward.get_flop_counts()
    root = type(model).__name__
    per_module = {}
    for path in paths:
        ops = counts.get(f"{root}.{path}", {})
        per_module[path] = (sum(ops.values()), sum(n for op, n in ops.items() if kept_by_selective(op)))
    step = forward.get_total_flops() + backward.get_total_flops()
    return per_module, step


def _audited_with(model: nn.Module, inputs: Any, trainable: Any, frozen: Any, target: Optional[str],
                  watch: Sequence[str], checkpointed: dict[str, str], bitpack: Optional[bool]) -> tuple[Any, set[str]]:
    """An audit with ``checkpointed`` applied (path -> policy), and the selectively checkpointed
    paths whose cache had an entry changed in place (backward would raise)."""
    from ..auditing import audit

    with PlanHandle(model, tuple(checkpointed), policies=checkpointed, keep_caches=True, trim=bitpack) as handle:
        report = audit(model, inputs, trainable=trainable, frozen=frozen, watch=watch, target=target)
        mutated = {path for path, caches in handle.caches.items()
                   if any(torchapi.mutated_cached(cache) for cache in caches)}
    return report, mutated


def _add_selective(chain: Chain, report: Any, audit_with: Callable[[dict[str, str]], Any],
                   held_of: Callable[[Any], int]) -> Optional[str]:
    """Give every block with costly ops the SELECTIVE option: one audit with all of them checkpointed
    selectively says which storages each one's cache holds. Those that are also tensors a block is
    passed or returns are matched to this report's storage ids by position in the call (the same
    calls, in the same order); the others belong to the cache alone. ``held_of``: what an audit
    says the forward holds (with trim, where the plan is). Returns a note when the option cannot be
    modelled exactly (then no block has it)."""
    capable = [b for b in chain.blocks if b.kept_flops]
    selective_report, mutated = audit_with({b.path: SELECTIVE_POLICY for b in capable})
    mine: dict[str, list] = {}
    theirs: dict[str, list] = {}
    for call in report.module_calls:
        mine.setdefault(call.path, []).append(call)
    for call in selective_report.module_calls:
        theirs.setdefault(call.path, []).append(call)
    same: dict[int, int] = {}  # the selective audit's storage id -> this report's
    sizes: dict[int, int] = {}
    for path, calls in mine.items():
        if len(theirs.get(path, ())) != len(calls):
            return "op-level checkpointing left out: the blocks were called differently when checkpointed"
        for call, other in zip(calls, theirs[path]):
            for ours, their in ((call.inputs, other.inputs), (call.outputs, other.outputs)):
                if len(ours) != len(their):
                    return "op-level checkpointing left out: the blocks were passed or returned other tensors"
                for (sid, size, _), (other_sid, _, _) in zip(ours, their):
                    if same.setdefault(other_sid, sid) != sid:
                        return "op-level checkpointing left out: the blocks' tensors could not be matched"
                    sizes[sid] = size
    fresh = max([*chain.nbytes, *same.values(), -1]) + 1
    cached: dict[str, set[int]] = {b.path: set() for b in capable}
    for t in counted(selective_report.tensors):
        node = selective_report.nodes[t.node_id] if t.node_id >= 0 else None
        if node is None or node.name != CHECKPOINT_INPUTS or not t.attr.startswith("cached["):
            continue
        storage = selective_report.storages[t.storage_id]
        if storage.kind not in HELD_KINDS or t.module not in cached:
            continue
        sid = same.get(storage.id)
        if sid is None:
            sid = fresh + storage.id
        chain.nbytes.setdefault(sid, sizes.get(sid, storage.nbytes))
        cached[t.module].add(sid)
    blocks = [dataclasses.replace(b, cached=frozenset(cached[b.path])) if b.path in cached else b
              for b in chain.blocks]
    everything = [i for i, b in enumerate(blocks) if b.cached is not None]
    trial = dataclasses.replace(chain, blocks=blocks)
    if trial.held(everything, everything) != held_of(selective_report):
        return (f"op-level checkpointing left out: its bytes could not be modelled exactly (the chain says "
                f"{trial.held(everything, everything)}, an audit {held_of(selective_report)})")
    # a block whose forward changes a kept output in place (an in-place activation after a matrix
    # product or a batch norm) cannot be checkpointed selectively: backward would raise
    blocks = [dataclasses.replace(b, cached=None) if b.path in mutated else b for b in blocks]
    chain.blocks = blocks
    return None


def _step(model: nn.Module, inputs: Any, trainable: Any, frozen: Any, target: str,
          applied: Callable[[], Any]) -> tuple[int, int]:
    """(held after the forward less the outputs, peak through forward and backward) of one step
    with ``applied()`` in force (a plan's or a baseline's checkpointing), measured on the model's
    device: the storage tracker on CPU and meta (where it follows the meta tensors the step would
    allocate), the allocator on CUDA. Left as found."""
    from ..measure import forward_backward
    from ..tensors import split_inputs

    args, kwargs = split_inputs(inputs)
    with _as_audited(model, inputs, trainable, frozen, target):
        with applied():
            return forward_backward(model, args, kwargs)


def _segments_baseline(model: nn.Module, inputs: Any, trainable: Any, frozen: Any, target: Optional[str],
                       chain: Chain, costs: "_Costs", children: Sequence[str], in_segments: Callable[[int], Any],
                       bitpack: Optional[bool]) -> tuple[Baseline, Callable[[], Any]]:
    """The sqrt(n) segments baseline of the stack ``children`` (see segments.py; ``in_segments(k)``
    runs it in k segments): its held bytes from an audit with it in force, its recompute from the
    blocks of its checkpointed segments that build a graph; and what puts it in force (to measure
    its peak)."""
    from ..auditing import audit

    count = segments.square_root_segments(len(children))

    @contextlib.contextmanager
    def applied() -> Iterator[list[tuple[int, int]]]:
        with in_segments(count) as ranges, _trimmed(model, bitpack):
            yield ranges

    with applied() as ranges:
        held = _held_by_report(audit(model, inputs, trainable=trainable, frozen=frozen, target=target), bitpack)
    recomputed = {children[k] for first, last in ranges[:-1] for k in range(first, last + 1)}
    chosen = [i for i, b in enumerate(chain.blocks) if b.path in recomputed]
    return Baseline(f"{count} segments", tuple(p for p in children if p in recomputed), held,
                    costs.extra_flops(chosen), extra_seconds=costs.extra_seconds(chosen)), applied


@contextlib.contextmanager
def _trimmed(model: nn.Module, bitpack: Optional[bool]) -> Iterator[None]:
    """gradaudit.trim installed (with ``bitpack``) while in force, unless it is already or ``bitpack``
    is None (a plan without trim)."""
    from ..auditing import trimmed_now

    if bitpack is None or trimmed_now(model):
        yield
        return
    from ..trimming import trim as install_trim

    with install_trim(model, bitpack=bitpack):
        yield


def _trim_options(model: nn.Module, trim: Optional[bool], bitpack: Optional[bool]) -> tuple[Any, Optional[bool]]:
    """(the trim handle installed on ``model`` or None, the plan's bitpack: None for a plan without
    trim). Every combination that would make the figures wrong for the model is refused."""
    from ..auditing import trimmed_now

    for name, value in (("trim", trim), ("bitpack", bitpack)):
        if value is not None and not isinstance(value, bool):
            raise GradauditError(f"{name} must be True, False or None, not {value!r}")
    installed = None
    if trimmed_now(model):
        from ..trimming.handle import handle_of

        installed = handle_of(model)
    if trim is None:
        trim = installed is not None
    if not trim:
        if installed is not None:
            raise GradauditError("gradaudit.trim is installed on this model, so it holds less than a plan without "
                                 "trim says: plan with trim=True (--trim), or remove the trim handle first")
        if bitpack is not None:
            raise GradauditError(f"bitpack={bitpack} is an option of trim: pass trim=True with it (--trim)")
        return None, None
    if installed is not None:
        if bitpack is not None and bitpack != installed.bitpack:
            raise GradauditError(f"gradaudit.trim is installed on this model with bitpack={installed.bitpack}: plan "
                                 f"with bitpack={installed.bitpack}, or remove the trim handle first")
        return installed, installed.bitpack
    torchapi.require("node creation hook", "gradaudit.plan(trim=True)")  # now, not after the audit
    return None, True if bitpack is None else bitpack


_WHOLE = "whole"  # a save that holds its whole storage (see _saves_as_trimmed)


def _saves_as_trimmed(report: Any, bitpack: Optional[bool]) -> dict[int, Any]:
    """What holds each counted save's bytes, by ``SavedTensor.index``: ``_WHOLE`` (its storage),
    ``None`` (nothing: trim drops it) or the key of its bit-packed view (trim bit-packs it). Without
    trim (``bitpack`` None) every save is whole.

    Trim decides from the op knowledge the audit's verdicts come from, so it drops the saves the
    audit calls not needed and (with bitpack) bit-packs the bit-packable ones; a save that
    bypassed saved-tensor hooks (a wrapped Python number) it never sees. Only activations count as
    freed, as in the audit's own figure (``Accountant.freed_by_storage``: parameters, buffers and
    inputs are alive anyway, and so is a model output the caller holds)."""
    decided: dict[int, Any] = {}
    for t in counted(report.tensors):
        if bitpack is None or t.source_index < 0 or report.storages[t.storage_id].kind != StorageKind.ACTIVATION:
            decided[t.index] = _WHOLE
        elif t.verdict == NOT_NEEDED:
            decided[t.index] = None
        elif bitpack and t.bitpackable:
            decided[t.index] = (t.storage_id, t.storage_offset, tuple(t.shape), tuple(t.stride))
        else:
            decided[t.index] = _WHOLE
    return decided


def _held_by_report(report: Any, bitpack: Optional[bool]) -> int:
    """What the audited forward holds (with trim where ``bitpack`` is not None), by the audit's own
    accounting: saved_bytes less what trim's drops and bit-packing free (``Accountant.freed``)."""
    if bitpack is None:
        return report.saved_bytes
    decided = _saves_as_trimmed(report, bitpack)
    dropped = {i for i, how in decided.items() if how is None}
    packed = {i for i, how in decided.items() if how is not None and how != _WHOLE}
    return report.saved_bytes - Accountant(report.tensors, report.storages).freed(dropped, packed)


def _chain(report: Any, ran: Sequence[str], calls: dict[str, list], costs: dict[str, tuple[int, int]],
           bitpack: Optional[bool]) -> Chain:
    """The planner's chain of the blocks ``ran`` (forward order) from one audit: per storage of a held
    kind, which saves hold it, inside which block, whole or (under trim) as a bit-packed copy.
    ``costs``: per block, what recomputing it costs and what an op-level checkpoint does not redo."""
    nbytes = {s.id: s.nbytes for s in report.storages if s.kind in HELD_KINDS}
    for call in report.module_calls:
        for sid, size, kind in call.inputs:
            if kind in HELD_KINDS:
                nbytes[sid] = size
    decided = _saves_as_trimmed(report, bitpack)
    copies: dict[tuple, int] = {}  # bit-packed view -> copy id
    bits: dict[int, tuple[int, int]] = {}
    # per block (None: outside every block), the storages held whole and the copies held
    whole: dict[Optional[str], set[int]] = {path: set() for path in [None, *ran]}
    packed: dict[Optional[str], set[int]] = {path: set() for path in [None, *ran]}
    tensors = {t.index: t for t in report.tensors}
    for index, how in decided.items():
        t = tensors[index]
        if t.storage_id not in nbytes or how is None:
            continue
        # a save that bypassed saved-tensor hooks (a wrapped Python number: autograd keeps those
        # plainly) stays held inside a checkpoint too: it is not the block's to drop
        block = next((p for p in ran if _inside(t.module, p)), None) if t.source_index >= 0 else None
        if how == _WHOLE:
            whole[block].add(t.storage_id)
        else:
            copy = copies.setdefault(how, len(copies))
            bits[copy] = (t.storage_id, packed_bits_nbytes(t))
            packed[block].add(copy)
    blocks = [Block(path, calls[path][0].module_class, len(calls[path]), costs[path][0], frozenset(whole[path]),
                    frozenset(sid for call in calls[path] for sid, _, kind in call.inputs if kind in HELD_KINDS),
                    kept_flops=costs[path][1], packed=frozenset(packed[path]))
              for path in ran]
    return Chain(blocks, nbytes, frozenset(whole[None]), bits=bits, outside_packed=frozenset(packed[None]))


def plan(
    model: nn.Module,
    inputs: Any,
    budget: Union[int, str],
    *,
    trainable: Optional[Sequence[str]] = None,
    frozen: Optional[Sequence[str]] = None,
    blocks: Optional[Sequence[str]] = None,
    target: Optional[str] = None,
    selective: bool = True,
    bound: str = HELD_BOUND,
    measure_peak: bool = True,
    cost: str = "flops",
    trim: Optional[bool] = None,
    bitpack: Optional[bool] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> Plan:
    """Choose which modules of ``model`` to checkpoint so that autograd holds at most ``budget``
    bytes after the forward on ``inputs``, for the least recompute.

    budget: bytes (int) or a size such as "8GiB", "500MB".
    trainable / frozen: what-if requires_grad patterns, as for ``audit``.
    blocks: glob patterns over module paths to consider (default: ``repeated_blocks(model)``).
    target: on the meta device, the device type the figures are for ("cpu", the default, or "cuda"),
        as for ``audit``.
    selective: also consider checkpointing a block op by op (keep the outputs of its matrix products,
        convolutions and attention, recompute the rest) where that beats recomputing all of it.
    bound: what ``budget`` bounds: "held" (bytes held after the forward, exact by the audit) or
        "peak" (the peak of one training step, measured: the cheapest frontier point whose peak
        fits, found by bisection with a step run per probe, about log2 of the frontier's size).
    measure_peak: run the chosen plan's step, the unplanned step and the baselines' once each on the
        model's device to measure their peaks (``Plan.peak_bytes``; on meta nothing is computed).
    cost: what a checkpointed block costs, which the plan minimises: "flops" (its forward FLOPs, as
        torch.utils.flop_counter counts them; any device) or "time" (its forward time measured on the
        model's device, all its calls: the median of timing.REPEATS runs after a warm-up, like one
        whole step's; a real device only). ``Plan.frontier`` and ``extra_compute`` are in its units.
    trim: plan the bytes that remain with ``gradaudit.trim`` installed: every figure (held, unplanned,
        frontier, baselines, blocks, peaks) is what the model holds with trim and the plan, and
        ``Plan.apply`` installs trim too where it is not installed. None (the default) follows the
        model: with trim installed on it, as True (with its bitpack); without, as False. trim=False
        on a trimmed model raises GradauditError (its figures would be wrong for it).
    bitpack: trim's option (default True, or the installed handle's); only with trim.

    Raises BudgetError when no plan of the blocks fits (its ``smallest`` says how low they go).
    The model is left as found; ``Plan.apply(model)`` checkpoints the chosen modules.
    """
    from ..auditing import audit, meta_inputs, runs_on_meta
    from ..loading import parse_size
    from ..values import is_assumption_note
    from ..tensors import first_meta_parameter, iter_tensors

    if not isinstance(model, nn.Module):
        raise GradauditError(f"plan() needs a torch.nn.Module, got {type(model).__name__}")
    inputs = meta_inputs(model, inputs)  # CPU token ids and masks beside a meta model
    timing.check_cost(cost, runs_on_meta(first_meta_parameter(model.parameters()), list(iter_tensors(inputs))))
    budget_bytes = _budget_bytes(budget, parse_size)
    if bound not in (HELD_BOUND, PEAK_BOUND):
        raise GradauditError(f"bound must be {HELD_BOUND!r} or {PEAK_BOUND!r}, not {bound!r}")
    if bound == PEAK_BOUND and not measure_peak:
        raise GradauditError("bound='peak' chooses by measured peaks: it cannot run with measure_peak=False")
    installed, bitpack = _trim_options(model, trim, bitpack)
    paths = _candidates(model, blocks)
    if progress:
        progress(f"auditing the forward ({len(paths)} candidate blocks)")
    report = audit(model, inputs, trainable=trainable, frozen=frozen, watch=paths, target=target)
    now = _checkpointed_now(report)
    current_held = None
    if now:
        # plan from what the model holds without its own checkpointing (which the plan replaces)
        current_held = _held_by_report(report, bitpack)
        if progress:
            progress("auditing the forward without the model's own checkpointing")
        with torchapi.checkpointing_off():
            report = audit(model, inputs, trainable=trainable, frozen=frozen, watch=paths, target=target)
        if _checkpointed_now(report):
            raise GradauditError(f"the model checkpoints ({_few(now)}) in a way gradaudit cannot turn off to plan "
                                 f"from what it would hold; turn it off and plan again")

    def own_checkpointing_off() -> Any:
        return torchapi.checkpointing_off() if now else contextlib.nullcontext()

    opaque = next((c for c in report.module_calls if c.opaque), None)
    if opaque is not None:
        raise GradauditError(f"{opaque.path} is passed a {opaque.opaque[0]} holding tensors: a checkpoint would keep it "
                             f"out of every figure's sight, and recomputing the block would use it again. Pass "
                             f"tensors instead (Hugging Face: use_cache=False for training)")
    if progress:
        progress("counting FLOPs")
    with own_checkpointing_off():
        flops, step_flops = _flops(model, inputs, trainable, frozen, report.target, paths)
    nanoseconds: dict[str, int] = {}
    step_seconds = None
    if cost == "time":
        if progress:
            progress(f"timing the forward of {len(paths)} blocks and a step on {report.device} "
                     f"({timing.REPEATS} runs each, after a warm-up)")
        with own_checkpointing_off(), _as_audited(model, inputs, trainable, frozen, report.target):
            nanoseconds, step_nanoseconds = timing.measure(model, inputs, paths)
        step_seconds = step_nanoseconds / 1e9

    calls: dict[str, list] = {}
    for call in report.module_calls:
        calls.setdefault(call.path, []).append(call)
    order = {call.path: i for i, call in reversed(list(enumerate(report.module_calls)))}
    ran = sorted((p for p in paths if p in calls), key=order.__getitem__)
    # a block in which no autograd node was made (frozen, its inputs needing no gradient) builds no
    # graph: a checkpoint of it holds nothing (no node keeps its inputs) and backward never
    # recomputes it, so checkpointing it changes nothing
    made = [n.module for n in report.nodes if n.name != "AccumulateGrad"]
    graphless = [p for p in ran if not any(_inside(module, p) for module in made)]
    ran = [p for p in ran if p not in graphless]
    chain = _chain(report, ran, calls, {path: (nanoseconds.get(path, 0), 0) if cost == "time" else flops.get(path, (0, 0))
                                        for path in ran}, bitpack)
    chain_blocks = chain.blocks
    # the solver minimises the integer it is given as a block's cost: FLOPs, or nanoseconds
    # (op-level checkpointing is costed in FLOPs only: with time, whole blocks)
    costs = _Costs(tuple(flops.get(b.path, (0, 0))[0] for b in chain_blocks),
                   tuple(flops.get(b.path, (0, 0))[1] for b in chain_blocks),
                   tuple(nanoseconds.get(b.path, 0) for b in chain_blocks) if cost == "time" else None)
    # a value the model read on meta that nobody knew was assumed: the plan's figures rest on it too
    notes = [note for note in report.notes if is_assumption_note(note)]
    unplanned = _held_by_report(report, bitpack)
    if chain.held(()) != unplanned:  # both count the held saves' storages of held kinds, as trim leaves them
        raise AssertionError(f"planner: the chain holds {chain.held(())} bytes unplanned, the audit {unplanned}")
    if selective and cost == "time" and any(costs.kept):
        notes.append("op-level checkpointing left out: its recompute is costed in FLOPs, and this plan minimises "
                     "measured time (cost='flops' considers it)")
    elif selective and any(b.kept_flops for b in chain_blocks) and not torchapi.has("selective checkpoint cache"):
        notes.append(f"op-level checkpointing left out: this torch ({torch.__version__}) hides what a selective "
                     f"checkpoint keeps from the audit, so its bytes could not be counted")
    elif selective and any(b.kept_flops for b in chain_blocks):
        if progress:
            progress("auditing the forward with every block checkpointed selectively")
        with own_checkpointing_off():
            note = _add_selective(chain, report, lambda policies: _audited_with(
                model, inputs, trainable, frozen, target, paths, policies, bitpack),
                lambda other: _held_by_report(other, bitpack))
        if note:
            notes.append(note)
    chain_blocks = chain.blocks
    if graphless:
        notes.append(f"{len(graphless)} block(s) build no autograd graph ({_few(graphless)}): no gradient flows "
                     f"through them, so they hold nothing and checkpointing them would change nothing")
    uncounted = sum(c.uncounted for c in report.module_calls)
    if uncounted:
        notes.append(f"{uncounted} tensor(s) passed to blocks have no single storage (sparse): a checkpoint "
                     f"of those blocks holds them too, and no figure counts them")
    if progress:
        progress(f"solving ({len(chain_blocks)} blocks)")
    points, optimal = solve(chain)
    if chain.assumed:
        notes.append(f"{sum(chain.assumed.values())} bytes in {len(chain.assumed)} storage(s) are shared by "
                     f"blocks that are not neighbours: the solver counted them as always held, so a cheaper "
                     f"plan may exist (the bytes of every plan shown are exact)")
    frontier = tuple((p.held_bytes, costs.extra(p.chosen, p.selective)) for p in points)
    info = tuple({"path": b.path, "module_class": b.module_class, "calls": b.calls, "flops": costs.flops[i],
                  "kept_flops": costs.kept[i], "seconds": costs.extra_seconds([i]),
                  "internal_bytes": chain.bytes_of(b.internal, b.packed), "input_bytes": chain.bytes_of(b.inputs),
                  "cached_bytes": None if b.cached is None else chain.bytes_of(b.cached - b.inputs)}
                 for i, b in enumerate(chain_blocks))
    if installed is not None and trim is None:
        notes.append(f"gradaudit.trim is installed on this model (bitpack={bitpack}), so the plan's figures are "
                     f"with it, as trim=True plans them; to plan without trim, remove its handle first")
    if now:
        notes.insert(0, f"the model checkpoints {_few(now)} itself and so holds {current_held} bytes; the plan "
                        f"replaces that (its figures are without it): turn the model's own checkpointing off before "
                        f"applying it (Hugging Face: model.gradient_checkpointing_disable())")

    # the sqrt(n) segments baseline, where the blocks are one nn.Sequential's children (and the model
    # does not checkpoint itself: its regions would be turned off while planning, not these)
    fixed: tuple[Baseline, ...] = ()
    applying: dict[str, Callable[[], Any]] = {}
    in_segments: Optional[Callable[[int], Any]] = None
    parent = segments.sequential_parent(model, paths) if not now and len(paths) >= 4 else None
    if parent is not None:
        container = model.get_submodule(parent) if parent else model
        in_segments = functools.partial(segments.segmented, container)
    elif not now and len(paths) >= 4 and segments.looped_stack(
            model, paths, [c for c in report.module_calls if c.path in set(paths)]):
        in_segments = functools.partial(segments.loop_segmented, [model.get_submodule(p) for p in paths])
    if in_segments is not None:
        if progress:
            progress("auditing the forward in sqrt(n) segments")
        try:
            baseline, applied = _segments_baseline(model, inputs, trainable, frozen, target, chain, costs, paths,
                                                   in_segments, bitpack)
        except segments.NotSegmentable as error:  # the loop passed a block other tensors than the audit suggested
            notes.append(f"no sqrt(n) segments baseline: {error}")
        else:
            applying[baseline.name] = applied
            fixed = (baseline,)
    elif len(paths) >= 4:
        notes.append("no sqrt(n) segments baseline: these blocks are neither the children of one nn.Sequential run by "
                     "its own forward nor a stack a loop runs passing each block its predecessor's result")

    def make(point: Point) -> Plan:
        return Plan(model=type(model).__name__, device=report.device, target=report.target, budget=budget_bytes,
                    held_bytes=point.held_bytes, unplanned_held_bytes=chain.held(()),
                    extra_flops=costs.extra_flops(point.chosen, point.selective), step_flops=step_flops,
                    checkpointed=tuple(chain_blocks[i].path for i in sorted(point.chosen)), blocks=info,
                    selective=tuple(chain_blocks[i].path for i in sorted(point.selective)),
                    frontier=frontier, baselines=_baselines(chain, costs, budget_bytes) + fixed, optimal=optimal,
                    notes=list(notes), replaces=tuple(now), current_held_bytes=current_held, cost=cost,
                    extra_seconds=costs.extra_seconds(point.chosen), step_seconds=step_seconds,
                    trimmed=bitpack is not None, bitpack=bitpack, _solved=(chain, points, costs, fixed),
                    bound=bound, _point=point)

    model_ref = weakref.ref(model)
    measured: dict[Any, tuple[int, int]] = {}  # (held, peak) of each step run, by what was applied

    def planned(paths_run: tuple[str, ...], selective_run: tuple[str, ...] = ()) -> Callable[[], Any]:
        return lambda: PlanHandle(model_ref(), paths_run, {path: SELECTIVE_POLICY for path in selective_run},
                                  trim=bitpack)

    def measure(key: Any, applied: Callable[[], Any], what: str) -> int:
        if key not in measured:
            if model_ref() is None:
                raise GradauditError("the model this plan was made for is gone: plan again to measure peaks")
            if progress:
                progress(f"measuring the peak of a step ({what})")
            with own_checkpointing_off():
                measured[key] = _step(model_ref(), inputs, trainable, frozen, report.target, applied)
        return measured[key][1]

    def peak_of(point: Optional[Point]) -> int:
        """The measured peak of a frontier point's step (None: of the unplanned step)."""
        paths_run = tuple(chain_blocks[i].path for i in sorted(point.chosen)) if point is not None else ()
        selective_run = tuple(chain_blocks[i].path for i in sorted(point.selective)) if point is not None else ()
        return measure((paths_run, selective_run), planned(paths_run, selective_run),
                       f"{len(paths_run)} of {len(chain_blocks)} blocks checkpointed")

    if bound == PEAK_BOUND:
        index = _by_peak(points, budget_bytes, peak_of, 0)
        chosen = points[index] if index is not None else None
    else:
        chosen = cheapest_within(points, budget_bytes)
    result = make(chosen if chosen is not None else points[-1])
    result._solved = (*result._solved, peak_of)
    if measure_peak:
        result.peak_bytes = peak_of(result._point)
        result.unplanned_peak_bytes = peak_of(None)  # (the frontier's first point may recompute for free)
        result.baselines = tuple(dataclasses.replace(b, peak_bytes=measure(
            (b.name,), applying[b.name], b.name) if b.name in applying else measure(
            (b.checkpointed, ()), planned(b.checkpointed), b.name)) for b in result.baselines)
    if chosen is None:
        raise _budget_error(result, len(chain_blocks))
    return result


def _by_peak(points: Sequence[Point], budget: int, peak_of: Callable[[Point], int], start: int) -> Optional[int]:
    """The index of the cheapest frontier point from ``start`` on whose measured peak is at most
    ``budget``, by bisection: the frontier's points hold less and less after the forward, and the
    peak is taken to fall with them (each probe is measured, and so is the answer: a plan chosen
    this way fits). None when the last point's peak does not fit."""
    if peak_of(points[start]) <= budget:
        return start
    low, high = start, len(points) - 1  # low does not fit
    if high == low or peak_of(points[high]) > budget:
        return None
    while high - low > 1:
        middle = (low + high) // 2
        if peak_of(points[middle]) <= budget:
            high = middle
        else:
            low = middle
    return high


def _baselines(chain: Chain, costs: _Costs, budget: int) -> tuple[Baseline, ...]:
    """What a user would otherwise pick: nothing, every block (Hugging Face's
    gradient_checkpointing_enable()), and every n-th block for the largest n that fits the budget
    (or 2 when none does)."""
    n = len(chain.blocks)

    def baseline(name: str, chosen: Sequence[int]) -> Baseline:
        return Baseline(name, tuple(chain.blocks[i].path for i in chosen), chain.held(chosen),
                        costs.extra_flops(chosen), extra_seconds=costs.extra_seconds(chosen))

    found = [baseline("none", []), baseline("every block", range(n))]
    if n >= 4:
        step = next((k for k in range(n // 2, 1, -1) if chain.held(range(0, n, k)) <= budget), 2)
        found.append(baseline(f"every {step} blocks", range(0, n, step)))
    return tuple(found)
