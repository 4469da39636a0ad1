"""What scan, plan and fit share on the way in: the options that say how to build the model and its
inputs and where (declared once, ``model_options``), the ``CommandOptions`` they fill, and building
the model as they say (``prepare``), with the GPU a ``--target cuda`` run stands for."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional, Sequence

import click

from ..errors import GradauditError
from .output import CommandFailed, Progress


@dataclass
class CommandOptions:
    """One command's options: the model's (``model_options``) and its outputs. Scan's own are here too;
    plan and fit take theirs as arguments."""

    spec: str
    inputs: Optional[str] = None
    input_shape: Optional[str] = None
    dtype: str = "float32"
    input_requires_grad: bool = False
    trainable: tuple[str, ...] = ()
    freeze: tuple[str, ...] = ()
    mode: Optional[bool] = None  # True train, False eval, None as the factory left it
    device: str = "auto"
    target: str = "cpu"  # the device type a run on meta stands for
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
    compare_eager: bool = False
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    fail_on_waste: bool = False
    max_reclaimable: Optional[str] = None
    top: int = 10
    quiet: bool = False
    trim: bool = False
    output_format: str = "text"  # scan's stdout: text, json, github (workflow annotations) or sarif
    schedules: bool = False  # whether the factory may return a pipeline schedule (fit, scan)
    world_size: Optional[int] = None  # --world-size: every rank in a fake process group of this size
    ranks: tuple[int, ...] = ()  # --rank: which ranks (default: every rank)
    progress: Any = field(default_factory=lambda: Progress(enabled=False))

    @property
    def trainable_patterns(self) -> Optional[list[str]]:
        """--trainable as the library takes it: None when not given (the model's own requires_grad)."""
        return list(self.trainable) if self.trainable else None


def split_codes(values: Sequence[str]) -> tuple[str, ...]:
    """``--select GA1,GA2 --select GA301`` -> ("GA1", "GA2", "GA301")."""
    return tuple(part.strip().upper() for v in values for part in v.split(",") if part.strip())


def prepare(options: CommandOptions) -> tuple[Any, Any]:
    """Build the model and its inputs as the options say (device, mode, inputs)."""
    import torch

    from .. import loading

    device = options.device
    if device == "cuda" and not torch.cuda.is_available():
        raise CommandFailed("--device cuda: no CUDA device is available; use --device cpu or meta")
    build_device = "meta" if device == "meta" else None
    options.progress(f"building the model ({options.spec})")
    model, inputs = loading.build_model(options.spec, build_device, schedules=options.schedules)
    module = module_of(model)
    if module is not model:  # a pipeline schedule: its stages were built on their device
        on = {p.device.type for p in module.parameters()}
        if device in ("cpu", "cuda") and on and on != {device}:
            raise CommandFailed(f"--device {device}: the pipeline stage's module is on {', '.join(sorted(on))}; "
                                f"build the stage on {device} (a schedule cannot be moved)")
    elif device in ("cpu", "cuda"):
        try:
            model = model.to(device)
        except Exception as error:  # e.g. a factory that builds on meta: there are no values to copy
            raise CommandFailed(f"cannot move the model to {device}: {loading.first_line(error)}\n"
                                f"a factory that builds on the meta device needs --device meta (or auto)",
                                error) from error
    first = next(iter(module.parameters()), None)
    if first is None:
        first = next(iter(module.buffers()), None)
    where = device if device != "auto" else (str(first.device) if first is not None else "cpu")
    if options.inputs:
        options.progress(f"building the inputs ({options.inputs})")
        inputs = loading.load_inputs(options.inputs, build_device)
    elif options.input_shape:
        shape = loading.parse_shape(options.input_shape)
        inputs = loading.random_input(shape, loading.parse_dtype(options.dtype), where,
                                      options.input_requires_grad)
    if inputs is None:
        raise CommandFailed(f"no inputs: the factory {options.spec} returned only a model; return (model, "
                            f"inputs), or pass --inputs SPEC or --input-shape 8,3,224,224")
    inputs = loading.to_device(inputs, where)
    if options.mode is not None:
        module.train(options.mode)
    return model, inputs


def module_of(model: Any) -> Any:
    """The module a command works on: the model, or a pipeline schedule's stage module(s)."""
    from ..torchapi.pipelining import is_schedule, stage_module

    return stage_module(model) if is_schedule(model) else model


def prepare_for_target(options: CommandOptions) -> tuple[Any, Any, str]:
    """``prepare``, refusing a --target other than cpu unless the model and inputs end up on meta
    (checked before building where --device already says, after it for --device auto), and checking
    the --trainable and --freeze patterns against the model. Returns the model, the inputs and the
    device type the run will take place on."""
    from ..conditions import check_patterns

    if options.target != "cpu" and options.device in ("cpu", "cuda"):
        raise CommandFailed(_target_needs_meta(options.target, options.device))
    model, inputs = prepare(options)
    where = _device_type(module_of(model), inputs)
    if options.target != "cpu" and where != "meta":  # --device auto, and the model is not on meta
        raise CommandFailed(_target_needs_meta(options.target, where))
    check_patterns(module_of(model), options.trainable, "--trainable")
    check_patterns(module_of(model), options.freeze, "--freeze")
    return model, inputs, where


def _target_needs_meta(target: str, device: str) -> str:
    return (f"--target {target} needs --device meta: it emulates {target}'s kernel choices on the meta device, "
            f"and this scan runs on {device}")


def _device_type(model: Any, inputs: Any) -> str:
    """The device type the run takes place on (as audit() sees it: the first parameter, else an input)."""
    from ..tensors import iter_tensors

    first = next(iter(model.parameters()), None)
    if first is None:
        first = next(iter(iter_tensors(inputs)), None)
    return first.device.type if first is not None else "cpu"


def load_loss(spec: Optional[str]) -> Optional[Callable[..., Any]]:
    """``--loss MODULE:FN``: the function, checked to be callable (None when not given)."""
    from .. import loading

    loss = loading.load_object(spec) if spec else None
    if loss is not None and not callable(loss):
        raise CommandFailed(f"--loss {spec} is not callable: give module:function taking the model's output")
    return loss


def assumed_gpu(options: CommandOptions) -> ContextManager[Any]:
    """The --target-gpu/--target-torch/--target-cudnn context (``cuda_choices.assume_gpu``), each
    value checked with its option named; a null context when none is given."""
    from .. import cuda_choices

    given = {"--target-gpu": options.target_gpu, "--target-torch": options.target_torch,
             "--target-cudnn": options.target_cudnn}
    named = [option for option, value in given.items() if value is not None]
    if not named:
        return contextlib.nullcontext()
    if options.target != "cuda":
        raise CommandFailed(f"{named[0]} says which GPU --target cuda stands for: add --target cuda (and "
                            f"--device meta)")
    parsers = {"--target-gpu": cuda_choices.parse_gpu, "--target-torch": cuda_choices.parse_release,
               "--target-cudnn": cuda_choices.parse_cudnn}
    for option in named:
        try:
            parsers[option](given[option])
        except GradauditError as error:
            raise CommandFailed(f"{option}: {error}") from error
    return cuda_choices.assume_gpu(options.target_gpu, torch=options.target_torch, cudnn=options.target_cudnn)


# -- click -------------------------------------------------------------------------------------------

# how to build the model and its inputs, and where: scan, plan and fit take the same options, declared
# once here; a command decorated with @model_options gets them as one ``model`` dict of CommandOptions fields
_MODEL_OPTIONS = (
    click.option("--inputs", "inputs", metavar="SPEC", help="Factory returning the inputs (Tensor, tuple of "
                 "positional arguments, or dict of keyword arguments), e.g. data.py:batch."),
    click.option("--input-shape", metavar="SHAPE", help="One random input of this shape, e.g. 8,3,224,224."),
    click.option("--dtype", default="float32", show_default=True, help="dtype for --input-shape "
                 "(integer dtypes give zeros: valid token ids)."),
    click.option("--input-requires-grad", is_flag=True, help="The --input-shape tensor requires grad "
                 "(e.g. adversarial attacks on a frozen model)."),
    click.option("--trainable", multiple=True, metavar="GLOB", help="Only parameters matching GLOB "
                 "(fnmatch over named_parameters) require grad, for what this command runs (the model is put "
                 "back after). Repeatable."),
    click.option("--freeze", multiple=True, metavar="GLOB", help="Parameters matching GLOB need no grad, "
                 "for what this command runs (the model is put back after). Repeatable."),
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
                 "parallelises the model for N ranks (FSDP2, tensor or sequence parallel, DDP, a pipeline schedule's "
                 "stage): it runs in a fake process "
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
