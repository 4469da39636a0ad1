"""The ``gradaudit`` command line: ``scan`` a model factory, ``plan`` its checkpointing for a memory
budget, ``fit`` a whole training step in a device's memory, list ``rules``, ``explain`` one rule.

Only this module prints or writes files; everything it shows comes from a Report and the reporters.
Heavy imports (torch, the reporters) happen inside the commands so ``--help`` stays instant.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import click

from .errors import ForwardError, GradauditError
from .records import Bound, Cost
from . import sizes

EXIT_OK, EXIT_THRESHOLD, EXIT_ERROR = 0, 1, 2

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


class ScanFailed(Exception):
    """Ends the scan with exit code 2 after printing ``message`` (one or two lines)."""

    def __init__(self, message: str, cause: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.cause = cause


def _split_codes(values: Sequence[str]) -> tuple[str, ...]:
    """``--select GA1,GA2 --select GA301`` -> ("GA1", "GA2", "GA301")."""
    return tuple(part.strip().upper() for v in values for part in v.split(",") if part.strip())


class Progress:
    """One overwritten status line on stderr, only when stderr is a terminal (and not -q)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.monotonic()
        self.shown = False
        self.stream = sys.stderr  # the terminal's, also while a rank's output is being collected

    def __call__(self, step: str) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        line = f"gradaudit: {step}... ({elapsed:.1f}s)"
        width = shutil.get_terminal_size((80, 20)).columns - 1
        self.stream.write("\r" + line[:width].ljust(width))
        self.stream.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown:
            width = shutil.get_terminal_size((80, 20)).columns - 1
            self.stream.write("\r" + " " * width + "\r")
            self.stream.flush()
            self.shown = False


def _check_writable(path: str, option: str) -> None:
    """Fail before the scan, not after it, when an output cannot be written."""
    if path == "-":
        return
    if os.path.isdir(path):
        raise ScanFailed(f"cannot write {option} {path}: it is a directory; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ScanFailed(f"cannot write {option} {path}: folder {folder} does not exist; create it or "
                         f"choose another path")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ScanFailed(f"cannot write {option} {path}: permission denied; choose another path")


def _write_json(path: str, document: Any) -> None:
    """``--json PATH``: the document, indented, to the file (or stdout for '-')."""
    import json

    text = json.dumps(document, indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
    else:
        _write(path, text, "--json")


def _write(path: str, text: Any, option: str) -> None:
    """Write ``text`` (str; bytes are written as they are) to ``path``."""
    try:
        if isinstance(text, bytes):
            with open(path, "wb") as handle:
                handle.write(text)
            return
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as error:
        raise ScanFailed(f"cannot write {option} {path}: {error.strerror or error}; choose another path",
                         error) from error


@dataclass
class ScanOptions:
    spec: str
    inputs: Optional[str] = None
    input_shape: Optional[str] = None
    dtype: str = "float32"
    input_requires_grad: bool = False
    trainable: tuple[str, ...] = ()
    freeze: tuple[str, ...] = ()
    mode: Optional[bool] = None  # True train, False eval, None as the factory left it
    device: str = "auto"
    target: str = "cpu"  # the device type a scan on meta stands for
    # with target cuda: the GPU, the torch release it runs and its cuDNN (None: the defaults)
    target_gpu: Optional[str] = None
    target_torch: Optional[str] = None
    target_cudnn: Optional[str] = None
    html: Optional[str] = "gradaudit-report.html"
    json: Optional[str] = None
    svg: Optional[str] = None
    dot: Optional[str] = None
    memory_viz: Optional[str] = None  # the memory_viz snapshot (a pickle)
    verify: bool = False
    eager: bool = False
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    fail_on_waste: bool = False
    max_reclaimable: Optional[str] = None
    top: int = 10
    quiet: bool = False
    trim: bool = False
    world_size: Optional[int] = None  # --world-size: every rank in a fake process group of this size
    ranks: tuple[int, ...] = ()  # --rank: which ranks (default: every rank)
    progress: Any = field(default_factory=lambda: Progress(enabled=False))


def prepare(options: ScanOptions) -> tuple[Any, Any]:
    """Build the model and its inputs as the options say (device, mode, inputs)."""
    import torch

    from . import loading

    device = options.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ScanFailed("--device cuda: no CUDA device is available; use --device cpu or meta")
    build_device = "meta" if device == "meta" else None
    options.progress(f"building the model ({options.spec})")
    model, inputs = loading.build_model(options.spec, build_device)
    if device in ("cpu", "cuda"):
        try:
            model = model.to(device)
        except Exception as error:  # e.g. a factory that builds on meta: there are no values to copy
            raise ScanFailed(f"cannot move the model to {device}: {loading.first_line(error)}\n"
                             f"a factory that builds on the meta device needs --device meta (or auto)",
                             error) from error
    first = next(iter(model.parameters()), None)
    if first is None:
        first = next(iter(model.buffers()), None)
    where = device if device != "auto" else (str(first.device) if first is not None else "cpu")
    if options.inputs:
        options.progress(f"building the inputs ({options.inputs})")
        inputs = loading.load_inputs(options.inputs, build_device)
    elif options.input_shape:
        shape = loading.parse_shape(options.input_shape)
        inputs = loading.random_input(shape, loading.parse_dtype(options.dtype), where,
                                      options.input_requires_grad)
    if inputs is None:
        raise ScanFailed(f"no inputs: the factory {options.spec} returned only a model; return (model, "
                         f"inputs), or pass --inputs SPEC or --input-shape 8,3,224,224")
    inputs = loading.to_device(inputs, where)
    if options.mode is not None:
        model.train(options.mode)
    return model, inputs


def run_scan(options: ScanOptions) -> int:
    """The scan itself; returns the exit code. The summary goes to stdout (stderr with --json -)."""
    from . import loading

    to_stderr = options.json == "-"

    def out(text: str) -> None:
        click.echo(text, err=to_stderr)

    for path, option in ((options.html, "--html"), (options.json, "--json"), (options.svg, "--svg"),
                         (options.dot, "--dot"), (options.memory_viz, "--memory-viz")):
        if path:
            _check_writable(path, option)
    limit = sizes.parse_size(options.max_reclaimable) if options.max_reclaimable else None
    # before the model is built (which can take minutes): a typo must not quietly change the gate
    from .rules.registry import check_codes

    check_codes(options.select, "--select")
    check_codes(options.ignore, "--ignore")
    if options.verify and options.device == "meta":
        raise ScanFailed("--verify needs real values and cannot run on --device meta; use --device cpu "
                         "(or cuda), or drop --verify")
    model, inputs, where = _prepare_for_target(options)

    from .auditing import audit, check_patterns

    check_patterns(model, options.trainable, "--trainable")
    check_patterns(model, options.freeze, "--freeze")

    report = audit(model, inputs, verify=options.verify, eager=options.eager,
                   trainable=list(options.trainable) if options.trainable else None,
                   frozen=list(options.freeze), select=options.select, ignore=options.ignore,
                   progress=options.progress, target=options.target if where == "meta" else None)

    options.progress("writing the reports")
    written = []
    if options.json:
        from .report import jsonout

        document = jsonout.render(report)
        if options.json == "-":
            sys.stdout.write(document.rstrip("\n") + "\n")
        else:
            _write(options.json, document, "--json")
            written.append(("JSON", options.json))
    if options.dot:
        from .report import graph

        _write(options.dot, graph.to_dot(report), "--dot")
        written.append(("DOT graph", options.dot))
    if options.svg:
        from .report import graph

        try:
            svg = graph.to_svg(report)
        except graph.GraphvizMissing as error:
            raise ScanFailed(f"cannot write --svg: {loading.first_line(error)} (install Graphviz, or "
                             f"use --dot and render it elsewhere)", error) from error
        _write(options.svg, svg, "--svg")
        written.append(("SVG graph", options.svg))
    if options.memory_viz:
        import pickle

        from .report import memory_viz

        _write(options.memory_viz, pickle.dumps(memory_viz.snapshot(report)), "--memory-viz")
        written.append(("memory_viz snapshot", options.memory_viz))
    if options.html:
        from .report import html

        _write(options.html, html.render(report, title=f"gradaudit: {options.spec}"), "--html")
        written.append(("HTML report", options.html))

    trim_figures = None
    if options.trim:
        trim_figures = _trim(model, inputs, options)
    options.progress.done()

    if options.quiet:
        out(_one_line(report))
    else:
        from .report import text

        stream = sys.stderr if to_stderr else sys.stdout
        # as wide as the terminal (COLUMNS when set): clipping is for narrow terminals only; a pipe or a
        # file (CI logs) gets whole lines unless COLUMNS says otherwise
        width = (max(60, shutil.get_terminal_size((100, 20)).columns)
                 if stream.isatty() or os.environ.get("COLUMNS") else None)
        color = stream.isatty() and "NO_COLOR" not in os.environ
        out(text.render(report, color=color, top=options.top, width=width).rstrip("\n"))
    if trim_figures is not None:
        out(_trim_lines(trim_figures))
    for what, path in written:
        out(f"{what}: {path}")

    return _thresholds(report, options, limit)


def _prepare_for_target(options: ScanOptions) -> tuple[Any, Any, str]:
    """``prepare``, refusing a --target other than cpu unless the model and inputs end up on meta
    (checked before building where --device already says, after it for --device auto). Returns the
    model, the inputs and the device type the audit will run on."""
    if options.target != "cpu" and options.device in ("cpu", "cuda"):
        raise ScanFailed(_target_needs_meta(options.target, options.device))
    model, inputs = prepare(options)
    where = _device_type(model, inputs)
    if options.target != "cpu" and where != "meta":  # --device auto, and the model is not on meta
        raise ScanFailed(_target_needs_meta(options.target, where))
    return model, inputs, where


def _target_needs_meta(target: str, device: str) -> str:
    return (f"--target {target} needs --device meta: it emulates {target}'s kernel choices on the meta device, "
            f"and this scan runs on {device}")


def _device_type(model: Any, inputs: Any) -> str:
    """The device type the audit will run on (as audit() sees it: the first parameter, else an input)."""
    from .tensors import iter_tensors

    first = next(iter(model.parameters()), None)
    if first is None:
        first = next(iter(iter_tensors(inputs)), None)
    return first.device.type if first is not None else "cpu"


def _one_line(report: Any) -> str:
    from .report.units import human_bytes
    from .report.views import selection

    every = (f", {human_bytes(report.reclaimable_with_all_fixes_bytes)} with all fixes"
             if report.rewrite_bytes else "")
    counted = f" ({selection(report)})" if report.select or report.ignore else ""
    return (f"{report.model}: {human_bytes(report.saved_bytes)} held for backward, "
            f"{human_bytes(report.reclaimable_bytes)} reclaimable "
            f"({human_bytes(report.reclaimable_with_bitpacking_bytes)} with bit-packing{every}), "
            f"{len(report.waste_findings)} waste findings{counted}")


def _trim(model: Any, inputs: Any, options: ScanOptions) -> dict[str, int]:
    try:
        from .trimming import compare
    except ImportError as error:
        raise ScanFailed(f"--trim is not available in this installation ({error})", error) from error
    from .auditing import apply_trainable

    if options.device == "meta":
        raise ScanFailed("--trim measures real memory and cannot run on --device meta; use --device cpu")
    # The audit applied --trainable/--freeze only for its own forward; do the same here.
    apply_trainable(model, list(options.trainable) if options.trainable else None, list(options.freeze))
    options.progress("measuring held and peak memory with and without trimming")
    try:
        return compare(model, inputs)
    except GradauditError:
        raise
    except Exception as error:
        raise ScanFailed(f"--trim failed: {type(error).__name__}: {error}", error) from error


def _trim_lines(figures: dict[str, int]) -> str:
    from .report.units import human_bytes

    lines = ["With gradaudit.trim (measured):"]
    for label, key in (("held for backward", "held"), ("peak, forward+backward", "peak")):
        before, after = figures[f"{key}_before"], figures[f"{key}_after"]
        lines.append(f"  {label:<22} {human_bytes(before):>10} -> {human_bytes(after):>10}  "
                     f"(-{human_bytes(before - after)})")
    return "\n".join(lines)


def _thresholds(report: Any, options: ScanOptions, limit: Optional[int]) -> int:
    """Both thresholds count what the summary shows: the selected rules' waste findings, and the
    bytes fixing all of them together frees (``reclaimable_with_all_fixes_bytes``, storage-aware),
    the figure ``assert_no_waste`` compares too."""
    from .report.units import human_bytes
    from .report.views import freed_parts

    code = EXIT_OK
    freed, count = report.reclaimable_with_all_fixes_bytes, len(report.waste_findings)
    findings = f"{count} waste finding{'s' if count != 1 else ''}"
    if options.fail_on_waste and count:
        click.echo(f"gradaudit: {findings} (--fail-on-waste)", err=True)
        code = EXIT_THRESHOLD
    if limit is not None and freed > limit:
        click.echo(f"gradaudit: fixing the {findings} would free {human_bytes(freed)} ({freed} bytes), which "
                   f"exceeds --max-reclaimable {options.max_reclaimable} ({limit} bytes): {freed_parts(report)}",
                   err=True)
        code = EXIT_THRESHOLD
    return code


# -- click -------------------------------------------------------------------------------------------

# how to build the model and its inputs, and where: scan and plan take the same options, declared once
# here; a command decorated with @model_options gets them as one ``model`` dict of ScanOptions fields
_MODEL_OPTIONS = (
    click.option("--inputs", "inputs", metavar="SPEC", help="Factory returning the inputs (Tensor, tuple of "
                 "positional arguments, or dict of keyword arguments), e.g. data.py:batch."),
    click.option("--input-shape", metavar="SHAPE", help="One random input of this shape, e.g. 8,3,224,224."),
    click.option("--dtype", default="float32", show_default=True, help="dtype for --input-shape "
                 "(integer dtypes give zeros: valid token ids)."),
    click.option("--input-requires-grad", is_flag=True, help="The --input-shape tensor requires grad "
                 "(e.g. adversarial attacks on a frozen model)."),
    click.option("--trainable", multiple=True, metavar="GLOB", help="Only parameters matching GLOB "
                 "(fnmatch over named_parameters) require grad during the audit. Repeatable."),
    click.option("--freeze", multiple=True, metavar="GLOB", help="Parameters matching GLOB need no grad "
                 "during the audit. Repeatable."),
    click.option("--train/--eval", "mode", default=None, help="Put the model in train or eval mode "
                 "[default: as the factory left it]."),
    click.option("--device", type=click.Choice(["auto", "meta", "cpu", "cuda"]), default="auto",
                 show_default=True, help="meta: build the model under torch.device('meta') and use meta "
                 "inputs (no memory, no weights); auto: the device the model is on."),
    click.option("--target", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
                 help="With --device meta: the device the figures are for; the forward takes the kernels it "
                 "would take (cuda: cuDNN batch norm) and autocast is emulated as its own."),
    click.option("--target-gpu", "target_gpu", metavar="NAME", help="With --target cuda: the GPU the figures are "
                 "for, by name (H100, A100, L4, B200, ...) or compute capability (sm90) [default: H100]."),
    click.option("--target-torch", "target_torch", metavar="X.Y", help="With --target cuda: the torch release that "
                 "GPU runs (2.11 to 2.15), whose kernel choices apply [default: the installed one]."),
    click.option("--target-cudnn", "target_cudnn", metavar="X.Y", help="With --target cuda: the cuDNN that torch "
                 "loads there [default: the installed torch's, or the one --target-torch's CUDA wheel bundles]."),
    click.option("--world-size", "world_size", type=click.IntRange(min=1), metavar="N", help="The factory "
                 "parallelises the model for N ranks (FSDP2, tensor or sequence parallel): it runs in a fake process "
                 "group of N, once per rank, and each rank's figures are its own (DTensors by their local shards)."),
    click.option("--rank", "ranks", type=click.IntRange(min=0), multiple=True, metavar="R", help="With --world-size: "
                 "only rank R (repeatable) [default: every rank; ranks that come out alike are shown once]."),
)
_MODEL_FIELDS = ("inputs", "input_shape", "dtype", "input_requires_grad", "trainable", "freeze", "mode", "device",
                 "target", "target_gpu", "target_torch", "target_cudnn", "world_size", "ranks")
quiet_option = click.option("-q", "--quiet", is_flag=True, help="Print one summary line.")
debug_option = click.option("--debug", is_flag=True, help="Show full tracebacks.")


def model_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Declare the model options (``_MODEL_OPTIONS``) on ``command``, which gets them as ``model``."""
    @functools.wraps(command)
    def with_model(**options: Any) -> Any:
        return command(model={name: options.pop(name) for name in _MODEL_FIELDS}, **options)

    for option in reversed(_MODEL_OPTIONS):
        with_model = option(with_model)
    return with_model


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
             epilog=EXIT_CODES_HELP)
@click.version_option(package_name="gradaudit", prog_name="gradaudit")
def cli() -> None:
    """Find the memory PyTorch autograd holds for backward that backward can never use."""


@cli.command(epilog=EXIT_CODES_HELP, short_help="Audit a model built by a factory.")
@click.argument("spec", metavar="SPEC")
@model_options
@click.option("--html", metavar="PATH", default="gradaudit-report.html", show_default=True,
              help="Write the self-contained HTML report here.")
@click.option("--no-html", is_flag=True, help="Do not write the HTML report.")
@click.option("--json", "json_path", metavar="PATH", help="Write the JSON report ('-' for stdout; the "
              "summary then goes to stderr).")
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
@click.option("--trim", is_flag=True, help="Also measure held and peak memory with gradaudit.trim.")
@quiet_option
@click.option("-v", "--verbose", count=True, help="List more findings (-v: 50, -vv: all).")
@debug_option
def scan(spec: str, model: dict[str, Any], html: str, no_html: bool, json_path: Optional[str], svg: Optional[str],
         dot: Optional[str], memory_viz: Optional[str], verify: bool,
         select: tuple[str, ...], ignore: tuple[str, ...], fail_on_waste: bool,
         max_reclaimable: Optional[str], eager: bool, trim: bool, quiet: bool, verbose: int,
         debug: bool) -> None:
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
    """
    progress = Progress(enabled=sys.stderr.isatty() and not quiet)
    options = ScanOptions(
        spec=spec, **model, html=None if no_html else html, json=json_path, svg=svg, dot=dot, memory_viz=memory_viz,
        verify=verify, eager=eager,
        select=_split_codes(select), ignore=_split_codes(ignore), fail_on_waste=fail_on_waste,
        max_reclaimable=max_reclaimable, top={0: 10, 1: 50}.get(verbose, 1_000_000), quiet=quiet, trim=trim,
        progress=progress,
    )
    _exit_with(lambda: _per_rank(options, lambda ranked, _: run_scan(ranked)), progress, debug)


def _ranked_path(path: Optional[str], rank: int) -> Optional[str]:
    """``report.html`` -> ``report.rank3.html``: with --world-size each rank writes its own files."""
    if not path or path == "-":
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


class _RankProgress:
    """The command's progress line, each step prefixed with the rank it is for."""

    def __init__(self, progress: Any, rank: int, size: int) -> None:
        self.progress, self.prefix = progress, f"rank {rank} of {size}: "

    def __call__(self, step: str) -> None:
        self.progress(self.prefix + step)

    def done(self) -> None:
        pass  # the line stays until the last rank is done


def _assumed_gpu(options: ScanOptions) -> Any:
    """The --target-gpu/--target-torch/--target-cudnn context (``cuda_choices.assume_gpu``), each
    value checked with its option named; a null context when none is given."""
    import contextlib

    from . import cuda_choices

    given = {"--target-gpu": options.target_gpu, "--target-torch": options.target_torch,
             "--target-cudnn": options.target_cudnn}
    named = [option for option, value in given.items() if value is not None]
    if not named:
        return contextlib.nullcontext()
    if options.target != "cuda":
        raise ScanFailed(f"{named[0]} says which GPU --target cuda stands for: add --target cuda (and --device meta)")
    parsers = {"--target-gpu": cuda_choices.parse_gpu, "--target-torch": cuda_choices.parse_release,
               "--target-cudnn": cuda_choices.parse_cudnn}
    for option in named:
        try:
            parsers[option](given[option])
        except GradauditError as error:
            raise ScanFailed(f"{option}: {error}") from error
    return cuda_choices.assume_gpu(options.target_gpu, torch=options.target_torch, cudnn=options.target_cudnn)


def _per_rank(options: ScanOptions, body: Callable[[ScanOptions, Callable[[Optional[str]], Optional[str]]], int]) -> int:
    """Run a command's ``body(options, path)`` as it is, or with --world-size once per rank, each in
    a fake process group as that rank (``path`` gives each rank's file names). A rank's output is
    collected; ranks whose output is alike (their rank aside) are printed once, under one header.
    With --target-gpu/--target-torch/--target-cudnn, every run stands for that GPU."""
    with _assumed_gpu(options):
        return _per_rank_runs(options, body)


def _per_rank_runs(options: ScanOptions,
                   body: Callable[[ScanOptions, Callable[[Optional[str]], Optional[str]]], int]) -> int:
    if options.world_size is None:
        if options.ranks:
            raise ScanFailed("--rank needs --world-size N (the number of ranks the factory parallelises for)")
        return body(options, lambda path: path)
    import contextlib
    import dataclasses
    import io
    import json

    from .ranks import check_world, fake_world, rank_list

    if options.device == "cuda":
        raise ScanFailed("--world-size runs every rank in this process, in a fake process group: use --device cpu "
                         "or meta (with --target cuda for a GPU's figures)")
    try:
        size, ranks = check_world(options.world_size, list(options.ranks))
    except GradauditError as error:
        raise ScanFailed(f"--rank: {error}") from error
    runs = []
    for rank in ranks:
        def path(value: Optional[str], rank: int = rank) -> Optional[str]:
            return _ranked_path(value, rank)

        ranked = dataclasses.replace(options, html=path(options.html), json=path(options.json), svg=path(options.svg),
                                     dot=path(options.dot), memory_viz=path(options.memory_viz),
                                     progress=_RankProgress(options.progress, rank, size))
        out, err = io.StringIO(), io.StringIO()
        try:
            with fake_world(size, rank, device="meta" if options.device == "meta" else None), \
                    contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = body(ranked, path)
        except (GradauditError, ScanFailed) as error:
            raise type(error)(f"rank {rank} of {size}: {error}") from error
        runs.append((rank, code, out.getvalue(), err.getvalue()))
    options.progress.done()

    def alike(rank: int, text: str) -> str:
        return text.replace(f"rank {rank} of {size}", f"rank * of {size}").replace(f".rank{rank}", ".rank*")

    groups: dict[tuple, list] = {}
    for rank, code, out, err in runs:
        groups.setdefault((code, alike(rank, out), alike(rank, err)), []).append((rank, code, out, err))
    if options.json == "-":  # one JSON document on stdout: each group's document under its ranks
        document = {"tool": "gradaudit", "world_size": size,
                    "groups": [{"ranks": [r for r, *_ in members], "document": json.loads(members[0][2])}
                               for members in groups.values()]}
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    for members in groups.values():
        rank, code, out, err = members[0]
        label = (f"rank {rank} of {size}" if len(members) == 1 else
                 f"ranks {rank_list([r for r, *_ in members])} of {size} (alike: rank {rank} shown)")
        if options.json != "-" and out:
            click.echo(f"== {label} ==\n{out.rstrip()}")
        if err:
            click.echo(f"== {label} ==\n{err.rstrip()}" if options.json == "-" else err.rstrip(), err=True)
    return max(code for _, code, _, _ in runs)


def _exit_with(run: Callable[[], int], progress: "Progress", debug: bool) -> None:
    """Run a command and exit with its code; an error is one or two lines (``_fail``), exit 2."""
    try:
        code = run()
    except (GradauditError, ScanFailed) as error:
        progress.done()
        message = str(error)
        if isinstance(error, ForwardError) and len(message.splitlines()) < 2:
            # (on meta, the message's second line already says what to do)
            message += ("\ncheck that the inputs (factory, --inputs or --input-shape) match what the "
                        "model's forward expects")
        _fail(message, debug)
    except KeyboardInterrupt:
        progress.done()
        click.echo("gradaudit: interrupted", err=True)
        sys.exit(130)
    except Exception as error:  # a bug in gradaudit or a reporter: say so, still without a wall of text
        progress.done()
        _fail(f"internal error: {type(error).__name__}: {error}\n"
              f"this is a gradaudit bug; run again with --debug and report the traceback", debug)
    sys.exit(code)


def _fail(message: str, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    # what failed, then what to do: each line whole, never cut; on a terminal wrapped to its width,
    # elsewhere (a log, a pipe) one line each, for grep
    lines = message.strip().splitlines() or ["failed"]
    lines = [f"gradaudit: error: {lines[0]}", *(f"  {line}" for line in lines[1:2])]
    if sys.stderr.isatty():
        width = max(60, shutil.get_terminal_size((100, 24)).columns - 1)
        lines = [wrapped for line in lines for wrapped in textwrap.wrap(
            line, width, subsequent_indent="  ", break_on_hyphens=False, drop_whitespace=False) or [line]]
    for line in lines:
        click.echo(line, err=True)
    sys.exit(EXIT_ERROR)


PLAN_EXIT_CODES_HELP = """\b
Exit codes:
  0  a plan fits the budget (printed, and written with --json)
  2  no plan of the candidate blocks fits (the least they can hold is
     printed), or something prevented planning (as for scan)
"""


def _cost_needs_a_real_device() -> str:
    return ("--cost time measures the forward on the model's device, and the meta device computes nothing: "
            "use --device cpu or cuda, or --cost flops")


def run_plan(options: ScanOptions, budget_texts: Sequence[str], blocks: tuple[str, ...], peak: bool = True,
             html_path: Optional[str] = None, selective: bool = True, cost: str = Cost.FLOPS, trim: bool = False,
             bitpack: bool = True, bound: str = Bound.HELD, loss_spec: Optional[str] = None) -> int:
    from . import loading
    from .auditing import check_patterns
    from .planning import BudgetError, plan
    from .planning.timing import REPEATS
    from .report import plantext

    to_stderr = options.json == "-"

    def out(text: str) -> None:
        click.echo(text, err=to_stderr)

    if options.json and options.json != "-":
        _check_writable(options.json, "--json")
    if html_path:
        _check_writable(html_path, "--html")
    budgets = [sizes.parse_size(text) for text in budget_texts]
    if len(budgets) > 1 and html_path:
        raise ScanFailed("--html draws one plan: give one --budget (several make a sweep table)")
    if cost == Cost.TIME and options.device == "meta":
        raise ScanFailed(_cost_needs_a_real_device())
    if not bitpack and not trim:
        raise ScanFailed("--no-bitpack is an option of --trim: give both, or neither")
    if bound == Bound.PEAK and not peak:
        raise ScanFailed("--bound peak chooses by measured peaks: it cannot run with --no-peak")
    budget = budgets[0]
    loss = loading.load_object(loss_spec) if loss_spec else None
    if loss is not None and not callable(loss):
        raise ScanFailed(f"--loss {loss_spec} is not callable: give module:function taking the model's output")
    model, inputs, where = _prepare_for_target(options)
    if cost == Cost.TIME and where == "meta":  # --device auto, and the factory built it on meta
        raise ScanFailed(_cost_needs_a_real_device())
    check_patterns(model, options.trainable, "--trainable")
    check_patterns(model, options.freeze, "--freeze")
    code = EXIT_OK
    try:
        chosen = plan(model, inputs, budget, trainable=list(options.trainable) if options.trainable else None,
                      frozen=list(options.freeze), blocks=list(blocks) or None,
                      measure_peak=peak and (len(budgets) == 1 or bound == Bound.PEAK), selective=selective,
                      cost=cost, bound=bound,
                      target=options.target if where == "meta" else None, trim=trim,
                      bitpack=bitpack if trim else None, loss=loss, progress=options.progress)
    except BudgetError as error:
        chosen, code = error.smallest_plan, EXIT_ERROR
    options.progress.done()
    if len(budgets) > 1:
        return _sweep(chosen, budgets, options, out, peaks=peak)
    if options.json:
        _write_json(options.json, chosen.to_dict())
    if html_path:
        from .report import planhtml

        _write(html_path, planhtml.render(chosen, title=f"gradaudit plan: {options.spec}"), "--html")

    out(plantext.render(chosen, repeats=REPEATS, quiet=options.quiet))
    if options.quiet:
        return code
    if options.json and options.json != "-":
        out(f"JSON plan: {options.json}")
    if html_path:
        out(f"HTML plan: {html_path}")
    return code


def _sweep(first: Any, budgets: Sequence[int], options: ScanOptions, out: Callable[[str], None],
           peaks: bool = True) -> int:
    """One line per budget, from one audit: what to checkpoint and at what extra compute (and, unless
    --no-peak, each plan's measured peak: one step per budget)."""
    from .report import plantext

    plans = first.sweep(budgets, measure_peak=peaks)
    code = EXIT_OK if all(p.fits for p in plans) else EXIT_ERROR
    if options.json:
        _write_json(options.json, {"plans": [p.to_dict() for p in plans]})
    out(plantext.render_sweep(plans))
    if options.json and options.json != "-":
        out(f"JSON plans: {options.json}")
    return code


@cli.command("plan", epilog=PLAN_EXIT_CODES_HELP, short_help="Choose what to checkpoint for a memory budget.")
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
@click.option("--loss", "loss_spec", metavar="MODULE:FN", help="A function from the model's output to the scalar "
              "loss the measured steps backpropagate (default: the output's loss, as Hugging Face models given "
              "labels return, else the sum of its first tensor; as fit takes it).")
@quiet_option
@debug_option
def plan_command(spec: str, budget: tuple[str, ...], model: dict[str, Any], blocks: tuple[str, ...],
                 json_path: Optional[str],
                 html_path: Optional[str], no_peak: bool, cost: str, bound: str, no_selective: bool,
                 trim: bool, no_bitpack: bool, loss_spec: Optional[str], quiet: bool,
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
    options = ScanOptions(spec=spec, **model, html=None, json=json_path, quiet=quiet, progress=progress)
    _exit_with(lambda: _per_rank(options, lambda ranked, path: run_plan(
        ranked, budget, blocks, peak=not no_peak, html_path=path(html_path), cost=cost, selective=not no_selective,
        trim=trim, bitpack=not no_bitpack, bound=bound, loss_spec=loss_spec)), progress, debug)


FIT_EXIT_CODES_HELP = """\b
Exit codes:
  0  the step fits, or a remedy makes it fit (printed)
  2  the step does not fit and no remedy does, or something prevented
     the fit (as for scan)
"""

_AUTOCAST_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


def run_fit(options: ScanOptions, memory_text: str, optimizer: str, loss_spec: Optional[str],
            autocast: Optional[str], remedy: bool, largest: Optional[str] = None,
            html_path: Optional[str] = None, memory_viz_path: Optional[str] = None, accumulation: int = 1,
            headroom_text: Optional[str] = None) -> int:
    import torch

    from . import loading
    from .auditing import check_patterns
    from .fitting import fit
    from .report import fittext

    to_stderr = options.json == "-"
    if options.json and options.json != "-":
        _check_writable(options.json, "--json")
    if html_path:
        _check_writable(html_path, "--html")
    if memory_viz_path:
        _check_writable(memory_viz_path, "--memory-viz")
    memory = sizes.parse_size(memory_text)
    headroom = sizes.parse_size(headroom_text) if headroom_text is not None else None
    loss = loading.load_object(loss_spec) if loss_spec else None
    if loss is not None and not callable(loss):
        raise ScanFailed(f"--loss {loss_spec} is not callable: give module:function taking the model's output")
    model, inputs, where = _prepare_for_target(options)
    check_patterns(model, options.trainable, "--trainable")
    check_patterns(model, options.freeze, "--freeze")
    result = fit(model, inputs, memory=memory, optimizer=optimizer, loss=loss,
                 trainable=list(options.trainable) if options.trainable else None, frozen=list(options.freeze),
                 target=options.target if where == "meta" else None,
                 autocast=getattr(torch, _AUTOCAST_DTYPES[autocast]) if autocast else None,
                 accumulation=accumulation, headroom=headroom, remedy=remedy, progress=options.progress)
    found = None
    if largest:
        options.progress(f"searching the largest {largest} that fits")
        found = result.largest(largest)
    options.progress.done()
    if options.json:
        _write_json(options.json, {**result.to_dict(), **({"largest": {largest: found}} if largest else {})})
    if html_path:
        from .report import fithtml

        _write(html_path, fithtml.render(result, title=f"gradaudit fit: {options.spec}"), "--html")
    if memory_viz_path:
        import pickle

        from .report import memory_viz

        _write(memory_viz_path, pickle.dumps(memory_viz.fit_snapshot(result)), "--memory-viz")
    click.echo(fittext.render(result, quiet=options.quiet), err=to_stderr)
    if html_path and not options.quiet:
        click.echo(f"HTML fit: {html_path}", err=to_stderr)
    if memory_viz_path and not options.quiet:
        click.echo(f"memory_viz snapshot: {memory_viz_path}", err=to_stderr)
    if largest:
        click.echo(f"largest {largest} that fits as it is: {found} (measured: {found} fits, {found + 1} does not)",
                   err=to_stderr)
    if options.json and options.json != "-" and not options.quiet:
        click.echo(f"JSON fit: {options.json}", err=to_stderr)
    return EXIT_OK if result.fits or result.remedy is not None else EXIT_ERROR


@cli.command("fit", epilog=FIT_EXIT_CODES_HELP, short_help="Will a training step fit in memory, and what makes it.")
@click.argument("spec", metavar="SPEC")
@click.option("--memory", required=True, metavar="SIZE", help="The memory the step may use, e.g. 80GiB.")
@model_options
@click.option("--optimizer", default="adamw", show_default=True, metavar="NAME",
              help="A torch.optim optimizer by name (adamw, adam, sgd, ... in any case) or module:Class; it runs "
              "with its defaults over the parameters that train.")
@click.option("--loss", "loss_spec", metavar="MODULE:FN", help="A function from the model's output to the scalar "
              "loss (default: the output's loss, as Hugging Face models given labels return, else the sum of "
              "its first tensor).")
@click.option("--autocast", type=click.Choice(sorted(_AUTOCAST_DTYPES)), help="Run the forward and the loss "
              "under torch.autocast with this dtype (backward and the optimizer step after it closes).")
@click.option("--accumulate", "accumulation", type=click.IntRange(min=1), default=1, show_default=True,
              metavar="N", help="Gradient accumulation: N micro-batches (each the batch SPEC gives) per "
              "optimizer step, their gradients added up by backward.")
@click.option("--headroom", "headroom_text", metavar="SIZE", help="What the device needs beside the step's peak, "
              "left free by the verdict and the remedy (default: on CUDA, what the caching allocator would reserve "
              "beyond the peak, estimated for each step; on the CPU nothing).")
@click.option("--no-remedy", is_flag=True, help="Do not search for a change that makes the step fit.")
@click.option("--largest", type=click.Choice(["batch", "seq"]), help="Also find the largest batch (dimension 0 of "
              "the inputs) or sequence length (dimension 1) whose step fits as it is, by measured steps.")
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
    change (gradaudit.trim, a checkpoint plan) whose measured step fits, beside checkpointing every
    block.

    \b
    Examples:
      gradaudit fit examples/llama_probe.py:build --memory 24GiB --target cuda
      gradaudit fit mymodel.py:make --input-shape 8,3,224,224 --memory 8GiB --optimizer sgd
      gradaudit fit mymodel.py:make --device meta --target cuda --memory 80GiB --json fit.json
      gradaudit fit examples/llama_probe.py:build --memory 80GiB --target cuda --largest batch
    """
    progress = Progress(enabled=sys.stderr.isatty() and not quiet)
    options = ScanOptions(spec=spec, **model, html=None, json=json_path, quiet=quiet, progress=progress)
    _exit_with(lambda: _per_rank(options, lambda ranked, path: run_fit(
        ranked, memory, optimizer, loss_spec, autocast, remedy=not no_remedy, largest=largest,
        html_path=path(html_path), memory_viz_path=path(memory_viz_path), accumulation=accumulation,
        headroom_text=headroom_text)),
        progress, debug)


@cli.command("rules", short_help="List the rule catalogue.")
def rules_command() -> None:
    """List the rule catalogue: code, name, severity and what each rule flags."""
    from .rules import all_rules

    catalogue = all_rules()
    name_width = max((len(r.name) for r in catalogue), default=4)
    for r in catalogue:
        click.echo(f"{r.code}  {r.name:<{name_width}}  {r.severity:<7}  {r.summary}")
    click.echo(f"\n{len(catalogue)} rules. `gradaudit explain CODE` prints one rule's documentation.")


@cli.command(short_help="Print one rule's documentation.")
@click.argument("code")
def explain(code: str) -> None:
    """Print one rule's documentation, e.g. `gradaudit explain GA101`."""
    from .rules import all_rules

    wanted = code.strip()
    found = [r for r in all_rules() if r.code == wanted.upper() or r.name == wanted.lower()]
    if not found:
        click.echo(f"gradaudit: error: no rule {code!r}; `gradaudit rules` lists the codes", err=True)
        sys.exit(EXIT_ERROR)
    r = found[0]
    click.echo(f"{r.code} {r.name} ({r.severity})\n")
    click.echo(r.doc)
    if r.fix_code:
        click.echo(f"\nFix ({'gradients stay bit-identical' if r.fix_safe else 'changes numerics'}): {r.fix}")
        click.echo("\n".join("    " + line for line in r.fix_code.splitlines()))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point (also ``python -m gradaudit``)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="gradaudit")
