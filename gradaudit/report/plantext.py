"""The checkpoint plan for the terminal: one plan beside its baselines (``render``), or one line per
budget of a sweep (``render_sweep``). Pure functions of ``Plan`` objects; the CLI prints them.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..records import Bound, Cost
from .units import human_bytes, path_ranges, stands_for


def render(plan: Any, *, repeats: int, quiet: bool = False) -> str:
    """The plan, its figures beside the baselines', what they mean, and its notes; ``quiet``: the
    header and one summary line. ``repeats``: the timed runs behind each median (cost="time")."""
    by_peak = plan.bound == Bound.PEAK
    lines = [f"gradaudit plan: {plan.model} on {_where(plan)}, budget {human_bytes(plan.budget)} "
             f"{'for the peak of a step' if by_peak else 'held after the forward'}{_with_trim(plan)}"]
    if not plan.fits:
        least = (f"peaks at least at {human_bytes(plan.peak_bytes)}" if by_peak
                 else f"holds at least {human_bytes(plan.held_bytes)}")
        lines.append(f"no plan fits: checkpointing the candidate blocks {least} "
                     f"(every useful block: {len(plan.checkpointed)} of {len(plan.blocks)}); raise --budget or "
                     f"add modules with --blocks")
    elif not quiet:
        lines.append(f"checkpoint {len(plan.checkpointed)} of {len(plan.blocks)} blocks: "
                     f"{path_ranges(plan.checkpointed) or '(none: it fits unplanned)'}")
        if plan.selective:
            lines.append(f"  of which op by op (outputs of matrix products, convolutions, attention and batch norm "
                         f"kept): {path_ranges(plan.selective)}")
    if quiet:
        peak_text = f", peak {human_bytes(plan.peak_bytes)}" if plan.peak_bytes is not None else ""
        lines.append(f"held {human_bytes(plan.held_bytes)} (unplanned {human_bytes(plan.unplanned_held_bytes)})"
                     f"{peak_text}, extra {'time' if plan.cost == Cost.TIME else 'compute'} {extra_text(plan, plan)}, "
                     f"{len(plan.checkpointed)} blocks checkpointed")
        return "\n".join(lines)
    lines += _table(plan)
    lines += _meanings(plan, repeats)
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def _table(plan: Any) -> list[str]:
    """The plan's row (the least possible plan's, where none fits) and each baseline's."""
    rows = [("this plan" if plan.fits else "least possible", plan.held_bytes, plan.peak_bytes,
             extra_text(plan, plan), len(plan.checkpointed))]
    rows += [(b.name, b.held_bytes, b.peak_bytes, extra_text(plan, b), len(b.checkpointed)) for b in plan.baselines]
    width = max(13, *(len(extra) for _, _, _, extra, _ in rows))
    lines = [f"  {'':<16}{'HELD':>11}{'PEAK':>11}  {_extra_heading(plan):>{width}}  {'BLOCKS':>6}  FITS"]
    for name, held, peak_bytes, extra, count in rows:
        fits = (peak_bytes is not None and peak_bytes <= plan.budget) if plan.bound == Bound.PEAK else held <= plan.budget
        lines.append(f"  {name:<16}{human_bytes(held):>11}"
                     f"{human_bytes(peak_bytes) if peak_bytes is not None else '-':>11}  "
                     f"{extra:>{width}}  {count:>6}  {'yes' if fits else 'no'}")
    return lines


def _meanings(plan: Any, repeats: int) -> list[str]:
    """What the table's figures are: held, peak (where measured) and the extra cost."""
    held_means = ("held: after the forward with gradaudit.trim installed (exact: an audit's saved_bytes less "
                  "what trim frees)" if plan.trimmed else "held: after the forward (exact, what an audit counts)")
    if plan.peak_bytes is not None:
        held_means += "; peak: through forward, recomputation and backward, gradients included" + (
            " (one step of each run on meta: shapes only)" if plan.device == "meta"
            else f" (one step of each measured on {plan.device})")
    if plan.cost == Cost.TIME:
        extra_means = (f"extra time: the checkpointed blocks' forward time as a share of one unplanned step's "
                       f"({_milliseconds(plan.step_seconds or 0.0)} ms), medians of {repeats} runs on {plan.device}; "
                       f"extra FLOPs +{100 * plan.extra_flops / plan.step_flops if plan.step_flops else 0:.1f}%")
    else:
        extra_means = (f"extra compute: the recomputed FLOPs as a share of one unplanned step's "
                       f"({plan.step_flops:.3g} FLOPs: torch.utils.flop_counter, plus one per element written by ops "
                       f"it has no formula for)")
    return [held_means, extra_means]


def render_sweep(plans: Sequence[Any]) -> str:
    """One line per plan of a sweep (``Plan.sweep``, in the budgets' order): what to checkpoint, at
    what extra cost, and each plan's peak where the sweep measured it."""
    first = plans[0]
    by_peak = first.peak_bytes is not None
    lines = [f"gradaudit plan: {first.model} on {_where(first)}, {len(plans)} budgets"
             f"{' for the peak of a step' if first.bound == Bound.PEAK else ''}, unplanned "
             f"{human_bytes(first.unplanned_held_bytes)} held after the forward{_with_trim(first)}"]
    extras = [extra_text(p, p) for p in plans]
    width = max(13, *map(len, extras))
    peak_heading = f"  {'PEAK':>10}" if by_peak else ""
    lines.append(f"  {'BUDGET':>10}  {'HELD':>10}{peak_heading}  {_extra_heading(first):>{width}}  {'BLOCKS':>6}  "
                 f"CHECKPOINT")
    for p, extra in zip(plans, extras):
        what = path_ranges(p.checkpointed) or "(nothing)"
        if p.selective:
            what += f" (op by op: {path_ranges(p.selective)})"
        peak_text = f"  {human_bytes(p.peak_bytes):>10}" if by_peak else ""
        lines.append(f"  {human_bytes(p.budget):>10}  {human_bytes(p.held_bytes):>10}{peak_text}  {extra:>{width}}  "
                     f"{len(p.checkpointed):>6}  {what if p.fits else 'no plan fits: ' + what}")
    return "\n".join(lines)


def extra_text(plan: Any, figures: Any) -> str:
    """What ``figures`` (the plan, or a baseline) adds per step: a share of one unplanned step's
    FLOPs, or with cost="time" the milliseconds and their share of one step's time."""
    step = plan.step_seconds if plan.cost == Cost.TIME else plan.step_flops
    share = f"+{100 * plan.share(figures):.1f}%" if step else "+?"
    if plan.cost != Cost.TIME:
        return share
    return f"+{_milliseconds(figures.extra_seconds or 0.0)} ms ({share})"


def _extra_heading(plan: Any) -> str:
    return "EXTRA TIME" if plan.cost == Cost.TIME else "EXTRA COMPUTE"


def _milliseconds(seconds: float) -> str:
    ms = 1e3 * seconds
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}"


def _where(plan: Any) -> str:
    """The device the figures are for: the model's, or on meta the one it stands for."""
    return stands_for(plan.device, plan.target)


def _with_trim(plan: Any) -> str:
    """How the header says a plan's figures are with trim ("" without)."""
    if not plan.trimmed:
        return ""
    if not plan.bitpack:
        return " with gradaudit.trim (no bit-packing)"
    return " with gradaudit.trim" + (" (masks as bytes)" if plan.masks == "bytes" else "")
