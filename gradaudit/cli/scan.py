"""``gradaudit scan``: audit a model built by a factory; the summary, the reports it asks for, and
the exit code of its thresholds (--fail-on-waste, --max-reclaimable)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, Optional

import click

from .. import sizes
from ..errors import GradauditError
from .options import (CommandOptions, debug_option, model_options, prepare_for_target, quiet_option,
                      split_codes)
from .output import EXIT_OK, EXIT_THRESHOLD, CommandFailed, Output, Progress, exit_with
from .ranked import run_ranked

EXIT_CODES_HELP = """\b
Exit codes:
  0  the scan ran (findings, if any, are reported)
  1  a --fail-on-waste or --max-reclaimable threshold was exceeded
  2  something prevented the scan: a bad SPEC, a missing file or factory,
     a factory or forward that raised, nothing requiring grad, an
     unwritable output path, a --select/--ignore code no rule has, a
     --trainable/--freeze pattern no parameter matches (one or two lines
     on stderr; --debug for the traceback)
"""


def run_scan(options: CommandOptions) -> int:
    """The scan itself; returns the exit code. The summary goes to stdout (stderr with --json -)."""
    from ..auditing import audit
    from ..rules.registry import check_codes

    output = Output("-" if options.output_format == "sarif" else options.json)
    output.check(html=options.html, json=options.json, svg=options.svg, dot=options.dot,
                 memory_viz=options.memory_viz)
    limit = sizes.parse_size(options.max_reclaimable) if options.max_reclaimable else None
    # before the model is built (which can take minutes): a typo must not quietly change the gate
    check_codes(options.select, "--select")
    check_codes(options.ignore, "--ignore")
    if options.verify and options.device == "meta":
        raise CommandFailed("--verify needs real values and cannot run on --device meta; use --device cpu "
                            "(or cuda), or drop --verify")
    model, inputs, where = prepare_for_target(options)
    report = audit(model, inputs, verify=options.verify, eager=options.eager, trainable=options.trainable_patterns,
                   frozen=list(options.freeze), select=options.select, ignore=options.ignore,
                   progress=options.progress, target=options.target if where == "meta" else None,
                   compare_eager=options.compare_eager)

    options.progress("writing the reports")
    _write_reports(report, options, output)
    trim_figures = _trim(model, inputs, options) if options.trim else None
    options.progress.done()

    if options.output_format in ("github", "sarif"):
        _annotations(report, options.output_format, output)
    elif options.quiet:
        output.echo(_one_line(report))
    else:
        from ..report import text

        # as wide as the terminal (COLUMNS when set): clipping is for narrow terminals only; a pipe or a
        # file (CI logs) gets whole lines unless COLUMNS says otherwise
        width = (max(60, shutil.get_terminal_size((100, 20)).columns)
                 if output.stream.isatty() or os.environ.get("COLUMNS") else None)
        color = output.stream.isatty() and "NO_COLOR" not in os.environ
        output.echo(text.render(report, color=color, top=options.top, width=width).rstrip("\n"))
    if trim_figures is not None:
        output.echo(_trim_lines(trim_figures))
    output.announce()
    return _thresholds(report, options, limit)


def _write_reports(report: Any, options: CommandOptions, output: Output) -> None:
    from .. import loading

    if options.json:
        from ..report import jsonout

        output.write_json(options.json, jsonout.render(report), "JSON")
    if options.dot or options.svg:
        from ..report import graph

        if options.dot:
            output.write(options.dot, graph.to_dot(report), "--dot", "DOT graph")
        if options.svg:
            try:
                svg = graph.to_svg(report)
            except graph.GraphvizMissing as error:
                raise CommandFailed(f"cannot write --svg: {loading.first_line(error)} (install Graphviz, or "
                                    f"use --dot and render it elsewhere)", error) from error
            output.write(options.svg, svg, "--svg", "SVG graph")
    if options.memory_viz:
        import pickle

        from ..report import memory_viz

        output.write(options.memory_viz, pickle.dumps(memory_viz.snapshot(report)), "--memory-viz",
                     "memory_viz snapshot")
    if options.html:
        from ..report import html

        output.write(options.html, html.render(report, title=f"gradaudit: {options.spec}"), "--html", "HTML report")


def _annotations(report: Any, output_format: str, output: Output) -> None:
    """--output-format github: a workflow annotation per finding, then the one-line summary; sarif: the
    SARIF document on stdout, the summary on stderr."""
    from ..report import annotations

    if output_format == "github":
        lines = annotations.github(report)
        if lines:
            output.echo(lines)
    else:
        sys.stdout.write(json.dumps(annotations.sarif(report), indent=2) + "\n")
    output.echo(_one_line(report))


def _one_line(report: Any) -> str:
    from ..report.units import human_bytes
    from ..report.views import selection

    every = (f", {human_bytes(report.reclaimable_with_all_fixes_bytes)} with all fixes"
             if report.rewrite_bytes else "")
    counted = f" ({selection(report)})" if report.select or report.ignore else ""
    return (f"{report.model}: {human_bytes(report.saved_bytes)} held for backward, "
            f"{human_bytes(report.reclaimable_bytes)} reclaimable "
            f"({human_bytes(report.reclaimable_with_bitpacking_bytes)} with bit-packing{every}), "
            f"{len(report.waste_findings)} waste findings{counted}")


def _trim(model: Any, inputs: Any, options: CommandOptions) -> dict[str, Any]:
    try:
        from ..trimming import compare
    except ImportError as error:
        raise CommandFailed(f"--trim is not available in this installation ({error})", error) from error
    from ..conditions import apply_trainable, one_stage
    from ..torchapi.pipelining import is_schedule

    if is_schedule(model):  # a pipeline stage: its module on one micro-batch, as the audit ran it
        model, inputs, _ = one_stage(model, inputs)
    if options.device == "meta":
        raise CommandFailed("--trim measures real memory and cannot run on --device meta; use --device cpu")
    # The audit applied --trainable/--freeze only for its own forward; do the same here.
    apply_trainable(model, options.trainable_patterns, list(options.freeze))
    options.progress("measuring held and peak memory with and without trimming")
    try:
        figures = compare(model, inputs)
    except GradauditError:
        raise
    except Exception as error:
        raise CommandFailed(f"--trim failed: {type(error).__name__}: {error}", error) from error
    from ..conditions import device_type_of
    from ..trimming.codec import mask_form

    # what trim's default kept the masks as here (masks="auto": bits on the CPU, bools on a GPU)
    figures["masks"] = mask_form("auto", device_type_of(model))
    return figures


def _trim_lines(figures: dict[str, Any]) -> str:
    from ..report.units import human_bytes

    masks = {"bits": "masks as bits", "bytes": "masks as bools"}[figures["masks"]]
    lines = [f"With gradaudit.trim (measured, {masks}):"]
    for label, key in (("held for backward", "held"), ("peak, forward+backward", "peak")):
        before, after = figures[f"{key}_before"], figures[f"{key}_after"]
        lines.append(f"  {label:<22} {human_bytes(before):>10} -> {human_bytes(after):>10}  "
                     f"(-{human_bytes(before - after)})")
    return "\n".join(lines)


def _thresholds(report: Any, options: CommandOptions, limit: Optional[int]) -> int:
    """Both thresholds count what the summary shows: the selected rules' waste findings, and the
    bytes fixing all of them together frees (``reclaimable_with_all_fixes_bytes``, storage-aware),
    the figure ``assert_no_waste`` compares too."""
    from ..report.units import human_bytes
    from ..report.views import freed_parts, waste_findings_text

    code = EXIT_OK
    freed, findings = report.reclaimable_with_all_fixes_bytes, waste_findings_text(report)
    if options.fail_on_waste and report.waste_findings:
        click.echo(f"gradaudit: {findings} (--fail-on-waste)", err=True)
        code = EXIT_THRESHOLD
    if limit is not None and freed > limit:
        click.echo(f"gradaudit: fixing the {findings} would free {human_bytes(freed)} ({freed} bytes), which "
                   f"exceeds --max-reclaimable {options.max_reclaimable} ({limit} bytes): {freed_parts(report)}",
                   err=True)
        code = EXIT_THRESHOLD
    return code


@click.command("scan", epilog=EXIT_CODES_HELP, short_help="Audit a model built by a factory.")
@click.argument("spec", metavar="SPEC")
@model_options
@click.option("--html", metavar="PATH", default="gradaudit-report.html", show_default=True,
              help="Write the self-contained HTML report here.")
@click.option("--no-html", is_flag=True, help="Do not write the HTML report.")
@click.option("--json", "json_path", metavar="PATH", help="Write the JSON report ('-' for stdout; the "
              "summary then goes to stderr).")
@click.option("--output-format", "output_format", type=click.Choice(["text", "json", "github", "sarif"]),
              default="text", show_default=True, help="What goes to stdout: the summary and findings table, "
              "the JSON report (as --json -), GitHub Actions annotations on the findings' source lines, or "
              "SARIF 2.1.0 for code scanning (the summary line then goes to stderr).")
@click.option("--svg", metavar="PATH", help="Write the annotated autograd graph as SVG (needs Graphviz).")
@click.option("--dot", metavar="PATH", help="Write the annotated autograd graph as Graphviz DOT.")
@click.option("--memory-viz", "memory_viz", metavar="PATH", help="Write the memory autograd holds, saved in the "
              "forward and released in backward, as a snapshot (a .pickle) for PyTorch's memory_viz page "
              "(https://pytorch.org/memory_viz).")
@click.option("--verify", is_flag=True, help="Prove each verdict by running backward nodes on poisoned "
              "values (real devices only).")
@click.option("--select", multiple=True, metavar="CODES", help="Only these rule code prefixes "
              "(comma-separated or repeated; longest prefix wins). Findings, byte figures and "
              "thresholds count the selected rules only.")
@click.option("--ignore", multiple=True, metavar="CODES", help="Skip these rule code prefixes.")
@click.option("--fail-on-waste", is_flag=True, help="Exit 1 when any (selected) waste finding remains.")
@click.option("--max-reclaimable", metavar="SIZE", help="Exit 1 when fixing every (selected) waste "
              "finding together would free more than SIZE (e.g. 64MiB).")
@click.option("--eager", is_flag=True, help="Run torch.compile'd parts of the model eagerly, so that what "
              "eager autograd keeps is audited op by op (a compiled region is otherwise one opaque node).")
@click.option("--compare-eager", is_flag=True, help="For a torch.compile'd model: audit it eagerly too, and show "
              "beside the compiled figures what eager autograd would hold, per module (what compiling gives back "
              "and what it adds).")
@click.option("--trim", is_flag=True, help="Also measure held and peak memory with gradaudit.trim.")
@quiet_option
@click.option("-v", "--verbose", count=True, help="List more findings (-v: 50, -vv: all).")
@debug_option
def scan(spec: str, model: dict[str, Any], html: str, no_html: bool, json_path: Optional[str], svg: Optional[str],
         dot: Optional[str], memory_viz: Optional[str], verify: bool,
         select: tuple[str, ...], ignore: tuple[str, ...], fail_on_waste: bool,
         max_reclaimable: Optional[str], eager: bool, compare_eager: bool, trim: bool, output_format: str,
         quiet: bool, verbose: int, debug: bool) -> None:
    """Audit the model built by SPEC (path/to/file.py:factory or package.module:factory).

    The factory takes no arguments and returns a torch.nn.Module, or (module, inputs). Without
    inputs from the factory, give --inputs or --input-shape.

    \b
    Examples:
      gradaudit scan examples/resnet_surgical.py:build
      gradaudit scan examples/llama_probe.py:build --device meta --json report.json
      gradaudit scan examples/resnet_surgical.py:build --device meta --target cuda
      gradaudit scan mymodel.py:make --input-shape 8,3,224,224 --trainable 'fc.*'
      gradaudit scan mymodel.py:make --inputs mymodel.py:batch --fail-on-waste --ignore GA401
      gradaudit scan examples/resnet_surgical.py:build --memory-viz held.pickle
      gradaudit scan examples/resnet_compiled.py:build --compare-eager
    """
    progress = Progress(enabled=sys.stderr.isatty() and not quiet)
    if output_format == "json":
        if json_path is not None:
            raise click.UsageError("--output-format json prints the JSON report on stdout and --json writes it: "
                                   "give one of them")
        json_path = "-"
    if output_format == "sarif" and json_path == "-":
        raise click.UsageError("--output-format sarif and --json - both take stdout: write the JSON report to a "
                               "file")
    if output_format == "sarif" and model.get("world_size") and len(model.get("ranks") or ()) != 1:
        raise click.UsageError("--output-format sarif with --world-size writes one document: choose its rank "
                               "with --rank R")
    options = CommandOptions(
        spec=spec, **model, html=None if no_html else html, json=json_path, output_format=output_format, svg=svg,
        dot=dot, memory_viz=memory_viz, verify=verify, eager=eager, compare_eager=compare_eager,
        select=split_codes(select), ignore=split_codes(ignore), fail_on_waste=fail_on_waste,
        max_reclaimable=max_reclaimable, top={0: 10, 1: 50}.get(verbose, 1_000_000), quiet=quiet, trim=trim,
        progress=progress, schedules=True,
    )
    exit_with(lambda: run_ranked(options, lambda ranked, _: run_scan(ranked)), progress, debug)
