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
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from .. import torchapi
from ..accounting import counted
from ..errors import GradauditError
from ..recorder import CHECKPOINT_INPUTS
from ..records import HELD_KINDS, Manager
from . import timing
from .apply import PlanHandle
from .solve import Block, Chain, Point, cheapest_within, solve

# 2: the cost (FLOPs or measured time) is chosen: ``cost``, ``extra_seconds``, ``step_seconds``;
# ``extra_compute`` and the frontier's entries are in the cost's units
PLAN_SCHEMA_VERSION = 2

__all__ = ["plan", "Plan", "PlanHandle", "BudgetError", "Baseline", "repeated_blocks"]


class BudgetError(GradauditError):
    """No plan of the candidate blocks holds at most the budget. ``smallest`` is the least any
    plan holds (``smallest_plan`` the plan that does)."""

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
    """Each chain block's forward FLOPs and, with cost="time", its measured forward nanoseconds:
    the figures of any set of blocks, whichever of the two the solver minimised."""

    flops: tuple[int, ...]
    nanoseconds: Optional[tuple[int, ...]] = None

    def extra_flops(self, chosen: Iterable[int]) -> int:
        return sum(self.flops[i] for i in set(chosen))

    def extra_seconds(self, chosen: Iterable[int]) -> Optional[float]:
        if self.nanoseconds is None:
            return None
        return sum(self.nanoseconds[i] for i in set(chosen)) / 1e9

    def extra(self, chosen: Iterable[int]) -> Union[int, float]:
        """In the cost's units: FLOPs, or seconds with cost="time"."""
        seconds = self.extra_seconds(chosen)
        return self.extra_flops(chosen) if seconds is None else seconds


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
    # what the solver minimised: "flops" (forward FLOPs, counted) or "time" (forward time, measured
    # on the model's device: the median of timing.REPEATS runs); with "time", the seconds the
    # recomputation adds per step and one unplanned step's (None with "flops")
    cost: str = "flops"
    extra_seconds: Optional[float] = None
    step_seconds: Optional[float] = None
    # the solver's chain, frontier and the blocks' costs, for for_budget (not part of the plan's data)
    _solved: Any = field(default=None, repr=False, compare=False)

    def for_budget(self, budget: Union[int, str]) -> "Plan":
        """The plan for another budget, from the same audit and frontier (instant: nothing runs
        again; its peak is not measured). Raises BudgetError when nothing fits."""
        from ..loading import parse_size

        budget_bytes = _budget_bytes(budget, parse_size)
        chain, points, costs = self._solved
        point = cheapest_within(points, budget_bytes)
        chosen = point if point is not None else points[-1]
        other = dataclasses.replace(
            self, budget=budget_bytes, held_bytes=chosen.held_bytes, extra_flops=costs.extra_flops(chosen.chosen),
            extra_seconds=costs.extra_seconds(chosen.chosen),
            checkpointed=tuple(chain.blocks[i].path for i in sorted(chosen.chosen)),
            baselines=_baselines(chain, costs, budget_bytes), peak_bytes=None, unplanned_peak_bytes=None,
            notes=list(self.notes))
        if point is None:
            raise _budget_error(other, len(chain.blocks))
        return other

    @property
    def fits(self) -> bool:
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
        """Checkpoint the planned modules of ``model`` (non-reentrant ``torch.utils.checkpoint``);
        returns a handle: ``remove()`` or ``with plan.apply(model): ...`` restores it."""
        if self.replaces and getattr(model, "is_gradient_checkpointing", False):
            raise GradauditError("this plan replaces the model's own checkpointing, which is still on: turn it off "
                                 "first (model.gradient_checkpointing_disable())")
        return PlanHandle(model, self.checkpointed)

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
            "checkpointed": list(self.checkpointed),
            "optimal": self.optimal,
            "blocks": [dict(b) for b in self.blocks],
            # the key names the cost's units
            "frontier": [{"held_bytes": h, "extra_seconds" if self.cost == "time" else "extra_flops": c}
                         for h, c in self.frontier],
            "baselines": [b.to_dict() for b in self.baselines],
            "notes": list(self.notes),
        }

    def __repr__(self) -> str:
        return (f"<gradaudit.Plan {self.model}: checkpoint {len(self.checkpointed)} of {len(self.blocks)} "
                f"blocks, holds {self.held_bytes} of budget {self.budget} bytes, "
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
    from ..tensors import iter_tensors

    tensors = list(iter_tensors(inputs))
    on_meta = runs_on_meta(next(iter(model.parameters()), None), tensors)
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


def _flops(model: nn.Module, inputs: Any, trainable: Any, frozen: Any, target: str,
           paths: Sequence[str]) -> tuple[dict[str, int], int]:
    """Forward FLOPs of each module in ``paths`` (all its calls) and of one whole step (forward
    and backward), as torch.utils.flop_counter counts them; the model is left as found."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..tensors import iter_tensors, split_inputs, unique

    args, kwargs = split_inputs(inputs)
    with _as_audited(model, inputs, trainable, frozen, target):
        with FlopCounterMode(display=False) as forward:
            output = model(*args, **kwargs)
        outputs = unique([t for t in iter_tensors(output) if t.requires_grad and t.grad_fn is not None])
        with FlopCounterMode(display=False) as backward:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        del output, outputs
    counts = forward.get_flop_counts()
    root = type(model).__name__
    per_module = {path: sum(counts.get(f"{root}.{path}", {}).values()) for path in paths}
    step = forward.get_total_flops() + backward.get_total_flops()
    return per_module, step


def _step(model: nn.Module, inputs: Any, trainable: Any, frozen: Any, target: str,
          paths: Sequence[str]) -> tuple[int, int]:
    """(held after the forward less the outputs, peak through forward and backward) of one step with ``paths``
    checkpointed, measured on the model's device: the storage tracker on CPU and meta (where it
    follows the meta tensors the step would allocate), the allocator on CUDA. Left as found."""
    from ..measure import forward_backward
    from ..tensors import split_inputs

    args, kwargs = split_inputs(inputs)
    with _as_audited(model, inputs, trainable, frozen, target):
        with PlanHandle(model, tuple(paths)):
            return forward_backward(model, args, kwargs)


def plan(
    model: nn.Module,
    inputs: Any,
    budget: Union[int, str],
    *,
    trainable: Optional[Sequence[str]] = None,
    frozen: Optional[Sequence[str]] = None,
    blocks: Optional[Sequence[str]] = None,
    target: Optional[str] = None,
    measure_peak: bool = True,
    cost: str = "flops",
    progress: Optional[Callable[[str], None]] = None,
) -> Plan:
    """Choose which modules of ``model`` to checkpoint so that autograd holds at most ``budget``
    bytes after the forward on ``inputs``, for the least recompute.

    budget: bytes (int) or a size such as "8GiB", "500MB".
    trainable / frozen: what-if requires_grad patterns, as for ``audit``.
    blocks: glob patterns over module paths to consider (default: ``repeated_blocks(model)``).
    target: on the meta device, the device type the figures are for ("cpu", the default, or "cuda"),
        as for ``audit``.
    measure_peak: run the chosen plan's step, the unplanned step and the baselines' once each on the
        model's device to measure their peaks (``Plan.peak_bytes``; on meta nothing is computed).
    cost: what a checkpointed block costs, which the plan minimises: "flops" (its forward FLOPs, as
        torch.utils.flop_counter counts them; any device) or "time" (its forward time measured on the
        model's device, all its calls: the median of timing.REPEATS runs after a warm-up, like one
        whole step's; a real device only). ``Plan.frontier`` and ``extra_compute`` are in its units.

    Raises BudgetError when no plan of the blocks fits (its ``smallest`` says how low they go).
    The model is left as found; ``Plan.apply(model)`` checkpoints the chosen modules.
    """
    from ..auditing import audit, runs_on_meta
    from ..loading import parse_size
    from ..tensors import iter_tensors

    if not isinstance(model, nn.Module):
        raise GradauditError(f"plan() needs a torch.nn.Module, got {type(model).__name__}")
    timing.check_cost(cost, runs_on_meta(next(iter(model.parameters()), None), list(iter_tensors(inputs))))
    budget_bytes = _budget_bytes(budget, parse_size)
    paths = _candidates(model, blocks)
    if progress:
        progress(f"auditing the forward ({len(paths)} candidate blocks)")
    report = audit(model, inputs, trainable=trainable, frozen=frozen, watch=paths, target=target)
    now = _checkpointed_now(report)
    current_held = None
    if now:
        # plan from what the model holds without its own checkpointing (which the plan replaces)
        current_held = report.saved_bytes
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

    nbytes = {s.id: s.nbytes for s in report.storages if s.kind in HELD_KINDS}
    held = counted(report.tensors)
    calls: dict[str, list] = {}
    for call in report.module_calls:
        calls.setdefault(call.path, []).append(call)
        for sid, size, kind in call.inputs:
            if kind in HELD_KINDS:
                nbytes[sid] = size
    order = {call.path: i for i, call in reversed(list(enumerate(report.module_calls)))}
    ran = sorted((p for p in paths if p in calls), key=order.__getitem__)
    # a block in which no autograd node was made (frozen, its inputs needing no gradient) builds no
    # graph: a checkpoint of it holds nothing (no node keeps its inputs) and backward never
    # recomputes it, so checkpointing it changes nothing
    made = [n.module for n in report.nodes if n.name != "AccumulateGrad"]
    graphless = [p for p in ran if not any(_inside(module, p) for module in made)]
    ran = [p for p in ran if p not in graphless]
    chain_blocks = []
    outside = {t.storage_id for t in held if t.storage_id in nbytes}
    for path in ran:
        # a save that bypassed saved-tensor hooks (a wrapped Python number: autograd keeps those
        # plainly) stays held inside a checkpoint too: it is not the block's to drop
        internal = frozenset(t.storage_id for t in held if t.storage_id in nbytes and t.source_index >= 0
                             and _inside(t.module, path))
        passed = frozenset(sid for call in calls[path] for sid, _, kind in call.inputs if kind in HELD_KINDS)
        outside -= internal
        # the solver minimises the integer it is given as a block's cost: FLOPs, or nanoseconds
        chain_blocks.append(Block(path, calls[path][0].module_class, len(calls[path]),
                                  nanoseconds.get(path, 0) if cost == "time" else flops.get(path, 0),
                                  internal, passed))
    chain = Chain(chain_blocks, nbytes, frozenset(outside))
    costs = _Costs(tuple(flops.get(b.path, 0) for b in chain_blocks),
                   tuple(nanoseconds.get(b.path, 0) for b in chain_blocks) if cost == "time" else None)
    notes = []
    if chain.held(()) != report.saved_bytes:  # both count the held saves' storages of held kinds
        raise AssertionError(f"planner: the chain holds {chain.held(())} bytes unplanned, the audit "
                             f"{report.saved_bytes}")
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
    frontier = tuple((p.held_bytes, costs.extra(p.chosen)) for p in points)
    info = tuple({"path": b.path, "module_class": b.module_class, "calls": b.calls, "flops": costs.flops[i],
                  "seconds": costs.extra_seconds([i]),
                  "internal_bytes": sum(nbytes[s] for s in b.internal),
                  "input_bytes": sum(nbytes[s] for s in b.inputs)} for i, b in enumerate(chain_blocks))

    from ..auditing import trimmed_now

    if trimmed_now(model):
        notes.append("gradaudit.trim is installed on this model: the plan's figures are without it (planning on top "
                     "of trim is not supported yet); trim with the plan applied holds less than held_bytes")
    if now:
        notes.insert(0, f"the model checkpoints {_few(now)} itself and so holds {current_held} bytes; the plan "
                        f"replaces that (its figures are without it): turn the model's own checkpointing off before "
                        f"applying it (Hugging Face: model.gradient_checkpointing_disable())")

    def make(point: Point) -> Plan:
        return Plan(model=type(model).__name__, device=report.device, target=report.target, budget=budget_bytes,
                    held_bytes=point.held_bytes, unplanned_held_bytes=report.saved_bytes,
                    extra_flops=costs.extra_flops(point.chosen), step_flops=step_flops,
                    checkpointed=tuple(chain_blocks[i].path for i in sorted(point.chosen)), blocks=info,
                    frontier=frontier, baselines=_baselines(chain, costs, budget_bytes), optimal=optimal,
                    notes=list(notes), replaces=tuple(now), current_held_bytes=current_held, cost=cost,
                    extra_seconds=costs.extra_seconds(point.chosen), step_seconds=step_seconds,
                    _solved=(chain, points, costs))

    chosen = cheapest_within(points, budget_bytes)
    result = make(chosen if chosen is not None else points[-1])
    if measure_peak:
        steps = [result.checkpointed, *[b.checkpointed for b in result.baselines]]
        measured: dict[tuple[str, ...], tuple[int, int]] = {}
        for k, paths_run in enumerate(steps):
            if paths_run not in measured:
                if progress:
                    progress(f"measuring the peak of a step ({k + 1} of {len(steps)})")
                with own_checkpointing_off():
                    measured[paths_run] = _step(model, inputs, trainable, frozen, report.target, paths_run)
        result.peak_bytes = measured[result.checkpointed][1]
        result.unplanned_peak_bytes = measured[()][1]
        result.baselines = tuple(dataclasses.replace(b, peak_bytes=measured[b.checkpointed][1])
                                 for b in result.baselines)
    if chosen is None:
        raise _budget_error(result, len(chain_blocks))
    return result


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
