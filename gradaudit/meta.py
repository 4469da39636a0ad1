"""Make a forward on the meta device save what the same forward saves on CPU.

``F.scaled_dot_product_attention`` picks its kernel by device: on CPU a fused flash kernel (saves
q, k, v, the output and a B x H x L logsumexp), on meta the math fallback (saves the B x H x L x L
attention probabilities). A meta scan of a 70B model would then report gigabytes the real run never
holds. While auditing on meta, gradaudit asks the CPU dispatcher which kernel it would pick for the
same shapes, dtypes and flags, and calls that kernel's meta implementation directly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import torchapi


def _cpu_twin(t: Any) -> Any:
    """An uninitialised CPU tensor with t's shape, strides, dtype and requires_grad (no values read)."""
    if not isinstance(t, torch.Tensor):
        return t
    twin = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return twin.requires_grad_(t.requires_grad)


def sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    bound.setdefault("attn_mask", None)
    bound.setdefault("dropout_p", 0.0)
    bound.setdefault("is_causal", False)
    bound.setdefault("scale", None)
    bound.setdefault("enable_gqa", False)
    return bound


def sdpa_backend(bound: dict[str, Any], dropout_p: Optional[float] = None) -> int:
    """The backend ``F.scaled_dot_product_attention`` picks for these arguments on their device;
    meta tensors are asked as CPU tensors (what an audit on meta emulates). ``dropout_p``: ask
    with another dropout probability (what-if)."""
    query = bound["query"]
    tensors = [bound[n] for n in ("query", "key", "value", "attn_mask")]
    if isinstance(query, torch.Tensor) and query.device.type == "meta":
        tensors = [_cpu_twin(t) for t in tensors]
    p = bound["dropout_p"] if dropout_p is None else dropout_p
    return torchapi.fused_sdp_choice(*tensors, p, bound["is_causal"], scale=bound["scale"],
                                     enable_gqa=bound["enable_gqa"])


class WithoutAttentionDropout(TorchFunctionMode):
    """A what-if: every ``F.scaled_dot_product_attention`` call runs with ``dropout_p=0``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = sdpa_arguments(args, kwargs)
            bound["dropout_p"] = 0.0
            return func(**bound)
        return func(*args, **kwargs)


class CpuKernelChoices(TorchFunctionMode):
    """Redirects meta-device SDPA calls to the kernel CPU would choose (only flash differs)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            a = sdpa_arguments(args, kwargs)
            query = a["query"]
            if isinstance(query, torch.Tensor) and query.device.type == "meta":
                if sdpa_backend(a) == torchapi.SDP_FLASH:
                    # the CPU flash kernel takes grouped key/value heads as they are (no repeat)
                    return torchapi.cpu_flash_attention(query, a["key"], a["value"], a["dropout_p"],
                                                        a["is_causal"], attn_mask=a["attn_mask"], scale=a["scale"])
        return func(*args, **kwargs)
