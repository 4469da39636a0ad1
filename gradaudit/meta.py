"""Make a forward on the meta device save what the same forward saves on CPU, or on CUDA.

``F.scaled_dot_product_attention`` picks its kernel by device: on CPU a fused flash kernel (saves
q, k, v, the output and a B x H x L logsumexp), on meta the math fallback (saves the B x H x L x L
attention probabilities). A meta scan of a 70B model would then report gigabytes the real run never
holds. While auditing on meta, gradaudit asks the CPU dispatcher which kernel it would pick for the
same shapes, dtypes and flags, and calls that kernel's meta implementation directly.

For ``target="cuda"`` (``CudaKernelChoices``) the forward takes the kernels CUDA would take where they
save other tensors: batch norm goes to cuDNN wherever ATen's ``_select_batch_norm_backend`` picks it
(``CudnnBatchNormBackward0``, cuDNN's saves); attention takes the backend CUDA's ``select_sdp_backend``
would pick on the assumed GPU (``cuda_choices.py``: an H100 with the cuDNN torch loads), so the node is
the flash, memory-efficient or cuDNN attention node with its saves, or the math decomposition; and
dropout in training runs CUDA's fused ``native_dropout`` (a bool mask).

Each emulated attention call goes through ``emulated_sdpa``, a function a TorchFunctionMode below the
kernel choices (the recorder's) sees with the kernel chosen, so the report's attention records name
the target's kernel.

Autocast works through dispatch keys meta tensors do not carry, so ``torch.autocast`` inside a forward
run on meta would change nothing: ``AutocastOnMeta`` casts the arguments of the ops autocast's lists
name, as CPU (or CUDA) autocast would. The arguments of SDPA, the CPU's choice for them and the
emulated call are in ``sdpa.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections import Counter
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import cuda_choices, kernel_cache
from .torchapi.checkpoint import checkpoint_meta_as, recomputing_under
from .torchapi.compiler import CompilingOnMeta, InlinedMode, compiling, graph_break, traced_setter
from .torchapi.dispatch import TorchDispatchMode, op_namespaces
from .sdpa import (SdpaChoice, as_sdpa, call_key, choice_when_traced, choosing, chosen, cpu_additive_mask, cpu_choice,
                   emulated_sdpa, meta_query, sdpa_arguments)
from .torchapi.kernels import (BATCH_NORM_LEGIT, BATCH_NORM_LEGIT_NO_STATS, BATCH_NORM_LEGIT_NO_TRAINING,
                               BATCH_NORM_NO_UPDATE, any_autocast_enabled,
                               cpu_flash_attention, cuda_autocast_without_cuda, cudnn_batch_norm,
                               native_dropout, sdp_backend_name, suggest_memory_format)
from .torchapi.storages import is_view
from .values import KnownValues, LiteralsOnMeta


# Python composites that call F.scaled_dot_product_attention (or dropout) inside: a TorchFunctionMode
# receives the composite as one call and is off while it runs, so the kernel choices run it with the
# mode pushed again, and its inner calls take the target's kernels
_KERNEL_COMPOSITES = (F.multi_head_attention_forward,)


def _ctc_lengths_as_lists(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``F.ctc_loss``'s arguments (positional, keyword), its four tensors positional and its lengths as
    tuples of ints where they are meta tensors. On the CPU and CUDA, ctc_loss with tensor lengths copies
    them to the CPU and runs the kernel that takes lists (LossCTC.cpp: CtcLossBackward0, its mean divided
    by float lengths); on meta it runs ``_ctc_loss.Tensor`` (CtcLossBackward1, which also saves both
    lengths), and TorchDynamo, tracing it, fails for want of a meta kernel where on a device it breaks the
    graph there (the output's size follows the lengths' values). The values are read as any on meta
    (known, else assumed and noted)."""
    names = ("log_probs", "targets", "input_lengths", "target_lengths")
    moved = [n for n in names[len(args):] if n in kwargs]
    bound = list(args[:4]) + [kwargs[n] for n in moved]
    for i in (2, 3):
        if i < len(bound) and isinstance(bound[i], torch.Tensor) and bound[i].is_meta:
            bound[i] = tuple(int(n) for n in bound[i].tolist())
    return (*bound, *args[4:]), {k: v for k, v in kwargs.items() if k not in moved}


class CpuKernelChoices(InlinedMode):
    """Sends meta-device SDPA calls to the kernel the CPU would choose (its flash kernel, or the math
    composite the meta device runs anyway), through ``emulated_sdpa``; Python composites that call
    SDPA inside (``F.multi_head_attention_forward``) run with the mode on inside. Subclasses choose
    for another device (``sdpa_choice``, ``sdpa_runner``)."""

    # a checkpoint's recomputation in backward runs under it again, as the forward did (planning/apply.py)
    reenter_on_recompute = True

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        setting = traced_setter(func)
        if setting is not None:
            return setattr(args[0], setting, args[1])
        if func is F.scaled_dot_product_attention:
            bound = sdpa_arguments(args, kwargs)
            if meta_query(bound):
                # traced by torch.compile: the choice is made once, as the trace runs, and the chosen
                # kernel's call is what the graph records (asking the dispatcher here would break it)
                choice = choice_when_traced(call_key(bound)) if compiling() else self.sdpa_choice(bound)
                if choice is not None:
                    return emulated_sdpa(choice, self.sdpa_runner(bound, choice), *as_sdpa(bound))
        elif func in _KERNEL_COMPOSITES:
            return run_with_mode_inside(self, func, args, kwargs)
        elif func is F.ctc_loss:
            if compiling():
                graph_break()  # as on a device (the call then runs eagerly, where the lengths' values are known)
            args, kwargs = _ctc_lengths_as_lists(args, kwargs)
        return func(*args, **kwargs)

    def __enter__(self) -> "CpuKernelChoices":
        choosing(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        chosen(self)
        return super().__exit__(*exc)

    def sdpa_choice(self, bound: dict[str, Any]) -> Optional[SdpaChoice]:
        """The kernel the CPU dispatcher picks for these arguments (asked with CPU twins); None where
        it cannot be asked (torch's own call then runs, and raises where it should)."""
        try:
            kernel = sdp_backend_name(cpu_choice(bound))
            without = sdp_backend_name(cpu_choice(bound, dropout_p=0.0)) if bound["dropout_p"] else kernel
        except (RuntimeError, TypeError, ValueError):
            return None
        return SdpaChoice(kernel, without, "cpu")

    def sdpa_runner(self, bound: dict[str, Any], choice: SdpaChoice) -> Callable[..., torch.Tensor]:
        if choice.kernel == "flash":
            # the CPU flash kernel takes grouped key/value heads as they are (no repeat); attention.cpp
            # first turns a bool mask into an additive one in the query's dtype (the node saves that)
            return lambda q, k, v, mask, p, causal, scale, gqa: cpu_flash_attention(
                q, k, v, p, causal, attn_mask=cpu_additive_mask(mask, q.dtype), scale=scale)
        return lambda q, k, v, mask, p, causal, scale, gqa: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=scale, enable_gqa=gqa)


# -- batch norm as CUDA runs it -----------------------------------------------------------------------
#
# aten::batch_norm (aten/src/ATen/native/Normalization.cpp, _batch_norm_impl_index) asks
# _select_batch_norm_backend which kernel to run. On CUDA it picks cuDNN when: the input is a CUDA
# tensor of 3 or more dimensions with at least one element and fewer than 2**31 - 1; neither input
# nor weight is bfloat16; a float16 input has a float32 weight; weight and bias are both given; the
# running statistics are both given (or, in training, both absent); the batch (first dimension) is
# at most 880801 in training and 65535 in eval; eps is at least cuDNN's minimum; and cuDNN is enabled
# (torch.backends.cudnn.enabled; every CUDA build of torch has cuDNN). It then runs
# cudnn_batch_norm on input.contiguous(input.suggest_memory_format()) and contiguous weight, bias and
# statistics. Otherwise CUDA runs native_batch_norm, whose meta kernel saves what CUDA's does.

CUDNN_TRAINING_BATCH_LIMIT = 880801
CUDNN_EVAL_BATCH_LIMIT = 65535
CUDNN_BN_MIN_EPSILON = 0.0  # cudnn_ops.h of cuDNN 9 (9.24 ships with torch 2.14.1+cu130)
_INT32_MAX = 2 ** 31 - 1

_F_BATCH_NORM = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_TORCH_BATCH_NORM = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
                     "cudnn_enabled")
_BATCH_NORM_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}


def batch_norm_arguments(func: Any, args: tuple, kwargs: dict) -> Optional[dict[str, Any]]:
    """The arguments of an ``F.batch_norm`` / ``torch.batch_norm`` call by name (None for other functions)."""
    if func is F.batch_norm:
        names = _F_BATCH_NORM
    elif func is torch.batch_norm:
        names = _TORCH_BATCH_NORM
    else:
        return None
    bound = dict(_BATCH_NORM_DEFAULTS)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def cudnn_batch_norm_chosen(input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                            running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                            training: bool, eps: float) -> bool:
    """Whether CUDA would run this batch norm through cuDNN (ATen's _select_batch_norm_backend), for
    an input of this shape and dtype on a CUDA device."""
    if weight is None or bias is None:
        return False
    if torch.bfloat16 in (input.dtype, weight.dtype):
        return False
    if input.dtype == torch.float16 and weight.dtype != torch.float32:
        return False
    stats = (running_mean is not None, running_var is not None)
    if not (stats == (True, True) or (stats == (False, False) and training)):
        return False
    if input.dim() < 3 or not 0 < input.numel() < _INT32_MAX:
        return False
    limit = CUDNN_TRAINING_BATCH_LIMIT if training else CUDNN_EVAL_BATCH_LIMIT
    return input.shape[0] <= limit and eps >= CUDNN_BN_MIN_EPSILON and torch.backends.cudnn.enabled


def _verify_batch_size(input: torch.Tensor) -> None:
    values = input.shape[0]
    for size in input.shape[2:]:
        values *= size
    if values == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {input.size()}")


class CudaKernelChoices(CpuKernelChoices):
    """On meta, the forward takes the kernels CUDA would choose on ``gpu`` (default: an H100 with the
    cuDNN the installed torch loads, ``cuda_choices.assumed_gpu``): cuDNN batch norm where ATen picks
    it, the attention backend ``select_sdp_backend`` picks, and fused dropout in training.
    ``notes``: what the report should say about it (the assumed GPU, what is not emulated)."""

    def __init__(self, gpu: Optional[cuda_choices.Gpu] = None) -> None:
        super().__init__()
        self.gpu = gpu or cuda_choices.assumed_gpu()
        self.attention_kernels: Counter = Counter()  # kernel -> emulated attention calls
        self._notes: list[str] = []

    @property
    def notes(self) -> list[str]:
        notes = list(self._notes)
        if self.attention_kernels:
            taken = ", ".join(f"{kernel} x{count}" for kernel, count in sorted(self.attention_kernels.items()))
            notes.insert(0, f"target cuda: scaled_dot_product_attention took the kernels torch would choose on "
                            f"{self.gpu.describe()} ({taken}); another GPU generation, torch release or cuDNN "
                            f"may choose differently (gradaudit.assume_gpu; --target-gpu, --target-torch, --target-cudnn)")
        return notes

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        setting = traced_setter(func)
        if setting is not None:
            return setattr(args[0], setting, args[1])
        bound = batch_norm_arguments(func, args, kwargs)
        if bound is not None:
            x = bound["input"]
            if (isinstance(x, torch.Tensor) and x.device.type == "meta"
                    and cudnn_batch_norm_chosen(x, bound["weight"], bound["bias"], bound["running_mean"],
                                                bound["running_var"], bool(bound["training"]), bound["eps"])):
                if func is F.batch_norm and bound["training"]:
                    _verify_batch_size(x)  # F.batch_norm's own check, which this call replaces
                return _cudnn_batch_norm(bound)
            return func(*args, **kwargs)
        dropout = _dropout_arguments(func, args, kwargs)
        if dropout is not None and cuda_choices.fused_dropout_applies(*dropout):
            return native_dropout(dropout[0], float(dropout[1]))
        if func is F.instance_norm and _argument(args, kwargs, 3, "weight", None) is not None:
            self._note("target cuda: F.instance_norm runs batch norm inside (in C++), which CUDA sends to cuDNN "
                       "when the instance norm is affine; on meta it keeps the native kernel's node "
                       "(NativeBatchNormBackward0)")
        return super().__torch_function__(func, types, args, kwargs)

    def sdpa_choice(self, bound: dict[str, Any]) -> Optional[SdpaChoice]:
        """CUDA's choice on the assumed GPU; None for calls it does not take (cuda_choices.emulable).
        Raises RuntimeError where the GPU would find no kernel."""
        call = cuda_choices.SdpaCall.of(bound)
        if not cuda_choices.emulable(call):
            return None
        chosen = cuda_choices.choose(call, self.gpu)
        without = chosen
        if call.dropout_p:
            try:
                without = cuda_choices.choose(cuda_choices.SdpaCall.of(bound, dropout_p=0.0), self.gpu)
            except RuntimeError:
                without = chosen
        self.attention_kernels[chosen.kernel] += 1
        return SdpaChoice(chosen.kernel, without.kernel, "cuda", chosen.passed_over)

    def sdpa_runner(self, bound: dict[str, Any], choice: SdpaChoice) -> Callable[..., torch.Tensor]:
        return lambda *sdpa: cuda_choices.run(cuda_choices.SdpaCall(*sdpa), choice.kernel)

    def _note(self, text: str) -> None:
        if text not in self._notes:
            self._notes.append(text)


# (a function of its own, not a staticmethod: TorchDynamo, tracing the kernel choices inside a compiled
# region, fails to build a guard on a staticmethod reached through the mode)
def _cudnn_batch_norm(bound: dict[str, Any]) -> torch.Tensor:
    x, training = bound["input"], bool(bound["training"])
    stats = [t.contiguous() if t is not None else None for t in (bound["running_mean"], bound["running_var"])]
    return cudnn_batch_norm(x.contiguous(memory_format=suggest_memory_format(x)), bound["weight"].contiguous(),
                            bound["bias"].contiguous(), *stats, training, bound["momentum"], bound["eps"])


def _dropout_arguments(func: Any, args: tuple, kwargs: dict) -> Optional[tuple[Any, Any, Any, Any]]:
    """(input, p, training, inplace) of an ``F.dropout`` / ``torch.dropout`` call, else None."""
    if func is F.dropout:
        return (_argument(args, kwargs, 0, "input", None), _argument(args, kwargs, 1, "p", 0.5),
                _argument(args, kwargs, 2, "training", True), _argument(args, kwargs, 3, "inplace", False))
    if func is torch.dropout:
        return (_argument(args, kwargs, 0, "input", None), _argument(args, kwargs, 1, "p", None),
                _argument(args, kwargs, 2, "train", None), False)
    return None


# the devices an audit on meta can stand for, and the kernel choices each makes
TARGETS = ("cpu", "cuda")


class DeviceKernelsOnMeta(TorchDispatchMode):
    """Where a meta kernel returns other than the device's kernel would, the device's answer.
    Dispatched below autograd, so the node and its saves are a real run's.

    - ``_grouped_mm`` (mixture of experts) in float32 or float16. Its meta kernel accepts bfloat16
      only (the condition of CUDA's fused kernel); the CPU kernel, and CUDA's fallback for other
      dtypes (a loop of matrix products, in aten/native/cuda/GroupedBlas.cpp since torch 2.10), take
      them. The output is theirs (GroupedMMUtils.h, create_grouped_gemm_output_tensor): the meta
      kernel's shape, each row padded to a multiple of 16 bytes (checked against the CPU kernel: a
      10 x 6 float32 output has row stride 8).
    - ``convolution`` of a channels-last input or weight: the meta kernel returns a contiguous
      output, the CPU's oneDNN and CUDA's cuDNN a channels-last one (ConvUtils.h:
      ``mkldnn_conv_use_channels_last``, ``cudnn_conv_suggest_memory_format``: channels-last when
      either operand suggests it). What follows then differs: SegFormer's depthwise convolution on a
      transposed sequence, flattened and transposed back, feeds its Linear a contiguous input on the
      CPU and on an H100 (``AddmmBackward0``), a strided one on meta (``MmBackward0``, the same bytes).
    - On the CPU, ``mse_loss``, ``smooth_l1_loss``, ``binary_cross_entropy`` and ``soft_margin_loss``
      compute the elementwise loss into a buffer of the inputs' broadcast size and return their mean or
      sum as a 0-dim view of it: the loss, a scalar, holds that whole buffer as long as it lives (a
      (8, 16, 64) float32 mean squared error holds 32768 bytes, not 4; checked on torch 2.11, 2.14 and
      2.15). The meta kernels return 4 bytes; for a CPU target the loss gets the CPU's storage.
    """

    def __init__(self, target: str = "cpu") -> None:
        super().__init__()
        self.target = target

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        return self.run(func, args, kwargs or {})

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` called as this mode calls it; ``standing_for`` has ``KnownValues`` call this in
        place of entering the mode (one dispatch mode fewer for every op)."""
        if self.target == "cpu" and func in _CPU_LOSSES_ON_THEIR_BUFFER:
            out = kernel_cache.call(func, args, kwargs)
            if out.device.type == "meta" and out.dim() == 0:  # (reduction "none" keeps the whole shape)
                elements = torch.broadcast_shapes(args[0].shape, args[1].shape).numel()
                return torch.empty(elements, dtype=out.dtype, device="meta")[0] if elements > 1 else out
            return out
        if self.target == "cpu" and (func in _CPU_NORM_PARAMETERS or func in _CPU_EVAL_BATCH_NORMS):
            out = kernel_cache.call(func, args, kwargs)
            if func in _CPU_NORM_PARAMETERS:
                out = _cpu_statistics(func, args, out)
            outside_training = _CPU_EVAL_BATCH_NORMS.get(func)
            if outside_training is not None and outside_training(args, kwargs) and out[1].is_meta:
                out = (out[0], *[torch.empty(0, dtype=t.dtype, device="meta") for t in out[1:3]], *out[3:])
            return out
        if func is _GROUPED_MM and _meta_floats_other_than_bf16(args[:2]):
            as_bf16 = [torch.empty_like(t, dtype=torch.bfloat16) for t in args[:2]]
            shape = func(*as_bf16, *args[2:], **kwargs).shape
            dtype = kwargs.get("out_dtype") or args[0].dtype
            return torch.empty_strided(shape, _grouped_mm_strides(shape, dtype), dtype=dtype, device="meta")
        if func is _CONVOLUTION:
            out = kernel_cache.call(func, args, kwargs)
            layout = _channels_last_of(args[:2]) if out.device.type == "meta" else None
            if layout is not None and not out.is_contiguous(memory_format=layout):
                return torch.empty(out.shape, dtype=out.dtype, device="meta", memory_format=layout)
            return out
        return kernel_cache.call(func, args, kwargs)


_CONVOLUTION = torch.ops.aten.convolution.default
_CPU_LOSSES_ON_THEIR_BUFFER = {torch.ops.aten.mse_loss.default, torch.ops.aten.smooth_l1_loss.default,
                               torch.ops.aten.binary_cross_entropy.default, torch.ops.aten.soft_margin_loss.default}
# On the CPU, layer, batch and group norm keep their statistics (outputs 1 and 2: mean and rstd or
# invstd) in the input's dtype, or in float32 where a parameter is float32 beside a bfloat16 or float16
# input (ATen's is_mixed_type); their meta kernels keep layer and batch norm's in float32 always, group
# norm's in the input's (a bfloat16 LayerNorm saves bfloat16 statistics on the CPU, float32 on meta:
# checked on torch 2.11, 2.14 and 2.15). The positions of each op's parameters:
_CPU_NORM_PARAMETERS = {torch.ops.aten.native_layer_norm.default: (2, 3),
                        torch.ops.aten.native_group_norm.default: (1, 2),
                        torch.ops.aten.native_batch_norm.default: (1, 2, 3, 4),
                        BATCH_NORM_LEGIT: (1, 2, 3, 4), BATCH_NORM_LEGIT_NO_STATS: (1, 2)}


# Batch norm with running statistics outside training: the CPU kernel (batch_norm_cpu) returns its
# saved mean and inverse deviation empty, (0,), where the meta kernels return one per channel (checked on
# torch 2.11, 2.14 and 2.15). Eager autograd saves them (NativeBatchNormBackward0's result1 and result2),
# and so does a compiled region's backward graph: counted on meta, they held the bytes the CPU does not.
# Per op, whether a call is such a one (its ``training`` argument, where it has one, False).
_CPU_EVAL_BATCH_NORMS = {
    torch.ops.aten.native_batch_norm.default: lambda args, kwargs: not _argument(args, kwargs, 5, "training", True),
    BATCH_NORM_LEGIT: lambda args, kwargs: not _argument(args, kwargs, 5, "training", True),
    BATCH_NORM_LEGIT_NO_TRAINING: lambda args, kwargs: True,
    BATCH_NORM_NO_UPDATE: lambda args, kwargs: True,
}


def _cpu_statistics(func: Any, args: tuple, out: tuple) -> tuple:
    """``out`` with its statistics in the dtype the CPU kernel gives them (_CPU_NORM_PARAMETERS)."""
    x = args[0]
    if not (x.is_meta and x.dtype in (torch.bfloat16, torch.float16)):
        return out
    mixed = any(isinstance(args[i], torch.Tensor) and args[i].dtype == torch.float32
                for i in _CPU_NORM_PARAMETERS[func] if i < len(args))
    dtype = torch.float32 if mixed else x.dtype
    stats = [t if t.dtype == dtype else torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")
             for t in out[1:3]]
    return (out[0], *stats, *out[3:])


def _channels_last_of(operands: Any) -> Optional[torch.memory_format]:
    """The channels-last format either of a convolution's input and weight suggests, if any."""
    for t in operands:
        if isinstance(t, torch.Tensor) and t.dim() in (4, 5):
            layout = suggest_memory_format(t)
            if layout in (torch.channels_last, torch.channels_last_3d):
                return layout
    return None


_GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)
_GROUPED_MM = getattr(_GROUPED_MM, "default", None)


def _grouped_mm_strides(shape: torch.Size, dtype: torch.dtype) -> tuple[int, ...]:
    align = max(1, 16 // torch.empty((), dtype=dtype, device="meta").element_size())
    row = -(-shape[-1] // align) * align
    return (row, 1) if len(shape) == 2 else (shape[-2] * row, row, 1)


def _meta_floats_other_than_bf16(tensors: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.device.type == "meta" and t.is_floating_point()
               and t.dtype != torch.bfloat16 for t in tensors)


def kernel_choices(target: str) -> CpuKernelChoices:
    """The TorchFunctionMode that makes a meta forward choose kernels as ``target`` would."""
    return CudaKernelChoices() if target == "cuda" else CpuKernelChoices()


class Emulation:
    """What ``standing_for`` entered; ``notes``: what it could not emulate (autocast's, then the
    kernel choices')."""

    def __init__(self, kernels: Any, autocast: "AutocastOnMeta", values: KnownValues,
                 compiled_here: Optional[CompilingOnMeta] = None) -> None:
        self.kernels, self.autocast, self.values = kernels, autocast, values
        self.compiled_here = compiled_here  # how regions torch.compile compiles on meta were compiled

    @property
    def notes(self) -> list[str]:
        return [*self.autocast.notes, *getattr(self.kernels, "notes", []), *self.values.notes]

    def regions_closed(self) -> None:
        """Every autocast region of the forward has ended: its casts are let go (autocast's cache is
        cleared as a region exits; the emulation's at its next call outside every region, which an
        emulation of its own does not see when another one runs the backward)."""
        self.autocast.forget_casts()


def _reentered_on_recompute(mode: Any) -> bool:
    return getattr(mode, "reenter_on_recompute", False)


@contextlib.contextmanager
def standing_for(target: str, also: Any = None) -> Iterator[Emulation]:
    """Everything a forward on the meta device needs to save what it would save on ``target``
    ("cpu" or "cuda"): the target's kernel choices, and autocast emulated for it (entered last: its
    casts come first; for CUDA, torch.autocast("cuda") allowed to switch on without a GPU). Yields
    an Emulation, whose ``notes`` say what it could not emulate. ``also``: a context entered
    after the kernel choices, before autocast (another TorchFunctionMode that sees the calls after
    autocast's casts)."""
    with contextlib.ExitStack() as stack:
        # a checkpointed block is recomputed in backward under the emulation its forward ran under
        stack.enter_context(recomputing_under(_reentered_on_recompute))
        if target == "cuda":
            stack.enter_context(cuda_autocast_without_cuda())
            # a checkpointed block recomputed in backward runs under the forward's CUDA autocast
            stack.enter_context(checkpoint_meta_as("cuda"))
        # KnownValues runs each op through the device's kernel choices, as a mode of its own below it
        # would (it sees what they return: values carried through masks and positions)
        # a region torch.compile compiles here is traced and partitioned as on a device (for inductor:
        # partitioned, not code-generated)
        compiling_here = stack.enter_context(CompilingOnMeta())
        values = stack.enter_context(KnownValues(kernels=DeviceKernelsOnMeta(target).run))
        stack.enter_context(LiteralsOnMeta())
        kernels = stack.enter_context(kernel_choices(target))
        if also is not None:
            stack.enter_context(also)
        autocast = AutocastOnMeta(target)
        stack.enter_context(autocast)
        yield Emulation(kernels, autocast, values, compiling_here)


# -- autocast on meta -------------------------------------------------------------------------------
#
# torch.autocast works through the AutocastCPU / AutocastCUDA dispatch keys, which only tensors of
# that device carry: under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a meta forward keeps
# float32 and saves float32, without the ToCopyBackward0 nodes and the bf16 copies a CPU forward
# holds. AutocastOnMeta applies the autocast cast policies at the Python function level instead.
# The op lists are PyTorch's (aten/src/ATen/autocast_mode.cpp for CPU, AT_FORALL_* in
# ATen/autocast_mode.h for CUDA), mapped to the Python functions that reach a TorchFunctionMode.

LOWER, FP32, SET_OPT_DTYPE, PROMOTE, BANNED = "lower_precision_fp", "fp32", "fp32_set_opt_dtype", "promote", "banned"
LOWER_INSIDE = "lower_precision_fp inside"

_CPU_OPS = {
    LOWER: """conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm _addmm_activation addbmm linear
        _convolution matmul conv_tbc mkldnn_rnn_layer conv_transpose1d conv_transpose2d conv_transpose3d prelu
        scaled_dot_product_attention _native_multi_head_attention""",
    FP32: """avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft cdist trace
        view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse
        max_pool3d max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d
        replication_pad1d replication_pad2d replication_pad3d mse_loss cosine_embedding_loss nll_loss
        nll_loss2d hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss huber_loss
        margin_ranking_loss soft_margin_loss triplet_margin_loss multi_margin_loss ctc_loss kl_div
        multilabel_margin_loss binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn
        fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft linalg_cond
        linalg_matrix_rank linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh
        linalg_inv linalg_householder_product linalg_tensorinv linalg_tensorsolve
        fake_quantize_per_tensor_affine geqrf qr svd triangular_solve fractional_max_pool2d
        fractional_max_pool3d adaptive_max_pool3d linalg_qr linalg_cholesky_ex linalg_svd linalg_eig
        linalg_eigh linalg_lstsq linalg_inv_ex""",
    PROMOTE: "stack cat index_copy",
    # not listed, but they reach bmm / mm inside (CompositeImplicit), which autocast casts: the
    # operands are cast here, before their views (einsum needs two operands to reach bmm)
    LOWER_INSIDE: "einsum tensordot chain_matmul linalg_multi_dot",
}
# F.pad reaches reflection_pad1d/2d and replication_pad1d/2d/3d (fp32 on CPU) inside aten::pad
_CPU_OPS[FP32] += " pad"

_CUDA_OPS = {
    LOWER: """_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d
        convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
        chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell
        rnn_tanh_cell rnn_relu_cell scaled_dot_product_attention cudnn_convolution cudnn_convolution_transpose""",
    # cross_entropy_loss is not listed, but decomposes into log_softmax (float32 result) and nll_loss
    # (fp32): the same ToCopyBackward0 of the input; upsample_*: F.interpolate (except mode "area")
    FP32: """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus
        layer_norm native_layer_norm rms_norm group_norm frobenius_norm nuclear_norm cosine_similarity
        poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss
        smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
        triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm
        logsumexp upsample cross_entropy_loss""",
    SET_OPT_DTYPE: "prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum norm",
    PROMOTE: "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add",
    BANNED: "binary_cross_entropy",
}

# Python composites whose inner calls autocast reaches (it works per aten op): a TorchFunctionMode
# is off while it handles a call, so these run with the mode pushed again (their own
# has_torch_function check skipped once) and their inner calls are cast
_REENTER = {
    "cpu": "multi_head_attention_forward",
    "cuda": "multi_head_attention_forward normalize softmin gumbel_softmax local_response_norm",
}
# composites in C++ that autocast reaches inside but a Python-level emulation cannot: the inner
# casts are missing on meta, and the report says so
_OPAQUE = {
    "cpu": "lstm gru rnn_tanh rnn_relu",
    "cuda": "lstm gru rnn_tanh rnn_relu",
}

# device types whose autocast this emulation knows
EMULATED_AUTOCAST = ("cpu", "cuda")
# autocast device types torch knows besides those (their contexts are noted, not emulated)
_OTHER_AUTOCAST = ("xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia")


def _python_functions(name: str) -> list[Any]:
    """The Python-visible functions a TorchFunctionMode receives for the aten op ``name``."""
    import torch.fft
    import torch.linalg

    extra = {
        "cross_entropy_loss": [F.cross_entropy],
        "grid_sampler": [F.grid_sample],
        # boolean dispatchers (return_indices): both reach the mode as the public function
        "adaptive_max_pool3d": [F.adaptive_max_pool3d_with_indices],
        "fractional_max_pool2d": [F.fractional_max_pool2d_with_indices],
        "fractional_max_pool3d": [F.fractional_max_pool3d_with_indices],
        "cat": [torch.concat, torch.concatenate, torch.hstack, torch.vstack, torch.dstack],
        "matmul": [torch.Tensor.__matmul__, torch.Tensor.__rmatmul__],
        "pow": [torch.Tensor.__pow__, torch.Tensor.__rpow__],
        "upsample": [F.interpolate, F.upsample],
        "multi_head_attention_forward": [F.multi_head_attention_forward],
        "softmin": [F.softmin], "gumbel_softmax": [F.gumbel_softmax],
        "local_response_norm": [F.local_response_norm], "normalize": [F.normalize],
        "pad": [F.pad],
    }.get(name, [])
    found = list(extra)
    spaces = [(torch, ""), (torch.Tensor, ""), (F, "")] + [(space, "") for space in op_namespaces()]
    for space, prefix in spaces + [(torch.linalg, "linalg_"), (torch.fft, "fft_")]:
        if prefix and not name.startswith(prefix):
            continue
        found.append(getattr(space, name[len(prefix):], None))
    return [f for f in found if f is not None and callable(f)]


def _policies(ops: dict[str, str]) -> dict[Any, tuple[str, str]]:
    table: dict[Any, tuple[str, str]] = {}
    for policy, names in ops.items():
        for name in names.split():
            for function in _python_functions(name):
                table.setdefault(function, (policy, name))
    return table


_TABLES: dict[str, dict[Any, tuple[str, str]]] = {}


def autocast_policies(device_type: str) -> dict[Any, tuple[str, str]]:
    """Python function -> (cast policy, aten op name) under ``device_type``'s autocast."""
    if device_type not in _TABLES:
        ops = {"cpu": _CPU_OPS, "cuda": _CUDA_OPS}[device_type]
        table = _policies(ops)
        for name in _OPAQUE[device_type].split():
            for function in _python_functions(name):
                table.setdefault(function, ("opaque", name))
        for name in _REENTER[device_type].split():
            for function in _python_functions(name):
                if inspect.isfunction(function):
                    table.setdefault(function, ("reenter", name))
        _TABLES[device_type] = table
    return _TABLES[device_type]


def _eligible(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


class AutocastOnMeta(InlinedMode):
    """Emulates ``torch.autocast`` for a forward on the meta device, as ``device_type`` would run it.

    For each call of a function autocast puts in a cast policy for an enabled autocast context,
    the floating-point tensor arguments are cast as autocast casts them (``.to(dtype)``: the same
    ToCopyBackward0 nodes and copies; fp32 leaves that require grad cast to the lower precision
    once per autocast region, as autocast's cast cache does), then the function runs. The context
    followed is ``device_type``'s when enabled, else the first enabled of ``EMULATED_AUTOCAST``
    (a forward written for another device). ``notes``: what could not be emulated.
    """

    # a checkpoint's recomputation in backward runs under it again, as the forward did (planning/apply.py)
    reenter_on_recompute = True

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        if device_type not in EMULATED_AUTOCAST:
            raise ValueError(f"autocast on meta emulates {', '.join(EMULATED_AUTOCAST)}, not {device_type!r}")
        self.device_type = device_type
        self.order = (device_type,) + tuple(d for d in EMULATED_AUTOCAST if d != device_type)
        self.notes: list[str] = []
        self._cache: dict[int, tuple[Any, torch.Tensor]] = {}
        self._seen_other: set[str] = set()
        self._seen_opaque: set[tuple[str, str]] = set()
        self._others = _KNOWN_OTHERS

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        setting = traced_setter(func)
        if setting is not None:
            return setattr(args[0], setting, args[1])
        if not _any_autocast_enabled():
            if self._cache and not compiling():
                self._cache.clear()  # outside every autocast region (autocast clears its cache on exit)
            return func(*args, **kwargs)
        device = next((d for d in self.order if torch.is_autocast_enabled(d)), None)
        self._note_other_devices()
        if device is None:
            return func(*args, **kwargs)
        entry = autocast_policies(device).get(func)
        if entry is None:
            return func(*args, **kwargs)
        policy, name = entry
        lower = torch.get_autocast_dtype(device)
        if policy == "opaque":
            if (device, name) not in self._seen_opaque:
                self._seen_opaque.add((device, name))
                self.notes.append(
                    f"autocast ({device}) on meta: {name} runs its inner ops without autocast's casts (autocast "
                    f"casts inside it, per aten op; gradaudit emulates autocast per Python function): figures "
                    f"for it follow float32, audit on {device} for its exact saves")
            return func(*args, **kwargs)
        if policy == "reenter":
            return self._reenter(func, args, kwargs)
        if policy == BANNED:
            raise RuntimeError("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.")
        if name == "upsample" and _argument(args, kwargs, 3, "mode", "nearest") == "area":
            return func(*args, **kwargs)  # area interpolation is adaptive_avg_pool, not listed
        if name == "pad" and not _pad_in_fp32(args, kwargs):
            return func(*args, **kwargs)
        if name == "max_pool3d" and _argument(args, kwargs, 6, "return_indices", False):
            return func(*args, **kwargs)  # max_pool3d_with_indices is not listed
        if policy == LOWER_INSIDE:
            operands = [t for v in list(args) + list(kwargs.values()) for t in _tensors(v)]
            if len(operands) < 2 or (name != "einsum" and len({t.dtype for t in operands}) > 1):
                return func(*args, **kwargs)  # one operand: no bmm; mixed dtypes: its own check raises
            policy = LOWER
        if policy == SET_OPT_DTYPE:
            first = next((t for v in list(args) + list(kwargs.values()) for t in _tensors(v)), None)
            # Python wrappers (F.softmax, torch.norm) hand on dtype=None: no dtype asked for
            if _eligible(first) and kwargs.get("dtype") is None and not any(isinstance(a, torch.dtype) for a in args):
                kwargs = {**kwargs, "dtype": torch.float32}
            return func(*args, **kwargs)
        if policy == LOWER:
            target = lower
        elif policy == FP32:
            target = torch.float32
        else:  # PROMOTE: float32 if any eligible argument is float32, else the lower precision
            floats = [t.dtype for v in list(args) + list(kwargs.values()) for t in _tensors(v) if _eligible(t)]
            target = torch.float32 if torch.float32 in floats else lower
        # einsum and tensordot hand bmm / mm views of their operands, which autocast's cache skips
        cache = name not in ("einsum", "tensordot")
        cast = lambda v: self._cast(v, target, lower, cache)  # noqa: E731
        return func(*[cast(a) for a in args], **{k: cast(v) for k, v in kwargs.items()})

    def forget_casts(self) -> None:
        """Let go of the cached casts (as its next call outside every autocast region does)."""
        self._cache.clear()

    def _reenter(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run a Python composite with this mode on, so that autocast reaches its inner calls."""
        return run_with_mode_inside(self, func, args, kwargs)

    def _cast(self, value: Any, target: torch.dtype, lower: torch.dtype, cache: bool = True) -> Any:
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._cast(v, target, lower, cache) for v in value)
        if not _eligible(value) or value.dtype == target:
            return value
        # autocast's cache: fp32 leaves that require grad, cast to the lower precision, once per region
        # (not in a region being compiled: its graph casts each use, and AOTAutograd's common-subexpression
        # pass merges the same casts)
        if (cache and target == lower and not compiling() and value.dtype == torch.float32 and value.requires_grad
                and value.is_leaf and not is_view(value) and torch.is_autocast_cache_enabled()):
            hit = self._cache.get(id(value))
            if hit is not None and hit[0]() is value:
                return hit[1]
            casted = value.to(target)
            self._cache[id(value)] = (weakref.ref(value), casted)
            return casted
        return value.to(target)

    def _note_other_devices(self) -> None:
        for device in self._others:
            if device not in self._seen_other and torch.is_autocast_enabled(device):
                self._seen_other.add(device)
                self.notes.append(
                    f"the forward enabled torch.autocast({device!r}), which the meta device cannot emulate "
                    f"(gradaudit emulates {' and '.join(EMULATED_AUTOCAST)} autocast): its casts are missing "
                    f"from these figures; audit on {device} for them")


def run_with_mode_inside(mode: TorchFunctionMode, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run the Python composite ``func`` (a function of torch.nn.functional) with ``mode`` pushed again,
    so that its inner calls reach the mode: the composite's own has_torch_function check is skipped
    once (the mode is handling that call now)."""
    names = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
    scope = func.__globals__
    saved = {n: scope[n] for n in names if n in scope}

    def restore() -> None:
        scope.update(saved)

    def once(*_: Any) -> bool:  # the function's own check, once: it is being handled now
        restore()
        return False

    scope.update({n: once for n in saved})
    try:
        with mode:
            return func(*args, **kwargs)
    finally:
        restore()


def _any_autocast_enabled() -> bool:
    return any_autocast_enabled(EMULATED_AUTOCAST + _KNOWN_OTHERS)


def _autocast_known(device_type: str) -> bool:
    try:
        torch.is_autocast_enabled(device_type)
        return True
    except (RuntimeError, ValueError):
        return False


def _pad_in_fp32(args: tuple, kwargs: dict) -> bool:
    mode = _argument(args, kwargs, 2, "mode", "constant")
    dims = len(_argument(args, kwargs, 1, "pad", ())) // 2
    return (mode == "reflect" and dims in (1, 2)) or (mode == "replicate" and dims in (1, 2, 3))


def _argument(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


_KNOWN_OTHERS = tuple(d for d in _OTHER_AUTOCAST if _autocast_known(d))
