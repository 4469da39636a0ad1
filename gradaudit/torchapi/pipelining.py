"""Pipeline parallelism (``torch.distributed.pipelining``): a schedule's stages, their buffers, their chunks.

A rank of a pipeline runs its schedule's ``step``: the forward of each micro-batch through its stage(s),
the backward of each, in the order the schedule decides (GPipe: every forward, then every backward;
1F1B: stage s of p runs p - s forwards ahead, then one backward per forward). What a stage holds beside
its module: one receive buffer per micro-batch for the activations it is sent (their gradients, made
by its backward, stay until the next step begins) and one per micro-batch for the gradients it is sent
back, allocated in the first step and kept; on the last stage, each micro-batch's output, kept until
the next step begins (the merged output is made of them).

In PyTorch's fake process group the sends and receives do nothing, so a rank's whole step runs in one
process as it would in a pipeline, given a stage built with static metadata (``input_args``,
``output_args``: inferring shapes at run time needs the other ranks, and PyTorch refuses it there).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
from typing import Any, Callable, Iterator, Optional

import torch

from ..errors import GradauditError

# the stage's methods that run one micro-batch's work (zero-bubble schedules split the backward in two)
CHUNKS = (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
          ("backward_weight_one_chunk", "backward of the weights"))


def is_schedule(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.pipelining`` schedule (only possible once it is imported)."""
    module = sys.modules.get("torch.distributed.pipelining.schedules")
    base = getattr(module, "_PipelineSchedule", None)
    return base is not None and isinstance(value, base)


def stages_of(schedule: Any) -> list[Any]:
    """The stages this rank runs: one for a single-stage schedule (GPipe, 1F1B), several for an
    interleaved one."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def stage_module(schedule: Any) -> torch.nn.Module:
    """The module(s) this rank runs: its stage's module, or a ModuleList of its stages' (interleaved)."""
    modules = [stage.submod for stage in stages_of(schedule)]
    return modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules)


def micro_batch_count(schedule: Any) -> int:
    return int(schedule._n_microbatches)


def received_buffers(schedule: Any, passed: bool) -> list[torch.Tensor]:
    """The receive buffers this rank's stages hold (none before their first step): the activations of each
    micro-batch and the gradients sent back for each. ``passed``: False, those other ranks send into
    (allocated once, kept); True, those this rank's own adjacent stages fill (a V-shaped schedule passes
    their outputs and gradients in place of a send: each buffer then the other stage's tensor, kept until
    the next step replaces it)."""
    stages = stages_of(schedule)
    here = {stage.stage_index for stage in stages}
    buffers = []
    for stage in stages:
        for infos in [*getattr(stage, "args_recv_info", {}).values(), *getattr(stage, "grad_recv_info", {}).values()]:
            for info in infos if isinstance(infos, (tuple, list)) else (infos,):
                buffer = getattr(info, "buffer", None)
                if isinstance(buffer, torch.Tensor) and not getattr(info, "is_root_arg", False):
                    if (getattr(info, "source", None) in here) == passed:
                        buffers.append(buffer)
    return buffers


def passes_between_own_stages(schedule: Any) -> bool:
    """Whether this rank runs two adjacent stages (a V-shaped schedule: ZBVZeroBubble, DualPipeV), which
    pass their outputs and gradients to each other in place of a send and a receive."""
    indices = {stage.stage_index for stage in stages_of(schedule)}
    return any(index + 1 in indices for index in indices)


def statically_shaped(stage: Any) -> bool:
    """Whether ``stage`` was given the shapes of its inputs and outputs (``input_args`` and ``output_args``),
    which a fake process group needs (a stage that has run a step knows them either way)."""
    if getattr(stage, "_stage_initialized", False) or getattr(stage, "args_recv_info", None):
        return True
    if getattr(stage, "pipe_info", None) is not None:  # built by pipeline(): its shapes are the trace's
        return True
    user = getattr(stage, "_user_meta", None)  # torch >= 2.14
    if user is not None:
        return user.inputs is not None and user.outputs is not None
    return getattr(stage, "inputs_meta", None) is not None and getattr(stage, "_outputs_meta", None) is not None


def _input_metas(stage: Any) -> Any:
    """The shapes ``stage`` was given for its inputs (``input_args``), or None: torch >= 2.14 keeps them as
    metadata (``_user_meta.inputs``), earlier releases as the example tensors (``inputs_meta``)."""
    user = getattr(stage, "_user_meta", None)
    return user.inputs if user is not None else getattr(stage, "inputs_meta", None)


def _output_metas(stage: Any) -> Any:
    """The shapes ``stage`` was given for its outputs (``output_args``), or None (as ``_input_metas``)."""
    user = getattr(stage, "_user_meta", None)
    return user.outputs if user is not None else getattr(stage, "_outputs_meta", None)


def micro_batch_shape(schedule: Any) -> tuple[int, ...]:
    """The shape of a micro-batch's first input on this rank's first stage (its static ``input_args``)."""
    stage = stages_of(schedule)[0]
    metas = _input_metas(stage)
    if not metas:
        made = "built by pipeline() (its shapes traced)" if getattr(stage, "pipe_info", None) else "given no input_args"
        raise GradauditError(f"the schedule's stage was {made}: only a PipelineStage built with input_args and "
                             f"output_args is rebuilt at another size")
    return tuple(metas[0].shape)


def batch_mismatch(schedule: Any, inputs: Any) -> Optional[str]:
    """Why this rank's batch cannot run its schedule, in one line (None: it can): the schedule splits the
    batch (the first stage's inputs, the last stage's ``target``) along dimension 0 into its micro-batches,
    which must split it evenly into the rows the stages were built for (``input_args``, ``output_args``);
    otherwise the step fails deep in the schedule, on another rank, or with a loss's shape complaint."""
    from ..tensors import Args, iter_tensors

    count = micro_batch_count(schedule)
    kwargs = inputs.kwargs if isinstance(inputs, Args) else inputs if isinstance(inputs, dict) else {}
    target = kwargs.get("target")
    args = [t for t in iter_tensors(inputs) if t is not target and t.dim() > 0]
    for stage in stages_of(schedule):
        if not statically_shaped(stage):
            continue
        for given, metas, role in ((args, _input_metas(stage), "input_args"),
                                   ([target] if isinstance(target, torch.Tensor) else [], _output_metas(stage),
                                    "output_args")):
            if not given or not metas or (stage.is_first if role == "input_args" else stage.is_last) is False:
                continue
            rows, built = given[0].shape[0], metas[0].shape[0]
            what = "batch" if role == "input_args" else "target"
            if rows % count:
                return (f"the {what} of {rows} rows does not split into the schedule's {count} micro-batches: give a "
                        f"{what} of {built * count} rows (stage {stage.stage_index}'s {role} are for micro-batches "
                        f"of {built}), or build the schedule with an n_microbatches that divides {rows}")
            if rows // count != built:
                return (f"the {what} of {rows} rows makes {count} micro-batches of {rows // count}, but stage "
                        f"{stage.stage_index}'s {role} are for micro-batches of {built}: give a {what} of "
                        f"{built * count} rows, or build the stages for micro-batches of {rows // count}")
    return None


def rebuilt(schedule: Any, micro_batches: int, resize: Callable[[tuple[int, ...]], tuple[int, ...]],
            kind: Any = None) -> Any:
    """A schedule of ``schedule``'s class (or ``kind``, taking the same arguments) and settings (its loss,
    chunk specs, options, each read back from the attribute its constructor stored it in) with
    ``micro_batches`` micro-batches, over fresh stages like its own (their modules, indices, process group),
    every static shape of theirs ``resize``d (a micro-batch of another size). Only for PipelineStages given
    their shapes; the modules are shared, not copied."""
    from torch.distributed.pipelining import PipelineStage

    stages = []
    for stage in stages_of(schedule):
        if type(stage) is not PipelineStage or _input_metas(stage) is None or _output_metas(stage) is None:
            raise GradauditError(f"only a PipelineStage built with input_args and output_args can be rebuilt at "
                                 f"another size, not a {type(stage).__name__}")
        stages.append(_restaged(stage, resize))
    for spec in [*(getattr(schedule, "_args_chunk_spec", None) or ()),
                 *(getattr(schedule, "_kwargs_chunk_spec", None) or {}).values()]:
        if getattr(spec, "split_dim", 0) != 0:
            raise GradauditError(f"the schedule splits an input along dimension {spec.split_dim}: only micro-batches "
                                 f"split along dimension 0 are rebuilt at another size")
    values: dict[str, Any] = {}
    kind = kind or type(schedule)
    for name, parameter in list(inspect.signature(kind.__init__).parameters.items())[1:]:
        if name in ("stage", "stages"):
            values[name] = stages[0] if name == "stage" else stages
        elif name == "n_microbatches":
            values[name] = micro_batches
        elif parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise GradauditError(f"{kind.__name__} takes *args or **kwargs: it cannot be rebuilt at "
                                 f"another size from what it keeps")
        else:
            found = [attribute for attribute in (name, f"_{name}") if hasattr(schedule, attribute)]
            if not found:
                raise GradauditError(f"{type(schedule).__name__} keeps no {name!r} (torch {torch.__version__}): it "
                                     f"cannot be rebuilt at another size")
            values[name] = getattr(schedule, found[0])
    try:
        return kind(**values)
    except (ValueError, AssertionError, RuntimeError) as error:  # e.g. a count its stages do not divide
        raise GradauditError(f"{kind.__name__} refuses {micro_batches} micro-batches: {error}") from error


def _restaged(stage: Any, resize: Callable[[tuple[int, ...]], tuple[int, ...]]) -> Any:
    """A fresh PipelineStage like ``stage``, its static shapes ``resize``d."""
    from torch.distributed.pipelining import PipelineStage

    def like(meta: Any) -> Optional[torch.Tensor]:
        if meta is None:
            return None
        if not isinstance(meta, torch.Tensor) and not hasattr(meta, "stride"):
            raise GradauditError(f"a stage given {type(meta).__name__} shapes (DTensor) cannot be rebuilt at another "
                                 f"size")
        return _made_like(meta, torch.device("meta"), resize(tuple(meta.shape)))

    user = getattr(stage, "_user_meta", None)
    if user is not None and user.has_dtensors():
        raise GradauditError("a stage given DTensor shapes cannot be rebuilt at another size")
    shapes: dict[str, Any] = {"input_args": tuple(like(m) for m in _input_metas(stage)),
                              "output_args": tuple(like(m) for m in _output_metas(stage))}
    for name in ("input_grads", "output_grads"):  # torch >= 2.14 takes the gradients' shapes too
        given = getattr(user, name, None)
        if given is not None:
            shapes[name] = tuple(like(m) for m in given)
    return PipelineStage(stage.submod, stage.stage_index, stage.num_stages, stage.device, group=stage.group,
                         dw_builder=stage.dw_builder, **shapes)


def _traced_input_metas(stage: Any) -> Optional[list[Any]]:
    """The shapes of a stage built by ``pipeline()`` (its submodule's placeholders as traced: the values
    the trace saw, requiring grad where a backward sends a gradient back, as its receive buffers do), or
    None for any other stage."""
    graph = getattr(getattr(stage, "submod", None), "graph", None)
    if getattr(stage, "pipe_info", None) is None or graph is None:
        return None
    metas = []
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            value = node.meta["val"]
            metas.append(types.SimpleNamespace(shape=value.shape, stride=value.stride(), dtype=value.dtype,
                                               requires_grad=value.is_floating_point() and stage.stage_index > 0))
    return metas


def example_inputs(stage: Any) -> Optional[list[torch.Tensor]]:
    """Tensors like one micro-batch's inputs of ``stage`` (zeros of its static ``input_args``' shapes,
    strides and dtypes, requiring grad as they did, on the stage's device); None where it was given none."""
    metas = _input_metas(stage) or _traced_input_metas(stage)
    if not metas:
        return None
    device = getattr(stage, "device", None) or torch.device("cpu")
    return [_made_like(meta, device, zeroed=True) for meta in metas]


def _made_like(meta: Any, device: Any, shape: Optional[tuple[int, ...]] = None, zeroed: bool = False) -> torch.Tensor:
    """A tensor as ``meta`` describes one (its shape and strides, or ``shape``, contiguous; its dtype), on
    ``device``, zeros where ``zeroed`` (not on meta), requiring grad as it did where it is floating."""
    own = tuple(meta.shape)
    stride = meta.stride() if callable(meta.stride) else meta.stride
    made = (torch.empty_strided(own, tuple(stride), dtype=meta.dtype, device=device) if shape in (None, own) else
            torch.empty(shape, dtype=meta.dtype, device=device))
    if zeroed and made.device.type != "meta":
        made.zero_()
    return made.requires_grad_(bool(meta.requires_grad)) if made.is_floating_point() else made


def sends_no_gradient_back(stage: Any) -> bool:
    """Whether ``stage``, past the first, was given ``input_args`` none of which requires grad: its
    backward then sends no gradient back, and in a real run the stage before waits for one forever."""
    if stage.stage_index == 0:
        return False
    metas = _input_metas(stage)
    return bool(metas) and not any(getattr(meta, "requires_grad", False) for meta in metas)


@contextlib.contextmanager
def following_chunks(stages: list[Any], begin: Callable[[str, int, int], None],
                     end: Callable[[str, int, int], None]) -> Iterator[None]:
    """Call ``begin(kind, stage_index, micro_batch)`` before and ``end(...)`` after each micro-batch's work
    on ``stages`` (kind: "forward", "backward", "backward of the weights"), while the block runs."""
    patched = []
    for stage in stages:
        for method, kind in CHUNKS:
            original = getattr(stage, method, None)
            if original is None:
                continue

            def wrapper(chunk: int, *args: Any, _original: Any = original, _kind: str = kind, _stage: Any = stage,
                        **kwargs: Any) -> Any:
                begin(_kind, _stage.stage_index, chunk)
                try:
                    return _original(chunk, *args, **kwargs)
                finally:
                    end(_kind, _stage.stage_index, chunk)

            setattr(stage, method, wrapper)  # an instance attribute: the class's method is untouched
            patched.append((stage, method))
    try:
        yield
    finally:
        for stage, method in patched:
            delattr(stage, method)


class _HeldWork:
    """A send's Work with the tensors it sends: what a real backend's Work holds (gloo's, for the Work's
    life), which the fake process group's does not."""

    def __init__(self, work: Any, tensors: list[torch.Tensor]) -> None:
        self._work = work
        self._tensors = tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._work.wait(*args, **kwargs) if self._work is not None else True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def sends_held_by_their_work() -> Iterator[None]:
    """While the block runs, the works of the sends a schedule starts hold the tensors they send, as a
    real backend's do: a schedule keeps some works past the backward that frees what they sent (1F1B's
    first stage keeps its first forward send's until the step ends), and in a real run those tensors stay
    alive until then. Only in a fake process group (a real one's works hold them already)."""
    module = sys.modules.get("torch.distributed.pipelining.schedules")
    original = getattr(module, "_batch_p2p", None)
    if original is None:
        yield
        return

    def held(p2p_ops: Any, *args: Any, **kwargs: Any) -> Any:
        works = original(p2p_ops, *args, **kwargs)
        sent = [op.tensor for op in p2p_ops if op.op is torch.distributed.isend]
        if not sent:
            return works
        return [_HeldWork(work, sent) for work in works] or [_HeldWork(None, sent)]

    module._batch_p2p = held
    try:
        yield
    finally:
        module._batch_p2p = original
