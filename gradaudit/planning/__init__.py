"""Plan activation checkpointing to a memory budget: which modules to recompute in backward
instead of holding what their ops save, for the least extra compute.

    plan = gradaudit.plan(model, inputs, budget="8GiB", trainable=["model.layers.40.*"])
    plan.held_bytes, plan.extra_flops, plan.checkpointed
    with plan.apply(model):
        model(**inputs).loss.backward()

How it works: one audit of the model (any device, meta included) watching the candidate blocks
records every storage autograd holds, which block's ops hold it, and the storages each block is
passed; one more forward and backward under ``torch.utils.flop_counter.FlopCounterMode`` gives each
block's forward FLOPs (what recomputing it costs) and a whole step's. ``solve`` (solve.py) turns that
into the memory/compute frontier; the plan is its cheapest point within the budget.

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
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from .. import torchapi
from ..accounting import Accountant, counted, packed_bits_nbytes
from ..errors import GradauditError
from ..recorder import CHECKPOINT_INPUTS
from ..records import HELD_KINDS, NOT_NEEDED, Manager, StorageKind
from .apply import PlanHandle
from .solve import Block, Chain, Point, cheapest_within, solve

PLAN_SCHEMA_VERSION = 1

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

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "checkpointed": list(self.checkpointed), "held_bytes": self.held_bytes,
                "extra_flops": self.extra_flops, "peak_bytes": self.peak_bytes}


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
    blocks: tuple[dict[str, Any], ...]  # every candidate: path, class, calls, flops, bytes it holds and is passed
    frontier: tuple[tuple[int, int], ...]  # (held_bytes, extra_flops) of every Pareto plan, cheapest first
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
    # every figure above is with gradaudit.trim installed (with this bitpack option): apply installs it
    trimmed: bool = False
    bitpack: Optional[bool] = None  # trim's option; None without trim
    # the solver's frontier and chain, for for_budget (not part of the plan's data)
    _solved: Any = field(default=None, repr=False, compare=False)

    def for_budget(self, budget: Union[int, str]) -> "Plan":
        """The plan for another budget, from the same audit and frontier (instant: nothing runs
        again; its peak is not measured). Raises BudgetError when nothing fits."""
        from ..loading import parse_size

        budget_bytes = _budget_bytes(budget, parse_size)
        chain, points = self._solved
        point = cheapest_within(points, budget_bytes)
        chosen = point if point is not None else points[-1]
        other = dataclasses.replace(
            self, budget=budget_bytes, held_bytes=chosen.held_bytes, extra_flops=chosen.extra_flops,
            checkpointed=tuple(chain.blocks[i].path for i in sorted(chosen.chosen)),
            baselines=_baselines(chain, budget_bytes), peak_bytes=None, unplanned_peak_bytes=None,
            notes=list(self.notes))
        if point is None:
            raise _budget_error(other, len(chain.blocks))
        return other

    @property
    def fits(self) -> bool:
        return self.held_bytes <= self.budget

    @property
    def extra_compute(self) -> float:
        """Extra FLOPs as a fraction of an unplanned step's."""
        return self.extra_flops / self.step_flops if self.step_flops else 0.0

    def apply(self, model: nn.Module) -> PlanHandle:
        """Checkpoint the planned modules of ``model`` (non-reentrant ``torch.utils.checkpoint``) and,
        for a plan made with trim, install ``gradaudit.trim`` (with the plan's bitpack) unless it is
        installed already; returns a handle: ``remove()`` or ``with plan.apply(model): ...`` restores
        it (removing trim only where apply installed it)."""
        if self.replaces and getattr(model, "is_gradient_checkpointing", False):
            raise GradauditError("this plan replaces the model's own checkpointing, which is still on: turn it off "
                                 "first (model.gradient_checkpointing_disable())")
        return PlanHandle(model, self.checkpointed, trim=self.bitpack if self.trimmed else None)

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
            "extra_flops": self.extra_flops,
            "step_flops": self.step_flops,
            "extra_compute": self.extra_compute,
            "peak_bytes": self.peak_bytes,
            "unplanned_peak_bytes": self.unplanned_peak_bytes,
            "replaces": list(self.replaces),
            "current_held_bytes": self.current_held_bytes,
            "trim": {"bitpack": self.bitpack} if self.trimmed else None,
            "checkpointed": list(self.checkpointed),
            "optimal": self.optimal,
            "blocks": [dict(b) for b in self.blocks],
            "frontier": [{"held_bytes": h, "extra_flops": f} for h, f in self.frontier],
            "baselines": [b.to_dict() for b in self.baselines],
            "notes": list(self.notes),
        }

    def __repr__(self) -> str:
        return (f"<gradaudit.Plan {self.model}: checkpoint {len(self.checkpointed)} of {len(self.blocks)} "
                f"blocks, holds {self.held_bytes} of budget {self.budget} bytes{' with trim' if self.trimmed else ''}, "
                f"+{100 * self.extra_compute:.1f}% compute>")


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

    on_meta = runs_on_meta(next(iter(model.parameters()), None), list(iter_tensors(inputs)))
    state = ModelState(model)
    try:
        apply_trainable(model, trainable, frozen)
        with standing_for(target) if on_meta else contextlib.nullcontext():
            yield
    finally:
        state.restore()


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
          paths: Sequence[str], bitpack: Optional[bool] = None) -> tuple[int, int]:
    """(held after the forward less the outputs, peak through forward and backward) of one step with ``paths``
    checkpointed (and trim installed, where ``bitpack`` is not None), measured on the model's device:
    the storage tracker on CPU and meta (where it follows the meta tensors the step would allocate),
    the allocator on CUDA. Left as found."""
    from ..measure import forward_backward
    from ..tensors import split_inputs

    args, kwargs = split_inputs(inputs)
    with _as_audited(model, inputs, trainable, frozen, target):
        with PlanHandle(model, tuple(paths), trim=bitpack):
            return forward_backward(model, args, kwargs)


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


def _chain(report: Any, ran: Sequence[str], calls: dict[str, list], flops: dict[str, int],
           bitpack: Optional[bool]) -> Chain:
    """The planner's chain of the blocks ``ran`` (forward order) from one audit: per storage of a held
    kind, which saves hold it, inside which block, whole or (under trim) as a bit-packed copy."""
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
    blocks = [Block(path, calls[path][0].module_class, len(calls[path]), flops.get(path, 0),
                    frozenset(whole[path]),
                    frozenset(sid for call in calls[path] for sid, _, kind in call.inputs if kind in HELD_KINDS),
                    frozenset(packed[path]))
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
    measure_peak: bool = True,
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
    measure_peak: run the chosen plan's step, the unplanned step and the baselines' once each on the
        model's device to measure their peaks (``Plan.peak_bytes``; on meta nothing is computed).
    trim: plan the bytes that remain with ``gradaudit.trim`` installed: every figure (held, unplanned,
        frontier, baselines, blocks, peaks) is what the model holds with trim and the plan, and
        ``Plan.apply`` installs trim too where it is not installed. None (the default) follows the
        model: with trim installed on it, as True (with its bitpack); without, as False. trim=False
        on a trimmed model raises GradauditError (its figures would be wrong for it).
    bitpack: trim's option (default True, or the installed handle's); only with trim.

    Raises BudgetError when no plan of the blocks fits (its ``smallest`` says how low they go).
    The model is left as found; ``Plan.apply(model)`` checkpoints the chosen modules.
    """
    from ..auditing import audit
    from ..loading import parse_size

    if not isinstance(model, nn.Module):
        raise GradauditError(f"plan() needs a torch.nn.Module, got {type(model).__name__}")
    budget_bytes = _budget_bytes(budget, parse_size)
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
    chain = _chain(report, ran, calls, flops, bitpack)
    chain_blocks = chain.blocks
    notes = []
    unplanned = _held_by_report(report, bitpack)
    if chain.held(()) != unplanned:  # both count the held saves' storages of held kinds, as trim leaves them
        raise AssertionError(f"planner: the chain holds {chain.held(())} bytes unplanned, the audit {unplanned}")
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
    frontier = tuple((p.held_bytes, p.extra_flops) for p in points)
    info = tuple({"path": b.path, "module_class": b.module_class, "calls": b.calls, "flops": b.flops,
                  "internal_bytes": chain.bytes_of(b.internal, b.packed),
                  "input_bytes": chain.bytes_of(b.inputs)} for b in chain_blocks)
    if installed is not None and trim is None:
        notes.append(f"gradaudit.trim is installed on this model (bitpack={bitpack}), so the plan's figures are "
                     f"with it, as trim=True plans them; to plan without trim, remove its handle first")
    if now:
        notes.insert(0, f"the model checkpoints {_few(now)} itself and so holds {current_held} bytes; the plan "
                        f"replaces that (its figures are without it): turn the model's own checkpointing off before "
                        f"applying it (Hugging Face: model.gradient_checkpointing_disable())")

    def make(point: Point) -> Plan:
        return Plan(model=type(model).__name__, device=report.device, target=report.target, budget=budget_bytes,
                    held_bytes=point.held_bytes, unplanned_held_bytes=chain.held(()),
                    extra_flops=point.extra_flops, step_flops=step_flops,
                    checkpointed=tuple(chain_blocks[i].path for i in sorted(point.chosen)), blocks=info,
                    frontier=frontier, baselines=_baselines(chain, budget_bytes), optimal=optimal,
                    notes=list(notes), replaces=tuple(now), current_held_bytes=current_held,
                    trimmed=bitpack is not None, bitpack=bitpack,
                    _solved=(chain, points))

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
                    measured[paths_run] = _step(model, inputs, trainable, frozen, report.target, paths_run,
                                                bitpack)
        result.peak_bytes = measured[result.checkpointed][1]
        result.unplanned_peak_bytes = measured[()][1]
        result.baselines = tuple(dataclasses.replace(b, peak_bytes=measured[b.checkpointed][1])
                                 for b in result.baselines)
    if chosen is None:
        raise _budget_error(result, len(chain_blocks))
    return result


def _baselines(chain: Chain, budget: int) -> tuple[Baseline, ...]:
    """What a user would otherwise pick: nothing, every block (Hugging Face's
    gradient_checkpointing_enable()), and every n-th block for the largest n that fits the budget
    (or 2 when none does)."""
    n = len(chain.blocks)

    def baseline(name: str, chosen: Sequence[int]) -> Baseline:
        return Baseline(name, tuple(chain.blocks[i].path for i in chosen), chain.held(chosen),
                        chain.extra_flops(chosen))

    found = [baseline("none", []), baseline("every block", range(n))]
    if n >= 4:
        step = next((k for k in range(n // 2, 1, -1) if chain.held(range(0, n, k)) <= budget), 2)
        found.append(baseline(f"every {step} blocks", range(0, n, step)))
    return tuple(found)
