"""``gradaudit plan``: choose what to checkpoint for a memory budget (or a sweep of budgets)."""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import click

from .. import sizes
from ..records import Bound, Cost
from .options import CommandOptions, debug_option, load_loss, model_options, prepare_for_target, quiet_option
from .output import EXIT_OK, EXIT_VERDICT, CommandFailed, Output, Progress, exit_with
from .ranked import run_ranked

EXIT_CODES_HELP = """\b
Exit codes:
  0  a plan fits the budget (each budget, with several; printed, and
     written with --json)
  1  no plan of the candidate blocks fits a budget (the least they can
     hold is printed)
  2  something prevented planning: a bad SPEC or option, a factory or
     forward that raised (one or two lines on stderr; --debug for the
     traceback)
"""


def _cost_needs_a_real_device() -> str:
    return ("--cost time measures the forward on the model's device, and the meta device computes nothing: "
            "use --device cpu or cuda, or --cost flops")


def run_plan(options: CommandOptions, budget_texts: Sequence[str], blocks: tuple[str, ...], peak: bool = True,
             html_path: Optional[str] = None, selective: bool = True, cost: str = Cost.FLOPS, trim: bool = False,
             bitpack: bool = True, bound: str = Bound.HELD, loss_spec: Optional[str] = None,
             masks: Optional[str] = None) -> int:
    """The plan itself; returns the exit code."""
    from ..planning import BudgetError, plan
    from ..planning.timing import REPEATS
    from ..report import plantext

    output = Output(options.json)
    output.check(json=options.json, html=html_path)
    budgets = [sizes.parse_size(text) for text in budget_texts]
    if len(budgets) > 1 and html_path:
        raise CommandFailed("--html draws one plan: give one --budget (several make a sweep table)")
    if cost == Cost.TIME and options.device == "meta":
        raise CommandFailed(_cost_needs_a_real_device())
    if not bitpack and not trim:
        raise CommandFailed("--no-bitpack is an option of --trim: give both, or neither")
    if masks is not None and not trim:
        raise CommandFailed("--masks is an option of --trim: give both, or neither")
    if bound == Bound.PEAK and not peak:
        raise CommandFailed("--bound peak chooses by measured peaks: it cannot run with --no-peak")
    loss = load_loss(loss_spec)
    model, inputs, where = prepare_for_target(options)
    if cost == Cost.TIME and where == "meta":  # --device auto, and the factory built it on meta
        raise CommandFailed(_cost_needs_a_real_device())
    code = EXIT_OK
    try:
        chosen = plan(model, inputs, budgets[0], trainable=options.trainable_patterns, frozen=list(options.freeze),
                      blocks=list(blocks) or None,
                      measure_peak=peak and (len(budgets) == 1 or bound == Bound.PEAK), selective=selective,
                      cost=cost, bound=bound, target=options.target if where == "meta" else None, trim=trim,
                      bitpack=bitpack if trim else None, masks=masks, loss=loss, progress=options.progress)
    except BudgetError as error:
        chosen, code = error.smallest_plan, EXIT_VERDICT
    options.progress.done()
    if len(budgets) > 1:
        return _sweep(chosen, budgets, options, output, peaks=peak)
    if options.json:
        output.write_json(options.json, chosen.to_dict(), "JSON plan")
    if html_path:
        from ..report import planhtml

        output.write(html_path, planhtml.render(chosen, title=f"gradaudit plan: {options.spec}"), "--html",
                     "HTML plan")
    output.echo(plantext.render(chosen, repeats=REPEATS, quiet=options.quiet))
    output.announce(quiet=options.quiet)
    return code


def _sweep(first: Any, budgets: Sequence[int], options: CommandOptions, output: Output, peaks: bool = True) -> int:
    """One line per budget, from one audit: what to checkpoint and at what extra compute (and, unless
    --no-peak, each plan's measured peak: one step per budget)."""
    from ..report import plantext

    plans = first.sweep(budgets, measure_peak=peaks)
    if options.json:
        output.write_json(options.json, {"plans": [p.to_dict() for p in plans]}, "JSON plans")
    output.echo(plantext.render_sweep(plans))
    output.announce()
    return EXIT_OK if all(p.fits for p in plans) else EXIT_VERDICT


@click.command("plan", epilog=EXIT_CODES_HELP, short_help="Choose what to checkpoint for a memory budget.")
@click.argument("spec", metavar="SPEC")
@click.option("--budget", required=True, multiple=True, metavar="SIZE", help="Bytes autograd may hold after "
              "the forward (with --bound peak: the peak of a step), e.g. 8GiB, 500MB or a number of bytes; repeat "
              "it for a sweep (one line per budget, from one audit).")
@model_options
@click.option("--blocks", multiple=True, metavar="GLOB", help="Modules the plan may checkpoint (repeatable; "
              "default: the repeated blocks of every ModuleList/Sequential).")
@click.option("--json", "json_path", metavar="PATH", help="Write the plan as JSON ('-' for stdout).")
@click.option("--html", "html_path", metavar="PATH", help="Write the plan as a self-contained HTML page "
              "(the memory/compute frontier with the baselines marked).")
@click.option("--no-peak", is_flag=True, help="Do not run one step of the plan and of each baseline to "
              "measure their peaks (on a real device each costs a training step).")
@click.option("--cost", type=click.Choice([str(c) for c in Cost]), default=str(Cost.FLOPS), show_default=True,
              help="What recomputing a block costs, which the plan minimises: its forward FLOPs (any device), "
              "or its forward time measured on the model's device (a real device: a warm-up and a few timed "
              "steps and forwards).")
@click.option("--bound", type=click.Choice([str(b) for b in Bound]), default=str(Bound.HELD), show_default=True,
              help="What --budget bounds: the bytes held after the forward (exact), or the peak of one training "
              "step (measured: a step per probe of a bisection over the plans).")
@click.option("--no-selective", is_flag=True, help="Checkpoint whole blocks only (no op-level checkpointing "
              "that keeps matrix products' outputs and recomputes the rest).")
@click.option("--trim", is_flag=True, help="Plan the bytes that remain with gradaudit.trim installed: every "
              "figure is with trim and the plan (in Python plan(..., trim=True), whose apply installs trim too).")
@click.option("--no-bitpack", is_flag=True, help="With --trim: trim(bitpack=False), drops only.")
@click.option("--masks", type=click.Choice(["auto", "bits", "bytes"]), default=None,
              help="With --trim: what trim keeps of a save read only as a sign or a two-valued mask, one bit per "
              "element (bits) or one bool (bytes, fewer operations on a GPU); auto, trim's default: bits on the "
              "CPU, bytes on a GPU (the --target).")
@click.option("--loss", "loss_spec", metavar="MODULE:FN", help="A function from the model's output to the scalar "
              "loss the measured steps backpropagate (default: the output's loss, as Hugging Face models given "
              "labels return, else the sum of its first tensor; as fit takes it).")
@quiet_option
@debug_option
def plan_command(spec: str, budget: tuple[str, ...], model: dict[str, Any], blocks: tuple[str, ...],
                 json_path: Optional[str],
                 html_path: Optional[str], no_peak: bool, cost: str, bound: str, no_selective: bool,
                 trim: bool, no_bitpack: bool, masks: Optional[str], loss_spec: Optional[str], quiet: bool,
                 debug: bool) -> None:
    """Choose which modules of the model built by SPEC to checkpoint (recompute in backward) so that
    autograd holds at most --budget after the forward, for the least extra compute.

    Prints the plan beside what a user would otherwise pick: no checkpointing, every block
    (Hugging Face's activation_checkpointing_enable), every n-th block and, for an nn.Sequential stack,
    sqrt(n) segments (checkpoint_sequential). Apply it in Python with
    gradaudit.plan(model, inputs, budget).apply(model).

    \b
    Examples:
      gradaudit plan examples/llama_probe.py:build --budget 8GiB
      gradaudit plan examples/llama_probe.py:build --budget 16GiB --budget 8GiB --budget 4GiB
      gradaudit plan mymodel.py:make --input-shape 8,3,224,224 --budget 2GiB --json plan.json
      gradaudit plan mymodel.py:make --device cuda --budget 2GiB --cost time
      gradaudit plan mymodel.py:make --input-shape 8,3,224,224 --budget 1GiB --trim
    """
    progress = Progress(enabled=sys.stderr.isatty() and not quiet)
    options = CommandOptions(spec=spec, **model, html=None, json=json_path, quiet=quiet, progress=progress)
    exit_with(lambda: run_ranked(options, lambda ranked, path: run_plan(
        ranked, budget, blocks, peak=not no_peak, html_path=path(html_path), cost=cost, selective=not no_selective,
        trim=trim, bitpack=not no_bitpack, bound=bound, loss_spec=loss_spec, masks=masks)), progress, debug)
