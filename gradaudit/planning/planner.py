"""``gradaudit.plan()``: the planner's steps in order, each a named function over the one before's
results: audit the candidate blocks, count (or time) what recomputing each costs, build the chain
and its selective option, solve the frontier, add the baselines, choose the cheapest point within
the budget and measure its peak.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from .. import torchapi
from ..auditing import audit
from ..conditions import as_audited, meta_inputs, prepare_data_parallel, resolve_target, runs_on_meta
from ..errors import GradauditError
from ..records import Bound, Cost, Report
from ..compiled import compiled_paths, compiled_regions
from ..torchapi.distributed import distributed_rank
from ..sizes import as_bytes
from ..tensors import first_meta_parameter, iter_tensors
from ..collecting import collecting_only_new
from ..torchapi.checkpoint import checkpointing_off
from ..values import is_assumption_note
from . import segments, timing
from .baselines import Baseline, BlockCosts, segments_baseline, stack_runner
from .candidates import called_repeatedly, candidates, inside, repeated_blocks
from .chain import add_selective, audited_with, build_chain, held_by_report, trim_changes
from .costs import Costs, count_flops
from .frontier import Frontier
from .peaks import PeakProbes
from .result import Plan, PlanSearch, budget_error
from .solve import Chain, Point, solve
from .switches import (CACHE_NOTE, cache_off, checkpointed_now, checkpointing_off_call, own_checkpointing_off,
                       trim_options)


@dataclass(frozen=True)
class _Run:
    """What every run of the planner is given: the model, its inputs, the audit's what-if and the
    target as the caller named it (``audit``'s argument; the audit's report says what it resolved to)."""

    model: nn.Module
    inputs: Any
    trainable: Any
    frozen: Any
    target: Optional[str]
    masks: str = "bits"  # trim's masks option, where the plan has trim
    loss: Optional[Callable[[Any], torch.Tensor]] = None  # what the measured steps backpropagate
    measured: bool = True  # measure_peak: the plan measures its steps' peaks


@dataclass
class _Audited:
    """The planner's audit: the report (of the model without its own checkpointing), the modules the
    model checkpoints itself (``checkpointed_now``) and what it holds with that (None without)."""

    report: Any
    now: list[str]
    current_held: Optional[int]


def _target_device(model: nn.Module, inputs: Any, target: Optional[str]) -> str:
    """The device type the plan is for (the audit's target, as ``audit`` resolves it)."""
    tensors = list(iter_tensors(inputs))
    first = first_meta_parameter(model.parameters())
    return resolve_target(target, runs_on_meta(first, tensors), ([first] if first is not None else []) + tensors)


@collecting_only_new()  # (its runs' garbage collections look at what it made, not at the model)
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
    bound: Union[str, Bound] = Bound.HELD,
    measure_peak: bool = True,
    cost: Union[str, Cost] = Cost.FLOPS,
    trim: Optional[bool] = None,
    bitpack: Optional[bool] = None,
    loss: Optional[Callable[[Any], torch.Tensor]] = None,
    progress: Optional[Callable[[str], None]] = None,
    masks: Optional[str] = None,
) -> Plan:
    """Choose which modules of ``model`` to checkpoint so that autograd holds at most ``budget``
    bytes after the forward on ``inputs``, for the least recompute.

    budget: bytes (int) or a size such as "8GiB", "500MB".
    trainable / frozen: what-if requires_grad patterns, as for ``audit``.
    blocks: glob patterns over module paths to consider (default: ``repeated_blocks(model)``).
    target: on the meta device, the device type the figures are for ("cpu", the default, or "cuda").
    selective: also consider checkpointing a block op by op (keep the outputs of its matrix products,
        convolutions and attention, recompute the rest) where that beats recomputing all of it.
    bound: what ``budget`` bounds: "held" (bytes held after the forward, exact by the audit) or
        "peak" (the peak of one training step, measured: the cheapest frontier point whose peak
        fits, found by bisection with a step run per probe, about log2 of the frontier's size).
    measure_peak: run the chosen plan's step, the unplanned step (which counts the FLOPs too, without
        trim) and the baselines' once each on the model's device to measure their peaks (``Plan.peak_bytes``).
    cost: what a checkpointed block costs, which the plan minimises: "flops" (its forward FLOPs, as
        torch.utils.flop_counter counts them; any device) or "time" (its forward time measured on the
        model's device, all its calls: the median of timing.REPEATS runs after a warm-up, like one
        whole step's; a real device only). ``Plan.frontier`` and ``extra_compute`` are in its units.
    trim: plan the bytes that remain with ``gradaudit.trim`` installed: every figure (held, unplanned,
        frontier, baselines, blocks, peaks) is what the model holds with trim and the plan, and
        ``Plan.apply`` installs trim too where it is not installed. None (the default) follows the
        model: with trim installed on it, as True (with its bitpack); without, as False. trim=False
        on a trimmed model raises GradauditError (its figures would be wrong for it).
    bitpack, masks: trim's options, with trim (True and "auto": bits for the CPU, bytes for CUDA; or the installed's).
    loss: a callable from the model's output to the scalar loss that the measured steps backpropagate,
        as a training loop does (default: the output's ``loss`` when it has one, as Hugging Face
        models given labels do, else the sum of its first tensor; as ``fit`` takes it).

    Raises BudgetError when no plan of the blocks fits (its ``smallest`` says how low they go). The
    model is left as found; ``Plan.apply(model)`` checkpoints the chosen modules."""
    with cache_off(model) as cache_was_on:  # (planned as Hugging Face's checkpointing trains: see CACHE_NOTE)
        inputs = meta_inputs(model, inputs)  # CPU token ids and masks beside a meta model keep their values
        budget_bytes, bound, cost = _checked_arguments(model, inputs, budget, bound, measure_peak, cost)
        installed, bitpack, masks = trim_options(model, trim, bitpack, masks, _target_device(model, inputs, target))
        say = progress or _silent
        run = _Run(model, inputs, trainable, frozen, target, masks, loss, measure_peak)
        paths, found = _candidates(run, blocks, say)
        audited = _audit(run, paths, bitpack, say)
        report, now = audited.report, audited.now
        probes = PeakProbes(model, inputs, trainable, frozen, report.target, (), bitpack, now, say, loss, masks)
        counted_in = probes.unplanned if measure_peak and bitpack is None else None  # (with trim: trim's ops)
        chained = _chain(run, report, paths, now, cost, bitpack, say, loss, counted_in)
        chain, costs = chained.chain, chained.costs
        probes.set_blocks([b.path for b in chain.blocks])
        points, optimal, notes = _solved(run, audited, chained, paths, selective, cost, bitpack, say,
                                         cache_was_on=cache_was_on, trim_installed=installed is not None and trim is None)
        fixed, applying, segment_notes = _segments(run, report, paths, now, chained, bitpack, say, probes)
        frontier = Frontier(chain, points, costs, fixed)
        chosen = frontier.cheapest(budget_bytes, 0, probes.peak if bound == Bound.PEAK else None)
        point = chosen if chosen is not None else points[-1]
        result = Plan(model=type(model).__name__, device=report.device, target=report.target,
                      unplanned_held_bytes=chain.held(()), step_flops=chained.step_flops, blocks=frontier.blocks(),
                      frontier=frontier.entries(), optimal=optimal, notes=found + notes + segment_notes, replaces=tuple(now),
                      current_held_bytes=audited.current_held, cost=cost, step_seconds=chained.step_seconds,
                      trimmed=bitpack is not None, bitpack=bitpack, masks=masks, bound=bound,
                      search=PlanSearch(frontier, point, probes, trim_changes(report)), **frontier.at(point, budget_bytes))
        if measure_peak:
            _measure_peaks(result, probes, applying)
        if chosen is None:
            raise budget_error(result, len(chain.blocks))
        return result


def _silent(step: str) -> None:
    """The progress callback when the caller gives none."""



@dataclass(frozen=True)
class _Chained:
    """The chain the solver plans over, its blocks' costs, one unplanned step's FLOPs and seconds
    (with cost="time"), and the candidates that ran without a graph."""

    chain: Chain
    costs: Costs
    step_flops: int
    step_seconds: Optional[float]
    graphless: Any
    written: Sequence[str] = ()  # candidates passed a tensor written in place: left out
    every: Optional[BlockCosts] = None  # every candidate's costs, by path (those left out of the chain too)


def _chain(run: _Run, report: Any, paths: Sequence[str], now: Sequence[str], cost: Cost, bitpack: Optional[bool],
           say: Callable[[str], None], loss: Any, counted_in: Optional[Callable[..., Any]] = None) -> _Chained:
    """The blocks that ran, as a chain of what each holds, with their costs; checked against the audit.
    ``counted_in``: the step the FLOPs are counted in (``count_flops``'s ``step``), where not their own."""
    flops, step_flops, nanoseconds, step_seconds = _block_costs(run, report, paths, now, cost, say, loss, counted_in)
    ran, graphless, calls = _blocks_that_ran(report, paths)
    # a block passed a tensor that is written in place during or after its call: a checkpoint of it would
    # find its saved input changed when backward recomputes it (torch raises): never planned
    written = [p for p in ran if any(call.inputs_written for call in calls[p])]
    ran = [p for p in ran if p not in written]
    chain = build_chain(report, ran, calls, {path: (nanoseconds.get(path, 0), 0) if nanoseconds is not None
                                             else flops.get(path, (0, 0)) for path in ran}, bitpack, run.masks)
    # the solver minimises the integer it is given as a block's cost: FLOPs, or nanoseconds
    # (op-level checkpointing is costed in FLOPs only: with time, whole blocks)
    costs = Costs.of([b.path for b in chain.blocks], flops, nanoseconds)
    unplanned = held_by_report(report, bitpack, run.masks)
    if chain.held(()) != unplanned:  # both count the held saves' storages of held kinds, as trim leaves them
        raise AssertionError(f"planner: the chain holds {chain.held(())} bytes unplanned, the audit {unplanned}")
    return _Chained(chain, costs, step_flops, step_seconds, graphless, written, BlockCosts(flops, nanoseconds))


def _solved(run: _Run, audited: _Audited, chained: _Chained, paths: Sequence[str], selective: bool, cost: Cost,
            bitpack: Optional[bool], say: Callable[[str], None], *, cache_was_on: bool,
            trim_installed: bool) -> tuple[list[Point], bool, list[str]]:
    """The chain's frontier (selective options added where asked), whether it is optimal, and the notes
    the plan carries about it and the model."""
    report, now, chain = audited.report, audited.now, chained.chain
    # a value the model read on meta that nobody knew was assumed: the plan's figures rest on it too
    notes = [note for note in report.notes if is_assumption_note(note)]
    notes += [CACHE_NOTE] if cache_was_on else []
    notes += _selective_option(run, chain, chained.costs, report, paths, selective, cost, now, bitpack, say)
    notes += _blind_spots(report, chained.graphless, chained.written)
    say(f"solving ({len(chain.blocks)} blocks)")
    points, optimal = solve(chain)
    notes = _own_checkpointing(run.model, now, audited.current_held) + notes + _assumed(chain)
    if trim_installed:
        notes.append(f"gradaudit.trim is installed on this model (bitpack={bitpack}, masks={run.masks!r}), so the "
                     f"plan's figures are with it, as trim=True plans them; to plan without trim, remove its handle "
                     f"first")
    return points, optimal, notes


def _own_checkpointing(model: nn.Module, now: Sequence[str], current_held: Any) -> list[str]:
    """The note, first among the plan's, where the model checkpoints some blocks itself (``now``)."""
    if not now:
        return []
    return [f"the model checkpoints {_few(now)} itself and so holds {current_held} bytes; the plan replaces that "
            f"(its figures are without it): turn the model's own checkpointing off before applying it (Hugging "
            f"Face: {checkpointing_off_call(model)})"]

def _checked_arguments(model: Any, inputs: Any, budget: Any, bound: Any, measure_peak: bool,
                       cost: Any) -> tuple[int, Bound, Cost]:
    """The budget in bytes, the bound and the cost, once every argument that needs no audit is checked."""
    if not isinstance(model, nn.Module):
        raise GradauditError(f"plan() needs a torch.nn.Module, got {type(model).__name__}")
    prepare_data_parallel(model)
    cost = timing.check_cost(cost, runs_on_meta(first_meta_parameter(model.parameters()), list(iter_tensors(inputs))))
    budget_bytes = as_bytes(budget)
    if bound not in tuple(Bound):
        raise GradauditError(f"bound must be {str(Bound.HELD)!r} or {str(Bound.PEAK)!r}, not {bound!r}")
    bound = Bound(bound)
    if bound == Bound.PEAK and not measure_peak:
        raise GradauditError("bound='peak' chooses by measured peaks: it cannot run with measure_peak=False")
    return budget_bytes, bound, cost


def _audit(run: _Run, paths: Sequence[str], bitpack: Optional[bool], say: Callable[[str], None]) -> _Audited:
    """One audit watching the candidate blocks; where the model checkpoints itself, what it holds so,
    and a second audit with that turned off (the plan replaces it). A block passed an object holding
    tensors is refused (``_refuse_opaque``)."""
    say(f"auditing the forward ({len(paths)} candidate blocks)")
    report = audit(run.model, run.inputs, trainable=run.trainable, frozen=run.frozen, watch=paths, target=run.target)
    _refuse_compiled(report, run.model)
    now = checkpointed_now(report)
    if not now:
        _refuse_opaque(report)
        return _Audited(report, now, None)
    # plan from what the model holds without its own checkpointing (which the plan replaces)
    current_held = held_by_report(report, bitpack, run.masks)
    say("auditing the forward without the model's own checkpointing")
    with checkpointing_off():
        report = audit(run.model, run.inputs, trainable=run.trainable, frozen=run.frozen, watch=paths,
                       target=run.target)
    if checkpointed_now(report):
        raise GradauditError(f"the model checkpoints ({_few(now)}) in a way gradaudit cannot turn off to plan "
                             f"from what it would hold; turn it off and plan again")
    _refuse_opaque(report)
    return _Audited(report, now, current_held)


def _refuse_compiled(report: Report, model: nn.Module) -> None:
    """A compiled model (whose forward ran compiled regions, or with a compiled module: torch 2.11 made no
    region under the plan's watching hooks, where the model's own run makes one) cannot be planned:
    checkpointing a block inside a region compiles it anew, and what the region keeps then is the
    partitioner's choice."""
    regions, compiled = compiled_regions(report), compiled_paths(model)
    if regions or compiled:
        ran = (f"{regions} compiled region{'s' if regions > 1 else ''} ran" if regions else
               f"compiled: {', '.join(compiled[:3])}")
        raise GradauditError(
            f"plan cannot plan a torch.compile'd model ({ran}): "
            f"checkpointing a block inside a region compiles it anew, and what the region keeps then is the "
            f"partitioner's choice, which plan cannot tell without compiling each candidate. Plan the model "
            f"before compiling (the module given to torch.compile; scan --eager shows its figures), checkpoint the "
            f"blocks it chooses, then compile; an audit or fit of the compiled model measures what it keeps")


def _candidates(run: _Run, blocks: Optional[Sequence[str]], say: Callable[[str], None]
                ) -> tuple[list[str], list[str]]:
    """The candidate blocks and a note on how they were found: those ``blocks`` names, else the repeated
    blocks, else (a model with none) the modules its forward calls repeatedly, found by an audit
    watching every module (``candidates.called_repeatedly``)."""
    if blocks is not None or repeated_blocks(run.model):
        return candidates(run.model, blocks), []
    say("auditing the forward for modules called more than once")
    names = [path for path, _ in run.model.named_modules() if path]
    report = audit(run.model, run.inputs, trainable=run.trainable, frozen=run.frozen, watch=names, target=run.target)
    paths, note = called_repeatedly([call.path for call in report.module_calls])
    return paths, [note]


def _refuse_opaque(report: Any) -> None:
    """A block passed an object holding tensors (a cache) cannot be planned: refuse it."""
    opaque = next((c for c in report.module_calls if c.opaque), None)
    if opaque is not None:
        raise GradauditError(f"{opaque.path} is passed a {opaque.opaque[0]} holding tensors: a checkpoint would keep it "
                             f"out of every figure's sight, and recomputing the block would use it again. Pass "
                             f"tensors instead (Hugging Face: use_cache=False for training)")


def _block_costs(run: _Run, report: Any, paths: Sequence[str], now: Sequence[str], cost: Cost,
                 say: Callable[[str], None], loss: Optional[Callable[[Any], torch.Tensor]] = None,
                 counted_in: Optional[Callable[..., Any]] = None
                 ) -> tuple[dict[str, tuple[int, int]], int, Optional[dict[str, int]], Optional[float]]:
    """(each block's FLOPs and those a selective checkpoint keeps, one step's FLOPs, with cost="time"
    each block's forward nanoseconds and one step's seconds, else None and None), on the audit's
    target device; the step is the training loop's: ``loss`` (or the default loss) backpropagated
    (``counted_in``: run by the unplanned peak probe, which turns the model's own checkpointing off)."""
    target = report.target
    if counted_in is None:
        say("counting FLOPs")
    with own_checkpointing_off(now if counted_in is None else ()):
        flops, step_flops = count_flops(run.model, run.inputs, run.trainable, run.frozen, target, paths, loss,
                                        counted_in)
    if cost != Cost.TIME:
        return flops, step_flops, None, None
    say(f"timing the forward of {len(paths)} blocks and a step on {report.device} "
        f"({timing.REPEATS} runs each, after a warm-up)")
    with own_checkpointing_off(now), as_audited(run.model, run.inputs, run.trainable, run.frozen, target):
        nanoseconds, step_nanoseconds = timing.measure(run.model, run.inputs, paths, loss=loss)
    return flops, step_flops, nanoseconds, step_nanoseconds / 1e9


def _blocks_that_ran(report: Any, paths: Sequence[str]) -> tuple[list[str], list[str], dict[str, list]]:
    """(the candidate blocks that ran and build a graph, in forward order; those that ran and build
    none; every module's calls, by path)."""
    calls: dict[str, list] = {}
    for call in report.module_calls:
        calls.setdefault(call.path, []).append(call)
    order = {call.path: i for i, call in reversed(list(enumerate(report.module_calls)))}
    ran = sorted((p for p in paths if p in calls), key=order.__getitem__)
    # a block in which no autograd node was made (frozen, its inputs needing no gradient) builds no
    # graph: a checkpoint of it holds nothing (no node keeps its inputs) and backward never
    # recomputes it, so checkpointing it changes nothing
    made = [n.module for n in report.nodes if n.name != "AccumulateGrad"]
    graphless = [p for p in ran if not any(inside(module, p) for module in made)]
    return [p for p in ran if p not in graphless], graphless, calls


def _selective_option(run: _Run, chain: Chain, costs: Costs, report: Any, paths: Sequence[str], selective: bool,
                      cost: Cost, now: Sequence[str], bitpack: Optional[bool], say: Callable[[str], None]) -> list[str]:
    """Give the chain's blocks with costly ops the option of op-level checkpointing (add_selective),
    where it is asked for and can be modelled; the notes that say why it was left out."""
    if not selective:
        return []
    if cost == Cost.TIME and any(costs.kept):
        return ["op-level checkpointing left out: its recompute is costed in FLOPs, and this plan minimises "
                "measured time (cost='flops' considers it)"]
    if not any(b.kept_flops for b in chain.blocks):
        return []
    if not torchapi.has("selective checkpoint cache"):
        return [f"op-level checkpointing left out: this torch ({torch.__version__}) hides what a selective "
                f"checkpoint keeps from the audit, so its bytes could not be counted"]
    say("auditing the forward with every block checkpointed selectively")

    def audit_with(policies: dict[str, str]) -> Any:
        return audited_with(run.model, run.inputs, run.trainable, run.frozen, run.target, paths, policies, bitpack,
                            run.masks)

    with own_checkpointing_off(now):
        note = add_selective(chain, report, audit_with, lambda other: held_by_report(other, bitpack, run.masks))
    return [note] if note else []


def _blind_spots(report: Any, graphless: Sequence[str], written: Sequence[str] = ()) -> list[str]:
    """Notes on the blocks that build no graph or cannot be checkpointed, and the tensors passed to blocks
    no figure counts."""
    notes = []
    if written:
        notes.append(f"{len(written)} block(s) are passed a tensor written in place during or after their call "
                     f"({_few(written)}: an in-place module, or an in-place op on its input later): a checkpoint "
                     f"of them could not recompute them (torch raises in backward), so the plan leaves them out")
    if graphless:
        notes.append(f"{len(graphless)} block(s) build no autograd graph ({_few(graphless)}): no gradient flows "
                     f"through them, so they hold nothing and checkpointing them would change nothing")
    uncounted = sum(c.uncounted for c in report.module_calls)
    if uncounted:
        notes.append(f"{uncounted} tensor(s) passed to blocks have no single storage (sparse): a checkpoint "
                     f"of those blocks holds them too, and no figure counts them")
    return notes


def _assumed(chain: Chain) -> list[str]:
    """The note on the storages the solver charged as always held (then the plan may not be optimal)."""
    if not chain.assumed:
        return []
    return [f"{sum(chain.assumed.values())} bytes in {len(chain.assumed)} storage(s) are shared by "
            f"blocks that are not neighbours: the solver counted them as always held, so a cheaper "
            f"plan may exist (the bytes of every plan shown are exact)"]


def _segments(run: _Run, report: Any, paths: Sequence[str], now: Sequence[str], chained: _Chained,
              bitpack: Optional[bool], say: Callable[[str], None], probes: PeakProbes,
              ) -> tuple[tuple[Baseline, ...], dict[str, Callable[[], Any]], list[str]]:
    """The sqrt(n) segments baseline, where the blocks are one nn.Sequential's children or a looped
    stack (and the model does not checkpoint itself: its regions would be turned off while planning,
    not these): (the baseline, or none; what puts it in force, by name; the note where there is none).
    Where the plan measures peaks, its step's is measured in its audit's run where that can be
    (``_steps_with_audit``) and remembered in ``probes``."""
    if len(paths) < 4:
        return (), {}, []
    in_segments = stack_runner(run.model, paths, report.module_calls) if not now else None
    if in_segments is None:
        return (), {}, ["no sqrt(n) segments baseline: these blocks are neither the children of one nn.Sequential "
                        "run by its own forward nor a stack a loop runs passing each block its predecessor's result"]
    starting = _written_segment_start(paths, chained.written)
    if starting is not None:
        return (), {}, [f"no sqrt(n) segments baseline: its segment {starting[0] + 1} would begin with {starting[1]}, "
                        f"whose input is written in place during or after its call, which the segment's checkpoint "
                        f"holds: recomputing it in backward would raise (so would checkpoint_sequential's)"]
    # (with trim the audit's forward runs without it, the step with it: never one run)
    stepped = run.measured and bitpack is None and _steps_with_audit(run.model, run.inputs)
    say("auditing the forward in sqrt(n) segments" + (", its step's peak measured" if stepped else ""))
    try:
        built = {b.path for b in chained.chain.blocks} | set(chained.written)  # (ran and made autograd nodes)
        baseline, applied, figures = segments_baseline(run.model, run.inputs, run.trainable, run.frozen, run.target,
                                                       paths, built, chained.every, in_segments, bitpack, run.masks,
                                                       step=stepped, loss=run.loss)
    except segments.NotSegmentable as error:  # the loop passed a block other tensors than the audit suggested
        return (), {}, [f"no sqrt(n) segments baseline: {error}"]
    if figures is not None:
        probes.remember_baseline(baseline, figures)
    return (baseline,), {baseline.name: applied}, []


def _steps_with_audit(model: nn.Module, inputs: Any) -> bool:
    """Whether a step's peak can be measured in the run of an audit that watches no module
    (``auditing.audit_then_step``): the model and its inputs on the CPU or meta (the tracker's devices),
    off a distributed world, not compiled. The two share one forward, which a step otherwise repeats."""
    devices = {t.device.type for t in [*model.parameters(), *iter_tensors(inputs)]}
    return devices <= {"cpu", "meta"} and distributed_rank() is None and not compiled_paths(model)


def _written_segment_start(paths: Sequence[str], written: Sequence[str]) -> Optional[tuple[int, str]]:
    """(its index, its first block) of the first checkpointed sqrt(n) segment that begins with a block passed a
    tensor written in place (a segment's checkpoint holds what its first block is passed; a block inside
    it is passed what the segment computes, which its recomputation computes again), else None."""
    ranges = segments.segment_ranges(len(paths), segments.square_root_segments(len(paths)))
    return next(((k, paths[first]) for k, (first, _) in enumerate(ranges[:-1]) if paths[first] in set(written)), None)


def _measure_peaks(result: Plan, probes: PeakProbes, applying: dict[str, Callable[[], Any]]) -> None:
    """The measured peaks of the plan's step, the unplanned step's and each baseline's."""
    probes.expect(1 + len(result.baselines) + (not probes.unplanned_measured()))
    result.peak_bytes = probes.peak(result.search.point)
    result.unplanned_peak_bytes = probes.peak(None)  # (the frontier's first point may recompute for free)
    result.baselines = tuple(dataclasses.replace(b, peak_bytes=probes.baseline_peak(b, applying.get(b.name)))
                             for b in result.baselines)


def _few(paths: Sequence[str]) -> str:
    return ", ".join(paths[:3]) + (f", ... ({len(paths)} in all)" if len(paths) > 3 else "")
