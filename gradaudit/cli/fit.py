"""``gradaudit fit``: will a whole training step fit in a device's memory, what makes its peak, and
what change would make it fit."""

from __future__ import annotations

import sys
from typing import Any, Optional

import click

from .. import sizes
from .options import CommandOptions, debug_option, load_loss, model_options, prepare_for_target, quiet_option
from .output import EXIT_OK, EXIT_VERDICT, Output, Progress, exit_with
from .ranked import run_ranked

EXIT_CODES_HELP = """\b
Exit codes:
  0  the step fits, or a remedy makes it fit (printed)
  1  the step does not fit and no remedy does (printed, with why)
  2  something prevented the fit: a bad SPEC or option, a factory or
     step that raised (one or two lines on stderr; --debug for the
     traceback)
"""

AUTOCAST_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


def run_fit(options: CommandOptions, memory_text: str, optimizer: str, loss_spec: Optional[str],
            autocast: Optional[str], remedy: bool, largest: Optional[str] = None,
            html_path: Optional[str] = None, memory_viz_path: Optional[str] = None, accumulation: int = 1,
            headroom_text: Optional[str] = None) -> int:
    """The fit itself; returns the exit code."""
    import torch

    from ..fitting import fit
    from ..report import fittext

    output = Output(options.json)
    output.check(json=options.json, html=html_path, memory_viz=memory_viz_path)
    memory = sizes.parse_size(memory_text)
    headroom = sizes.parse_size(headroom_text) if headroom_text is not None else None
    loss = load_loss(loss_spec)
    model, inputs, where = prepare_for_target(options)
    result = fit(model, inputs, memory=memory, optimizer=optimizer, loss=loss,
                 trainable=options.trainable_patterns, frozen=list(options.freeze),
                 target=options.target if where == "meta" else None,
                 autocast=getattr(torch, AUTOCAST_DTYPES[autocast]) if autocast else None,
                 accumulation=accumulation, headroom=headroom, remedy=remedy, progress=options.progress)
    found, found_note = _largest(result, largest, options) if largest else (None, None)
    options.progress.done()
    if html_path:
        from ..report import fithtml

        output.write(html_path, fithtml.render(result, title=f"gradaudit fit: {options.spec}"), "--html", "HTML fit")
    if memory_viz_path:
        import pickle

        from ..report import memory_viz

        output.write(memory_viz_path, pickle.dumps(memory_viz.fit_snapshot(result)), "--memory-viz",
                     "memory_viz snapshot")
    if found_note:
        output.note(found_note)
    if options.json:
        output.write_json(options.json, {**result.to_dict(), **({"largest": {largest: found}} if largest else {})},
                          "JSON fit")
    output.echo(fittext.render(result, quiet=options.quiet))
    output.announce(quiet=options.quiet)
    return EXIT_OK if result.fits or result.remedy is not None else EXIT_VERDICT


def _largest(result: Any, largest: str, options: CommandOptions) -> tuple[Optional[int], str]:
    """The largest size along ``largest`` that fits (None where the memory does not bound it), and the
    line that says so."""
    from ..fitting.largest import Unbounded

    dimension = largest.replace("-", "_")
    options.progress(f"searching the largest {largest} that fits")
    try:
        found = result.largest(dimension, progress=options.progress)
    except Unbounded as unbounded:
        return None, f"largest {largest} that fits as it is: not bounded by the memory ({unbounded})"
    named = result.live.size_search.named(dimension, found)
    return found, (f"largest {largest} that fits as it is: {found}{f', {named}' if named else ''} (measured: "
                   f"{found} fits, {found + 1} does not)")


@click.command("fit", epilog=EXIT_CODES_HELP, short_help="Will a training step fit in memory, and what makes it.")
@click.argument("spec", metavar="SPEC")
@click.option("--memory", required=True, metavar="SIZE", help="The memory the step may use, e.g. 80GiB.")
@model_options
@click.option("--optimizer", default="adamw", show_default=True, metavar="NAME",
              help="A torch.optim optimizer by name (adamw, adam, sgd, ... in any case) or module:Class; it runs "
              "with its defaults over the parameters that train.")
@click.option("--loss", "loss_spec", metavar="MODULE:FN", help="A function from the model's output to the scalar "
              "loss (default: the output's loss, as Hugging Face models given labels return, else the sum of "
              "its first tensor).")
@click.option("--autocast", type=click.Choice(sorted(AUTOCAST_DTYPES)), help="Run the forward and the loss "
              "under torch.autocast with this dtype (backward and the optimizer step after it closes).")
@click.option("--accumulate", "accumulation", type=click.IntRange(min=1), default=1, show_default=True,
              metavar="N", help="Gradient accumulation: N micro-batches (each the batch SPEC gives) per "
              "optimizer step, their gradients added up by backward.")
@click.option("--headroom", "headroom_text", metavar="SIZE", help="What the device needs beside the step's peak, "
              "left free by the verdict and the remedy (default: on CUDA, what the caching allocator would reserve "
              "beyond the peak, estimated for each step; on the CPU nothing).")
@click.option("--no-remedy", is_flag=True, help="Do not search for a change that makes the step fit.")
@click.option("--largest", type=click.Choice(["batch", "seq", "micro-batches"]), help="Also find the largest batch "
              "(dimension 0 of the inputs) or sequence length (dimension 1) whose step fits as it is, by measured "
              "steps; for a pipeline stage, its micro-batch (the count kept), their sequence length, or their count "
              "(micro-batches, each as it is).")
@click.option("--json", "json_path", metavar="PATH", help="Write the fit as JSON ('-' for stdout).")
@click.option("--html", "html_path", metavar="PATH", help="Write the fit as a self-contained HTML page (the "
              "step's memory over time by category, with the memory as a line, before and after the remedy).")
@click.option("--memory-viz", "memory_viz_path", metavar="PATH", help="Write the step's allocations and frees as a "
              "snapshot (a .pickle) for PyTorch's memory_viz page (https://pytorch.org/memory_viz).")
@quiet_option
@debug_option
def fit_command(spec: str, memory: str, model: dict[str, Any], optimizer: str, loss_spec: Optional[str],
                autocast: Optional[str], accumulation: int, headroom_text: Optional[str], no_remedy: bool,
                largest: Optional[str],
                json_path: Optional[str], html_path: Optional[str], memory_viz_path: Optional[str], quiet: bool,
                debug: bool) -> None:
    """Predict the peak memory of one training step (forward, backward, optimizer step) of the model
    built by SPEC, by category, and whether it fits in --memory; when it does not, the cheapest
    change whose measured step fits (smaller micro-batches with gradient accumulation, gradaudit.trim,
    a checkpoint plan, alone or together), beside checkpointing every block.

    \b
    Examples:
      gradaudit fit examples/llama_probe.py:build --memory 24GiB --target cuda
      gradaudit fit mymodel.py:make --input-shape 8,3,224,224 --memory 8GiB --optimizer sgd
      gradaudit fit mymodel.py:make --device meta --target cuda --memory 80GiB --json fit.json
      gradaudit fit examples/llama_probe.py:build --memory 80GiB --target cuda --largest batch
    """
    progress = Progress(enabled=sys.stderr.isatty() and not quiet)
    options = CommandOptions(spec=spec, **model, html=None, json=json_path, quiet=quiet, progress=progress,
                             schedules=True)
    exit_with(lambda: run_ranked(options, lambda ranked, path: run_fit(
        ranked, memory, optimizer, loss_spec, autocast, remedy=not no_remedy, largest=largest,
        html_path=path(html_path), memory_viz_path=path(memory_viz_path), accumulation=accumulation,
        headroom_text=headroom_text)),
        progress, debug)
