"""Kernels: the attention backends and torch's settings for them, CUDA's attention kernels and
fused dropout called on meta tensors (gradaudit/cuda_choices.py), cuDNN, autocast."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterable, Iterator, Optional

import torch

from .features import FEATURES


# gradaudit's backend names -> the name in torch._C's _get_<name>_sdp_enabled
_SDP_FLAGS = {"flash": "flash", "efficient": "mem_efficient", "cudnn": "cudnn", "math": "math",
              "overrideable": "overrideable", "fa3": "fa3"}


# batch norm's functional overloads (what torch.export and the decompositions call; eager reaches them too)
BATCH_NORM_LEGIT = torch.ops.aten._native_batch_norm_legit.default
BATCH_NORM_LEGIT_NO_STATS = torch.ops.aten._native_batch_norm_legit.no_stats
BATCH_NORM_LEGIT_NO_TRAINING = torch.ops.aten._native_batch_norm_legit_no_training.default
BATCH_NORM_NO_UPDATE = torch.ops.aten._batch_norm_no_update.default


def sdp_backend_name(choice: int) -> str:
    """"flash", "efficient", "cudnn", "math"... for a backend number (by the enum's names)."""
    names = _backend_names()
    name = names.get(int(choice), "unknown").lower()
    return {"flash_attention": "flash", "efficient_attention": "efficient", "cudnn_attention": "cudnn"}.get(name, name)


@functools.lru_cache(maxsize=1)
def _backend_names() -> dict[int, str]:
    backend = getattr(getattr(torch.nn, "attention", None), "SDPBackend", None)
    return {int(getattr(backend, n)): n for n in dir(backend) if n.isupper()} if backend is not None else {}


def cpu_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                        is_causal: bool, *, attn_mask: Any = None, scale: Any = None) -> torch.Tensor:
    """The output of the CPU flash-attention kernel (its meta implementation on meta tensors)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


# CUDA's attention kernels and fused dropout, called on meta tensors (gradaudit/cuda_choices.py): each
# op's meta implementation returns outputs of the GPU kernel's shapes and dtypes, and autograd builds the
# node the GPU builds, with its saves (logsumexp, random-number state).
_ATEN = torch.ops.aten


FEATURES["CUDA attention kernels"] = all(
    hasattr(_ATEN, name) for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                                      "_scaled_dot_product_cudnn_attention", "_safe_softmax", "native_dropout"))


FEATURES["SDPA settings"] = all(hasattr(torch._C, f"_get_{flag}_sdp_enabled")
                                for flag in ("flash", "mem_efficient", "cudnn", "math")) \
    and hasattr(torch._C, "_get_sdp_priority_order")


def cuda_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                         is_causal: bool, scale: Optional[float]) -> torch.Tensor:
    """The output of CUDA's flash-attention op (ScaledDotProductFlashAttentionBackward0)."""
    return _ATEN._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                     scale=scale)[0]


def cuda_efficient_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Optional[torch.Tensor],
                             logsumexp: bool, dropout_p: float, is_causal: bool,
                             scale: Optional[float]) -> torch.Tensor:
    """The output of CUDA's memory-efficient attention op (ScaledDotProductEfficientAttentionBackward0)."""
    return _ATEN._scaled_dot_product_efficient_attention(query, key, value, bias, logsumexp, dropout_p, is_causal,
                                                         scale=scale)[0]


def cuda_cudnn_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: Optional[torch.Tensor],
                         logsumexp: bool, dropout_p: float, is_causal: bool, scale: Optional[float]) -> torch.Tensor:
    """The output of cuDNN's attention op (ScaledDotProductCudnnAttentionBackward0)."""
    return _ATEN._scaled_dot_product_cudnn_attention(query, key, value, bias, logsumexp, dropout_p, is_causal, False,
                                                     scale=scale)[0]


def safe_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """ATen's ``_safe_softmax`` (the softmax of SDPA's math kernel: rows masked entirely give 0)."""
    return _ATEN._safe_softmax(x, dim)


def native_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """The output of ATen's fused dropout in training (NativeDropoutBackward0, which saves a bool mask)."""
    return _ATEN.native_dropout(x, p, True)[0]


def mul_scalar(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x * factor`` as C++ multiplies by a Scalar (MulBackward1, which saves no tensor)."""
    return _ATEN.mul.Scalar(x, factor)


def sdp_enabled() -> dict[str, bool]:
    """Which attention backends torch's global settings (``torch.backends.cuda.enable_*_sdp``,
    ``torch.nn.attention.sdpa_kernel``) leave enabled, by gradaudit's names, and "fa3" (FlashAttention-3)."""
    # a flag this torch does not have (FlashAttention-3's, the overrideable backend's) is off
    return {name: bool(getattr(torch._C, f"_get_{flag}_sdp_enabled", lambda: False)())
            for name, flag in _SDP_FLAGS.items()}


def sdp_settings() -> tuple:
    """torch's global attention settings as one hashable value: each backend's enabled flag, the
    priority order, and whether the math kernel may reduce in low precision (what a memory of the
    dispatcher's choices keys on besides the call)."""
    flags = tuple(sdp_enabled().values())
    order = getattr(torch._C, "_get_sdp_priority_order", None)
    low = getattr(torch._C, "_get_math_sdp_allow_fp16_bf16_reduction", None)
    return (flags, tuple(int(c) for c in order()) if order is not None else None, bool(low()) if low is not None else None)


def sdp_priority_order() -> tuple[str, ...]:
    """The order in which torch tries the attention backends (``sdpa_kernel(..., set_priority=True)``
    changes it), by gradaudit's names."""
    return tuple(sdp_backend_name(choice) for choice in torch._C._get_sdp_priority_order())


def math_sdp_low_precision_reduction() -> bool:
    """Whether SDPA's math kernel may reduce in float16/bfloat16 (else it computes in float32)."""
    return bool(torch._C._get_math_sdp_allow_fp16_bf16_reduction())


def cudnn_version() -> Optional[int]:
    """The cuDNN version the installed torch loads (9.24.0 is 92400), None where it has none."""
    try:
        return torch.backends.cudnn.version()
    except Exception:  # a build without cuDNN
        return None


def cudnn_batch_norm(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, running_mean: Any,
                     running_var: Any, training: bool, momentum: float, eps: float) -> torch.Tensor:
    """The output of ATen's cuDNN batch norm. On meta tensors its meta implementation builds the
    CudnnBatchNormBackward0 node with the saves cuDNN makes, the reserve space empty (its size on
    a GPU is cuDNN's to say)."""
    return torch.ops.aten.cudnn_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)[0]


def suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """What ATen's ``Tensor::suggest_memory_format()`` says of ``t``: channels-last (2-d or 3-d) for
    strides like those, else contiguous."""
    from torch._prims_common import suggest_memory_format as suggest

    return suggest(t)


_AUTOCAST_CLASS = torch.amp.autocast_mode.autocast


# torch.autocast("cuda") asks this module's amp_definitely_not_available() whether to turn itself off
_AMP_COMMON = getattr(getattr(torch.cuda, "amp", None), "common", None)


@contextlib.contextmanager
def cuda_autocast_without_cuda() -> Iterator[None]:
    """While on, ``torch.autocast("cuda")`` (and ``torch.cuda.amp.autocast``) switch themselves on as on
    a GPU that supports bfloat16, also where no CUDA device is present (torch turns them off there,
    with a warning, and refuses bfloat16). Only the construction of an autocast context sees the
    difference: ``torch.cuda.is_available()`` and everything else answer as before. A no-op where
    CUDA is present (autocast works as it is) or where torch's check is not found."""
    check = getattr(_AMP_COMMON, "amp_definitely_not_available", None)
    if check is None or not check():
        yield
        return
    original = _AUTOCAST_CLASS.__init__

    @functools.wraps(original)
    def init_as_on_a_gpu(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        if device_type != "cuda":
            original(self, device_type, *args, **kwargs)
            return
        bf16 = torch.cuda.is_bf16_supported
        _AMP_COMMON.amp_definitely_not_available = lambda: False
        torch.cuda.is_bf16_supported = lambda including_emulation=True: True
        try:
            original(self, device_type, *args, **kwargs)
        finally:
            _AMP_COMMON.amp_definitely_not_available = check
            torch.cuda.is_bf16_supported = bf16

    _AUTOCAST_CLASS.__init__ = init_as_on_a_gpu
    try:
        yield
    finally:
        _AUTOCAST_CLASS.__init__ = original


def fused_sdp_choice(*args: Any, **kwargs: Any) -> int:
    """The attention backend the dispatcher would choose for these (CPU) arguments."""
    return int(torch._fused_sdp_choice(*args, **kwargs))


def any_autocast_enabled(device_types: Iterable[str]) -> bool:
    """Whether some autocast context is on (torch's one check where it has it, else per device type)."""
    check = getattr(torch._C, "_is_any_autocast_enabled", None)
    if check is not None:
        return bool(check())
    return any(torch.is_autocast_enabled(d) for d in device_types)
