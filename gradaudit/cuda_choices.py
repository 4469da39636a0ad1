"""What torch does on a CUDA GPU where it saves other tensors than on the meta device, emulated for
``audit(target="cuda")``: its choice of attention kernel for ``F.scaled_dot_product_attention``
(``choose``, ``run``), and when its dropout is the fused ``native_dropout`` (``fused_dropout_applies``).

On a GPU, ``aten::scaled_dot_product_attention`` (aten/src/ATen/native/transformers/attention.cpp)
asks ``select_sdp_backend`` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) for a backend: it
walks torch's priority order and takes the first backend whose checks pass. Each fused kernel saves
query, key, value, the output and a float32 logsumexp (and random-number state for dropout); the math
kernel is a decomposition that saves the B x H x L x S probabilities. This module runs the same checks
on meta tensors for an assumed GPU (``Gpu``: an H100, sm90, with the cuDNN the installed torch loads)
and then calls the chosen kernel's op as attention.cpp calls it (the padding, the mask conversion),
so autograd builds the node the GPU would build.

Sources: sdp_utils.cpp / sdp_utils_cpp.h and attention.cpp as read in a stored revision of
pytorch/pytorch (not necessarily the 2.14.1 tag); every check named here also appears, by its
function name and its warning text, in the installed torch 2.14.1+cu130 ``libtorch_cuda.so``. The
exact thresholds of cuDNN's preference (cuDNN > 9.15, sm90/sm10x) and of its head-dimension limit
come from that revision only.

The rules differ between releases, and the GPU that runs the step may run another torch than the
machine that audits it: ``Gpu.torch`` says whose rules apply (``assume_gpu`` sets it). What differs
from 2.11 to 2.15, and where each was read:

- cuDNN attention refuses a dropout that is not a multiple of 1/16 (``check_cudnn_dropout``) from
  2.12: the check's name and its warning ("cuDNN dropout probability resolution is limited to 1/16")
  are in the ``libtorch_cuda.so`` of the PyPI wheels of 2.12.0, 2.13.0, 2.14.1 and 2.15.0, not in
  2.11.0's; on an H100 with 2.11.0+cu130, BERT-family encoders and GPT-2 in bf16 with dropout 0.1 ran
  cuDNN attention (shared/notes/gpu-facts.md).
- The memory-efficient kernel takes grouped key/value heads (``enable_gqa``) from 2.14 (pytorch PR
  #191085; its messages "`shared_storage_dqdkdv` does not support grouped query attention" and
  "invalid GQA group size" are in the 2.14.1 and 2.15.0 binaries, not in 2.11.0, 2.12.0 or 2.13.0);
  on the 2.11 H100, fp32 decoders with grouped heads and no mask ran the math kernel.
- 2.15 passes cuDNN over on sm90 below cuDNN 9.26 for non-causal attention whose key/value length is
  64 modulo 128 (its warning: "cuDNN SDPA before version 9.26 can produce non-finite query gradients
  on SM90 for non-causal attention when the key/value sequence length is 64 modulo 128", in 2.15.0 only).
- The cuDNN each release's default CUDA wheel pins (``nvidia-cudnn-cu13`` in its METADATA): 2.11 9.19,
  2.12 and 2.13 9.20, 2.14 9.24, 2.15 9.26; all are CUDA 13 builds (2.15: 13.2).

Not emulated (the same bytes either way): on the 2.11 H100 a Linear on a 3-D input made
``AddmmBackward0`` where the meta device of the installed release makes ``MmBackward0``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from .errors import GradauditError
from .torchapi.kernels import (cuda_cudnn_attention, cuda_efficient_attention, cuda_flash_attention,
                               cudnn_version, math_sdp_low_precision_reduction, mul_scalar, native_dropout,
                               safe_softmax, sdp_enabled, sdp_priority_order)

_HALF = (torch.float16, torch.bfloat16)
# torch's default priority order (ATen's Context); a GPU that prefers cuDNN replaces it once, at its
# first attention call, with cuDNN first (sdp_utils.cpp priority_order / check_prefer_cudnn_attention)
STOCK_PRIORITY = ("flash", "efficient", "math", "cudnn", "overrideable")
CUDNN_FIRST = ("cudnn", "flash", "efficient", "math", "overrideable")
FUSED = ("flash", "efficient", "cudnn")


# The torch releases whose dispatch rules this module knows, and what each one's default CUDA wheel
# on PyPI bundles: the cuDNN it pins (nvidia-cudnn-cu13 in the wheel's METADATA) and its CUDA build
RELEASES = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))
BUNDLED_CUDNN = {(2, 11): 91900, (2, 12): 92000, (2, 13): 92000, (2, 14): 92400, (2, 15): 92600}
BUNDLED_CUDA = {(2, 11): (13, 0), (2, 12): (13, 0), (2, 13): (13, 0), (2, 14): (13, 0), (2, 15): (13, 2)}
# GPU names people use -> compute capability (NVIDIA's CUDA GPU list)
GPUS = {"A100": (8, 0), "A10": (8, 6), "A10G": (8, 6), "RTX3090": (8, 6), "L4": (8, 9), "L40": (8, 9),
        "L40S": (8, 9), "RTX4090": (8, 9), "H100": (9, 0), "H200": (9, 0), "GH200": (9, 0), "B200": (10, 0),
        "GB200": (10, 0), "RTX5090": (12, 0)}


def _version_pair(text: str) -> tuple[int, int]:
    parts = [int(p) for p in re.findall(r"\d+", text.split("+")[0])[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def installed_release() -> tuple[int, int]:
    """The installed torch's (major, minor)."""
    return _version_pair(torch.__version__)


def _release_of(release: tuple[int, int]) -> tuple[int, int]:
    """The known release whose rules stand for ``release`` (a newer one: the newest known)."""
    if release in RELEASES or release < RELEASES[0]:
        return release if release in RELEASES else RELEASES[0]
    return max(r for r in RELEASES if r <= release)


@dataclass(frozen=True)
class Gpu:
    """The GPU an audit with ``target="cuda"`` stands for, as far as torch's kernel choice asks."""

    name: str
    capability: tuple[int, int]  # compute capability (9, 0): sm90
    cudnn: int  # cuDNN version as torch reports it (9.24.0: 92400)
    # whether the build's cuDNN frontend takes head dims up to 256 on sm90 (sdp_utils.cpp's
    # kCuDNNFrontendSupportsD256: frontend >= 1.24); not known for the installed wheel, assumed not
    cudnn_head_dim_256: bool = False
    cuda: tuple[int, int] = (13, 0)  # the CUDA version torch was built for (its cuDNN preference differs below 13)
    # the torch release running on that GPU, whose dispatch rules apply (default: the installed one's)
    torch: tuple[int, int] = field(default_factory=lambda: _release_of(installed_release()))

    @property
    def sm(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"

    def describe(self) -> str:
        version = f"{self.cudnn // 10000}.{self.cudnn // 100 % 100}"
        article = "an" if self.name[:1].upper() in "AEFHILMNORSX" else "a"
        return f"{article} {self.name} ({self.sm}) with cuDNN {version} under torch {self.torch[0]}.{self.torch[1]}"


def _cuda_build() -> tuple[int, int]:
    return _version_pair(torch.version.cuda or "13.0")


def default_gpu() -> Gpu:
    """An H100 (sm90) with the cuDNN the installed torch loads (9.24 for torch 2.14.1+cu130 wheels;
    where the installed torch has none, the cuDNN its release's default CUDA wheel bundles), CUDA as the
    installed torch was built for, under the installed release's rules."""
    release = _release_of(installed_release())
    return Gpu("H100", (9, 0), cudnn_version() or BUNDLED_CUDNN[release],
               cuda=_cuda_build() if torch.version.cuda else BUNDLED_CUDA[release], torch=release)


_ASSUMED: contextvars.ContextVar[Optional[Gpu]] = contextvars.ContextVar("gradaudit_assumed_gpu", default=None)


def assumed_gpu() -> Gpu:
    """The GPU ``target="cuda"`` stands for: the one ``assume_gpu`` set, else ``default_gpu()``."""
    gpu = _ASSUMED.get()
    return gpu if gpu is not None else default_gpu()


def parse_release(text: Any) -> tuple[int, int]:
    """``"2.11"``, ``"2.11.0"`` or ``"2.11.0+cu130"`` -> (2, 11); a release outside 2.11-2.15 is refused."""
    found = re.fullmatch(r"\s*(\d+)\.(\d+)(\.\d+)?(\+\S+)?\s*", str(text))
    if found is None:
        raise GradauditError(f"torch release {text!r}: write it as 2.11 or 2.11.0")
    release = (int(found.group(1)), int(found.group(2)))
    if release not in RELEASES:
        known = f"{RELEASES[0][0]}.{RELEASES[0][1]} to {RELEASES[-1][0]}.{RELEASES[-1][1]}"
        raise GradauditError(f"torch {release[0]}.{release[1]}: gradaudit knows the kernel choices of torch {known}")
    return release


def parse_cudnn(text: Any) -> int:
    """``"9.19"``, ``"9.19.0"`` or torch's number (``91900``) -> 91900; cuDNN 9 only (torch 2.11 on needs it)."""
    value = str(text).strip()
    if value.isdigit() and len(value) == 5:
        number = int(value)
    else:
        found = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?", value)
        if found is None:
            raise GradauditError(f"cuDNN version {text!r}: write it as 9.19 or 9.19.0 (or torch's 91900)")
        number = int(found.group(1)) * 10000 + int(found.group(2)) * 100 + int(found.group(3) or 0)
    if not 90000 <= number < 100000:
        raise GradauditError(f"cuDNN version {text!r}: torch 2.11 to 2.15 load cuDNN 9 (9.0 to 9.99)")
    return number


def parse_gpu(text: Any) -> tuple[str, tuple[int, int]]:
    """A GPU name (``"H100"``, ``"A100"``; see GPUS) or a compute capability (``"sm90"``, ``"9.0"``)
    -> (name, capability)."""
    value = str(text).strip()
    key = value.upper().replace(" ", "").replace("-", "").replace("NVIDIA", "")
    if key in GPUS:
        return key, GPUS[key]
    found = re.fullmatch(r"(?:SM_?)?(\d{1,2})\.?(\d)", key)
    if found is not None:
        capability = (int(found.group(1)), int(found.group(2)))
        return f"sm{capability[0]}{capability[1]} GPU", capability
    raise GradauditError(f"GPU {text!r}: name one of {', '.join(GPUS)} or give its compute capability (sm90, 9.0)")


def target_gpu(gpu: Any = None, torch_release: Any = None, cudnn: Any = None) -> Gpu:
    """The Gpu for a GPU name or capability, the torch release running there and its cuDNN; each left
    out is the default's (an H100; the installed release; the cuDNN of the installed torch where the
    release is the installed one, else the one the release's default CUDA wheel bundles)."""
    base = default_gpu()
    name, capability = parse_gpu(gpu) if gpu is not None else (base.name, base.capability)
    release = parse_release(torch_release) if torch_release is not None else base.torch
    same = release == base.torch
    number = parse_cudnn(cudnn) if cudnn is not None else (base.cudnn if same else BUNDLED_CUDNN[release])
    return replace(base, name=name, capability=capability, cudnn=number, torch=release,
                   cuda=base.cuda if same else BUNDLED_CUDA[release])


@contextlib.contextmanager
def assume_gpu(gpu: Any = None, *, torch: Any = None, cudnn: Any = None) -> Iterator[Gpu]:
    """Within the block, ``target="cuda"`` stands for this GPU under this torch release and cuDNN
    (``target_gpu``), in audits, plans and fits alike; yields the Gpu."""
    chosen = gpu if isinstance(gpu, Gpu) and torch is None and cudnn is None else target_gpu(gpu, torch, cudnn)
    token = _ASSUMED.set(chosen)
    try:
        yield chosen
    finally:
        _ASSUMED.reset(token)


@dataclass(frozen=True)
class SdpaCall:
    """The arguments of one ``F.scaled_dot_product_attention`` call."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: Optional[float] = None
    enable_gqa: bool = False

    @classmethod
    def of(cls, bound: dict[str, Any], dropout_p: Optional[float] = None) -> "SdpaCall":
        return cls(bound["query"], bound["key"], bound["value"], bound["attn_mask"],
                   float(bound["dropout_p"] if dropout_p is None else dropout_p), bool(bound["is_causal"]),
                   bound["scale"], bool(bound["enable_gqa"]))

    @property
    def qkv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.query, self.key, self.value

    def requires_grad(self) -> bool:
        """sdp_utils_cpp.h input_requires_grad / attention.cpp should_compute_logsumexp."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in self.qkv)


def emulable(call: SdpaCall) -> bool:
    """Whether the call is one the emulation takes (dense meta tensors that pass attention.cpp's
    validate_sdpa_input); others go to torch unchanged, which raises its own error where it should."""
    tensors = [call.query, call.key, call.value] + ([call.attn_mask] if call.attn_mask is not None else [])
    if not all(isinstance(t, torch.Tensor) and t.device.type == "meta" and t.layout == torch.strided
               and not t.is_nested for t in tensors):
        return False
    q, k, v = call.qkv
    if not (q.dtype == k.dtype == v.dtype) or min(q.dim(), k.dim(), v.dim()) < 2:
        return False
    return call.attn_mask is None or call.attn_mask.dtype in (torch.bool, q.dtype)


# -- the checks of sdp_utils.cpp / sdp_utils_cpp.h: each returns why it fails, None when it passes ------

def _four_dims(c: SdpaCall) -> Optional[str]:  # check_tensor_shapes
    if not (c.query.dim() == c.key.dim() == c.value.dim() == 4):
        return "query, key and value are not all 4-D"
    return None


def _batch_and_heads(c: SdpaCall) -> Optional[str]:  # check_batch_size_and_num_heads_dense
    q, k, v = c.qkv
    if not (q.size(0) == k.size(0) == v.size(0)):
        return "query, key and value have different batch sizes"
    heads = q.size(-3), k.size(-3), v.size(-3)
    if c.enable_gqa:  # check_grouped_query_attention
        if heads[1] != heads[2]:
            return "key and value have different numbers of heads"
        if heads[0] % heads[1]:
            return "the key/value head count does not divide the query head count"
        return None
    if len(set(heads)) > 1:
        return "query, key and value have different numbers of heads (and enable_gqa is off)"
    return None


def _nonzero_lengths(c: SdpaCall) -> Optional[str]:  # check_nonzero_sequence_lengths_dense
    if c.query.size(-2) == 0 or c.key.size(-2) == 0:
        return "a sequence length is 0"
    return None


def _unit_stride(c: SdpaCall, ignore_head_dim_1: bool) -> Optional[str]:  # check_last_dim_stride_equals_1_dense
    if not (all(t.stride(-1) == 1 for t in c.qkv) or (ignore_head_dim_1 and c.query.size(-1) == 1)):
        return "the last dimension of query, key or value has a stride other than 1"
    if c.attn_mask is not None and c.attn_mask.stride(-1) != 1:
        return "the attn_mask's last dimension has a stride other than 1"
    return None


def _dtype(c: SdpaCall, allowed: tuple[torch.dtype, ...]) -> Optional[str]:  # check_tensor_dtype
    if c.query.dtype not in allowed:
        return f"{str(c.query.dtype).split('.')[-1]} (it takes {', '.join(str(d).split('.')[-1] for d in allowed)})"
    return None


def _within(gpu: Gpu, low: tuple[int, int], high: tuple[int, int]) -> bool:  # check_sm_version
    return low <= gpu.capability <= high


def _first(*checks: Callable[[], Optional[str]]) -> Optional[str]:
    for check in checks:
        why = check()
        if why:
            return why
    return None


def flash_rejects(c: SdpaCall, gpu: Gpu, enabled: dict[str, bool]) -> Optional[str]:
    """sdp_utils.cpp can_use_flash_attention (dense inputs)."""
    def head_dims() -> Optional[str]:  # check_head_dim_size_flash
        dims = {t.size(-1) for t in c.qkv}
        if len(dims) > 1 or c.query.size(-1) > 256:
            return "query, key and value head dims differ or exceed 256"
        return None

    def training_head_dim() -> Optional[str]:  # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
        if not (_within(gpu, (8, 6), (8, 9)) or _within(gpu, (12, 0), (12, 1))) or not c.requires_grad():
            return None
        d = c.query.size(-1)
        if d <= 192 or (c.dropout_p == 0 and d > 224):
            return None
        return f"training with head dim {d} on {gpu.sm}"

    def causal() -> Optional[str]:  # check_flash_causal_non_square_seqlens
        if c.is_causal and c.query.size(-2) != c.key.size(-2):
            return "is_causal with a query length other than the key length"
        return None

    dtypes = _HALF if gpu.capability[0] >= 8 else (torch.float16,)  # check_dtypes_flash_attention
    if gpu.capability[0] >= 9 and enabled.get("fa3"):
        dtypes = dtypes + (torch.float8_e4m3fn,)
    return _first(
        lambda: None if enabled["flash"] else "disabled (torch.backends.cuda.enable_flash_sdp / sdpa_kernel)",
        lambda: _four_dims(c),
        lambda: None if c.attn_mask is None else "an attn_mask (flash takes none)",
        head_dims,
        lambda: None if _within(gpu, (8, 0), (12, 1)) else f"{gpu.sm} (flash needs sm80 to sm121)",
        training_head_dim, causal,
        lambda: _dtype(c, dtypes),
        lambda: _batch_and_heads(c), lambda: _nonzero_lengths(c), lambda: _unit_stride(c, True))


def _gemm_alignment(gpu: Gpu, half: bool) -> int:  # sdp_utils.cpp minimum_gemm_alignment
    major = gpu.capability[0]
    tensor_cores = major >= 8 or (major >= 7 and half)
    alignment = 4 if major >= 8 else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def efficient_rejects(c: SdpaCall, gpu: Gpu, enabled: dict[str, bool]) -> Optional[str]:
    """sdp_utils.cpp can_use_mem_efficient_attention (dense inputs, CUDA)."""
    alignment = _gemm_alignment(gpu, c.query.dtype in _HALF)

    def head_dims() -> Optional[str]:  # check_head_dim_size_mem_efficient
        dq, dk, dv = (t.size(-1) for t in c.qkv)
        if dq != dk or dq <= 0 or dv <= 0 or dq % alignment or dv % alignment:
            return f"head dims not multiples of {alignment} for {str(c.query.dtype).split('.')[-1]} (or query and " \
                   f"key head dims differ)"
        return None

    def storage_offsets() -> Optional[str]:  # check_data_ptr_alignment_mem_efficient (sm80 and newer)
        if gpu.capability[0] < 8:
            return None
        if any(t.numel() and t.storage_offset() % alignment for t in c.qkv):
            return f"a query, key or value storage offset not a multiple of {alignment} elements"
        return None

    def grouped_heads() -> Optional[str]:  # check_batch_size_and_num_heads_dense<supports_gqa>
        if gpu.torch >= (2, 14) or not c.enable_gqa:
            return _batch_and_heads(c)
        if len({t.size(-3) for t in c.qkv}) > 1:
            return f"grouped key/value heads (enable_gqa): it takes them from torch 2.14, this is {_release(gpu)}"
        return _batch_and_heads(c)

    dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if gpu.capability[0] >= 8 else ())
    return _first(
        lambda: (None if enabled["efficient"]
                 else "disabled (torch.backends.cuda.enable_mem_efficient_sdp / sdpa_kernel)"),
        lambda: None if _within(gpu, (5, 0), (12, 1)) else f"{gpu.sm} (needs sm50 to sm121)",
        lambda: _four_dims(c), head_dims, storage_offsets,
        lambda: _nonzero_lengths(c), lambda: _unit_stride(c, False), grouped_heads,
        lambda: _dtype(c, dtypes))


def _release(gpu: Gpu) -> str:
    return f"torch {gpu.torch[0]}.{gpu.torch[1]}"


def _cudnn_mask(c: SdpaCall) -> Optional[str]:  # sdp_utils_cpp.h check_attn_mask_shape
    mask = c.attn_mask
    if mask is None:
        return None
    if mask.requires_grad:
        return "an attn_mask that requires grad"
    q = c.query
    fits = mask.size(-2) in (q.size(2), 1) and mask.size(-1) in (c.key.size(2), 1)
    if fits and (mask.dim() == 2 or (mask.dim() == 4 and mask.size(0) in (1, q.size(0))
                                     and mask.size(1) in (1, q.size(1)))):
        return None
    return f"an attn_mask of shape {tuple(mask.shape)} (it takes 2-D or 4-D, broadcast over batch and heads)"


def _cudnn_supports_d256(gpu: Gpu) -> bool:
    sm90_or_10x = gpu.capability == (9, 0) or gpu.capability[0] == 10
    unsupported_sm107 = gpu.capability == (10, 7) and gpu.cudnn <= 92500
    return sm90_or_10x and not unsupported_sm107 and gpu.cudnn > 92200 and gpu.cudnn_head_dim_256


def _cudnn_shapes(c: SdpaCall, gpu: Gpu) -> Optional[str]:  # check_cudnn_tensor_shapes
    q, k, v = c.qkv
    if q.size(0) > 65535 or q.size(1) > 65535:
        return "batch or head count above 65535"
    s_q, s_k, d_qk, d_v = q.size(2), k.size(2), q.size(3), v.size(3)
    sm90_or_10x = gpu.capability == (9, 0) or gpu.capability[0] == 10
    if _cudnn_supports_d256(gpu):
        limit = 256
    elif sm90_or_10x and gpu.cudnn >= 91100 and (d_qk, d_v) == (192, 128):
        limit = 192
    else:
        limit = 128
    if d_qk > limit or d_v > limit:
        return f"head dim above {limit}"
    if d_qk % 8 or d_v % 8:
        return "head dim not a multiple of 8"
    if s_k == 1:
        return "key/value sequence length 1"
    if c.dropout_p != 0 and s_q == 1:
        return "query sequence length 1 with dropout"
    return None


def _cudnn_backward_head_dims(c: SdpaCall, gpu: Gpu) -> Optional[str]:  # check_cudnn_d256_bprop_head_dim
    if not c.requires_grad() or not _cudnn_supports_d256(gpu):
        return None
    dims = (c.query.size(3), c.value.size(3))
    if (dims[0] <= 128 and dims[1] <= 128) or dims in ((192, 128), (256, 256)):
        return None
    return f"head dims {dims} in training"


def cudnn_rejects(c: SdpaCall, gpu: Gpu, enabled: dict[str, bool]) -> Optional[str]:
    """sdp_utils.cpp can_use_cudnn_attention (dense inputs)."""
    def deterministic() -> Optional[str]:  # check_cudnn_deterministic
        if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
            return "deterministic algorithms are on (torch.use_deterministic_algorithms)"
        return None

    def dropout() -> Optional[str]:  # check_cudnn_dropout, from torch 2.12
        if gpu.torch < (2, 12) or c.dropout_p * 16 == math.floor(c.dropout_p * 16):
            return None
        return f"dropout {c.dropout_p:g} is not a multiple of 1/16"

    def sm90_key_length() -> Optional[str]:  # torch 2.15: non-finite query gradients before cuDNN 9.26
        if (gpu.torch >= (2, 15) and gpu.capability == (9, 0) and gpu.cudnn < 92600 and not c.is_causal
                and c.key.size(-2) % 128 == 64):
            return f"a key/value length of 64 modulo 128 without is_causal on sm90 below cuDNN 9.26 ({_release(gpu)})"
        return None

    return _first(
        lambda: None if gpu.cudnn >= 90000 else "cuDNN older than 9.0",
        lambda: ("cuDNN 9.11 to 9.13 takes no dropout" if c.dropout_p > 0 and 91100 < gpu.cudnn < 91400 else None),
        lambda: None if enabled["cudnn"] else "disabled (torch.backends.cuda.enable_cudnn_sdp / sdpa_kernel)",
        lambda: _four_dims(c), deterministic,
        lambda: _dtype(c, _HALF if gpu.capability[0] >= 8 else (torch.float16,)),
        lambda: _cudnn_mask(c),
        lambda: None if _within(gpu, (8, 0), (12, 1)) else f"{gpu.sm} (cuDNN attention needs sm80 to sm121)",
        dropout,
        lambda: _nonzero_lengths(c), lambda: _unit_stride(c, True), lambda: _batch_and_heads(c),
        lambda: _cudnn_shapes(c, gpu), lambda: _cudnn_backward_head_dims(c, gpu), sm90_key_length)


REJECTS = {"flash": flash_rejects, "efficient": efficient_rejects, "cudnn": cudnn_rejects}


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE", "Y")


def prefers_cudnn(gpu: Gpu) -> bool:
    """sdp_utils.cpp check_prefer_cudnn_attention: cuDNN newer than 9.15 on sm9x/sm10x (CUDA 13 builds;
    builds for older CUDA also need minor version 0 or 3), unless TORCH_CUDNN_SDPA_DEPRIORITIZED is set."""
    if _env_true("TORCH_CUDNN_SDPA_DEPRIORITIZED"):
        return False
    major, minor = gpu.capability
    fits = gpu.cudnn > 91500 and major in (9, 10)
    return fits if gpu.cuda >= (13, 0) else fits and minor in (0, 3)


def priority(gpu: Gpu) -> tuple[str, ...]:
    """The order select_sdp_backend tries the backends in: torch's setting, except that the stock
    default becomes cuDNN-first where this GPU prefers cuDNN (a GPU does so at its first call)."""
    order = sdp_priority_order()
    if order == STOCK_PRIORITY and prefers_cudnn(gpu):
        return CUDNN_FIRST
    return order


@dataclass(frozen=True)
class Choice:
    """The backend chosen, and why each fused backend tried before it was passed over."""

    kernel: str  # "flash", "efficient", "cudnn" or "math"
    passed_over: tuple[tuple[str, str], ...] = ()


def choose(c: SdpaCall, gpu: Gpu) -> Choice:
    """sdp_utils.cpp select_sdp_backend for ``gpu``. Raises RuntimeError where a GPU would find no
    kernel (math disabled and no fused kernel takes the call), as torch does there."""
    enabled = sdp_enabled()
    if not any(enabled[name] for name in ("math", *FUSED)):
        raise RuntimeError("scaled_dot_product_attention: every backend is disabled (sdpa_kernel / "
                           "torch.backends.cuda.enable_*_sdp), so CUDA finds no viable backend")
    passed: list[tuple[str, str]] = []
    for name in priority(gpu):
        if name == "math":
            if enabled["math"]:
                return Choice("math", tuple(passed))
        elif name in REJECTS:
            why = REJECTS[name](c, gpu, enabled)
            if why is None:
                return Choice(name, tuple(passed))
            passed.append((name, why))
        elif name == "overrideable" and enabled["overrideable"]:
            break  # select_sdp_backend fails here on CUDA ("Invalid backend")
    reasons = "; ".join(f"{name}: {why}" for name, why in passed)
    raise RuntimeError(f"scaled_dot_product_attention: no attention kernel {gpu.describe()} would run takes these "
                       f"arguments with the math kernel disabled ({reasons})")


# -- running the chosen kernel as attention.cpp calls it -------------------------------------------

def additive_mask(mask: Optional[torch.Tensor], dtype: torch.dtype, masked_value: float) -> Optional[torch.Tensor]:
    """attention.cpp convert_boolean_attn_mask(_cudnn): a bool mask becomes 0 where attended and
    ``masked_value`` elsewhere, in the query's dtype; a float mask is used as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), masked_value, zero)


def _pad_head_dim(t: torch.Tensor, multiple: int = 8) -> torch.Tensor:  # attention.cpp pad_last_dim<8, false>
    rest = t.size(-1) % multiple
    return t if rest == 0 else F.pad(t, (0, multiple - rest))


def _efficient_bias(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """attention.cpp preprocess_mask: a mask whose strides are not multiples of 8 (or whose last
    stride is not 1) is copied into a buffer padded to a multiple of 8 keys, then broadcast to
    B x H x L x S."""
    aligned = all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1
    if not aligned:
        keys = mask.size(-1)
        mask = F.pad(mask, (0, 8 - keys % 8))[..., :keys]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def _math_with_fused_dropout(c: SdpaCall) -> torch.Tensor:
    """attention.cpp _scaled_dot_product_attention_math, whose at::dropout is on CUDA the fused
    native_dropout (a bool mask) where the meta device would multiply by a float mask."""
    mask = additive_mask(c.attn_mask, c.query.dtype, -math.inf)
    origin = c.query.dtype
    low_precision_ok = math_sdp_low_precision_reduction()

    def accumulate(t: torch.Tensor) -> torch.Tensor:  # kept in float32 unless low precision is allowed
        return t.to(torch.float32) if t.dtype in _HALF and not low_precision_ok else t

    query, key, value = (accumulate(t) for t in c.qkv)
    negative = c.scale is not None and c.scale < 0
    factor = math.sqrt(abs(c.scale) if c.scale is not None else 1.0 / math.sqrt(query.size(-1)))
    query = mul_scalar(query, -factor if negative else factor)
    if c.is_causal:
        causal = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
        mask = additive_mask(causal, query.dtype, -math.inf)
    if c.enable_gqa and not (query.size(-3) == key.size(-3) == value.size(-3)):
        # attention.cpp pre_process_group_query_attention_input
        if query.size(-3) % key.size(-3) or query.size(-3) % value.size(-3):
            raise RuntimeError("Number of heads in key and value must divide the number of heads in query")
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    attn = torch.matmul(query, mul_scalar(key.transpose(-2, -1), factor))
    if mask is not None:
        attn.add_(mask)
    attn = safe_softmax(attn, -1)
    if 0 < c.dropout_p < 1 and attn.numel() > 0:  # Dropout.cpp is_fused_kernel_acceptable on CUDA
        attn = native_dropout(attn, c.dropout_p)
    elif c.dropout_p > 0:
        attn = torch.dropout(attn, c.dropout_p, True)
    return torch.matmul(attn, value).to(origin)


def run(c: SdpaCall, kernel: str) -> torch.Tensor:
    """The output of ``F.scaled_dot_product_attention`` on CUDA with ``kernel`` chosen (attention.cpp's
    branch for it), on meta tensors."""
    q, k, v = c.qkv
    if kernel == "flash":
        head_dim = q.size(-1)
        scale = c.scale if c.scale is not None else 1.0 / math.sqrt(head_dim)  # from the unpadded head dim
        out = cuda_flash_attention(_pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v), c.dropout_p,
                                            c.is_causal, scale)
        return out if out.size(-1) == head_dim else out[..., :head_dim]
    if kernel == "efficient":
        mask = additive_mask(c.attn_mask, q.dtype, -math.inf)
        if mask is not None:
            mask = _efficient_bias(mask, q, k)
        return cuda_efficient_attention(q, k, v, mask, c.requires_grad(), c.dropout_p, c.is_causal, c.scale)
    if kernel == "cudnn":
        mask = additive_mask(c.attn_mask, q.dtype, -65504.0)
        return cuda_cudnn_attention(q, k, v, mask, c.requires_grad(), c.dropout_p, c.is_causal, c.scale)
    if c.dropout_p > 0:
        return _math_with_fused_dropout(c)
    # without dropout the math kernel is one composite for every device: the meta device runs CUDA's
    return F.scaled_dot_product_attention(q, k, v, attn_mask=c.attn_mask, dropout_p=0.0, is_causal=c.is_causal,
                                          scale=c.scale, enable_gqa=c.enable_gqa)


def fused_dropout_applies(x: Any, p: float, training: bool, inplace: bool = False) -> bool:
    """Dropout.cpp ``dropout``: in training CUDA runs native_dropout (NativeDropoutBackward0, a bool
    mask) for 0 < p < 1 and a non-empty input (is_fused_kernel_acceptable); the in-place variant and
    the feature / alpha dropouts multiply by a mask as the meta device does."""
    return (isinstance(x, torch.Tensor) and x.device.type == "meta" and not x.is_nested and bool(training)
            and not inplace and isinstance(p, (int, float)) and 0 < p < 1 and x.numel() > 0)
