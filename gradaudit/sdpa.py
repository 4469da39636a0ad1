"""``F.scaled_dot_product_attention`` on meta: its arguments by name, the kernel the CPU dispatcher picks
for them (asked once per distinct call), the emulated call the kernel choices of ``meta`` make, and the
what-if without attention dropout.

The dispatcher's choice (``torch._fused_sdp_choice``) depends on the arguments' metadata (device,
dtype, shape, strides, requires_grad), the other arguments and torch's global attention settings,
never on values: ``cpu_choice`` asks it once per distinct (metadata, arguments, settings, grad mode,
deterministic algorithms) and answers the same call from memory after that (an 80-layer model makes
80 identical calls per forward; asking took CPU twins of four tensors and a dispatch each time). Under
``kernel_cache.checking()`` every answer from memory is asked again and must be equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from . import kernel_cache
from .torchapi.compiler import InlinedMode, constant_when_traced, traced_setter
from .torchapi.kernels import fused_sdp_choice, sdp_settings


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
    return fused_sdp_choice(*tensors, p, bound["is_causal"], scale=bound["scale"], enable_gqa=bound["enable_gqa"])


class WithoutAttentionDropout(InlinedMode):
    """A what-if: every ``F.scaled_dot_product_attention`` call runs with ``dropout_p=0``."""

    # a checkpoint's recomputation in backward runs under it again, as the forward did (planning/apply.py)
    reenter_on_recompute = True

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        setting = traced_setter(func)
        if setting is not None:
            return setattr(args[0], setting, args[1])
        if func is F.scaled_dot_product_attention:
            bound = sdpa_arguments(args, kwargs)
            bound["dropout_p"] = 0.0
            return func(**bound)
        return func(*args, **kwargs)


@dataclass(frozen=True)
class SdpaChoice:
    """The kernel an emulated ``F.scaled_dot_product_attention`` call takes on the target device."""

    kernel: str  # "flash", "efficient", "cudnn" or "math"
    kernel_without_dropout: str  # what the same call takes with dropout_p = 0
    device: str  # the device type the choice stands for ("cpu", "cuda")
    # (backend, why) for every fused backend tried before the chosen one (CUDA's choice only)
    passed_over: tuple[tuple[str, str], ...] = ()


def emulated_sdpa(choice: SdpaChoice, run: Callable[..., torch.Tensor], query: Any, key: Any, value: Any,
                  attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None,
                  enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as the kernel choices run it on meta: ``run`` (the chosen
    kernel) on the arguments. A TorchFunctionMode below the one that calls it receives this function
    with ``choice`` as its first argument (the recorder notes the call and its kernel from it)."""
    relevant = tuple(t for t in (query, key, value, attn_mask) if isinstance(t, torch.Tensor))
    if torch.overrides.has_torch_function(relevant):
        return torch.overrides.handle_torch_function(emulated_sdpa, relevant, choice, run, query, key, value,
                                                     attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return run(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def as_sdpa(bound: dict[str, Any]) -> tuple:
    return tuple(bound[n] for n in ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                                    "enable_gqa"))


def meta_query(bound: dict[str, Any]) -> bool:
    query = bound["query"]
    return isinstance(query, torch.Tensor) and query.device.type == "meta"


def cpu_additive_mask(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """attention.cpp's convert_boolean_attn_mask as the CPU runs it (seen op by op on torch 2.14):
    ``where(mask, 0, -inf)`` in the query's dtype; a float mask is used as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    masked = torch.scalar_tensor(float("-inf"), dtype=dtype, device=mask.device)
    kept = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask, kept, masked)


_CHOICES: dict[Any, int] = {}  # cpu_choice's memory: key -> backend number
_MAX_CHOICES = 4096
_KEYED = (torch.Tensor, torch.nn.Parameter)


class _Unkeyed(Exception):
    """An argument the key cannot stand for (a subclass, a nested or sparse tensor)."""


def _tensor_key(t: Any) -> Any:
    if t is None:
        return None
    if type(t) not in _KEYED or t.layout != torch.strided or t.is_nested:
        raise _Unkeyed
    return (t.device.type, t.dtype, tuple(t.shape), t.stride(), t.requires_grad)


def cpu_choice(bound: dict[str, Any], dropout_p: Optional[float] = None) -> int:
    """``sdpa_backend(bound, dropout_p)``, asked once per distinct call (the module's docstring) where the
    query is on the CPU or meta (asked as the CPU); other devices are asked every time."""
    p = bound["dropout_p"] if dropout_p is None else dropout_p
    query = bound["query"]
    if not isinstance(query, torch.Tensor) or query.device.type not in ("cpu", "meta"):
        return sdpa_backend(bound, dropout_p)  # a GPU's choice also follows its generation and environment
    try:
        key = (tuple([_tensor_key(bound[n]) for n in ("query", "key", "value", "attn_mask")]),
               p, bound["is_causal"], bound["scale"], bound["enable_gqa"], sdp_settings(), torch.is_grad_enabled(),
               torch.are_deterministic_algorithms_enabled())
        hash(key)
    except (_Unkeyed, TypeError, AttributeError, RuntimeError):
        return sdpa_backend(bound, dropout_p)
    found = _CHOICES.get(key)
    if found is None:
        found = sdpa_backend(bound, dropout_p)  # raises where the dispatcher does: nothing remembered
        if len(_CHOICES) >= _MAX_CHOICES:
            _CHOICES.clear()
        _CHOICES[key] = found
    elif kernel_cache.is_checking():
        asked = sdpa_backend(bound, dropout_p)
        if asked != found:
            raise AssertionError(f"sdpa.cpu_choice remembered backend {found}, the dispatcher picks {asked}")
    return found


# the kernel choices entered (meta.CpuKernelChoices), innermost last: ``choice_when_traced`` asks the innermost
_CHOOSING: list[Any] = []


def choosing(choices: Any) -> None:
    """``choices`` (a meta.CpuKernelChoices) entered: the one ``choice_when_traced`` asks until it leaves."""
    _CHOOSING.append(choices)


def chosen(choices: Any) -> None:
    _CHOOSING.remove(choices)


def call_key(bound: dict[str, Any]) -> tuple:
    """An SDPA call's arguments as plain values (what TorchDynamo can hand a function whose result it
    takes as a constant): each tensor's shape, strides, dtype and requires_grad, then the others."""
    tensors = tuple(None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)
                    for t in (bound["query"], bound["key"], bound["value"], bound["attn_mask"]))
    return (tensors, float(bound["dropout_p"]), bool(bound["is_causal"]), bound["scale"], bool(bound["enable_gqa"]))


@constant_when_traced
def choice_when_traced(key: tuple) -> Optional[SdpaChoice]:
    """The innermost kernel choices' ``sdpa_choice`` for the call ``key`` stands for (``call_key``),
    asked with meta tensors of its metadata: TorchDynamo runs this once while it traces and records the
    answer (the dispatcher's choice depends on metadata only, never on values)."""
    if not _CHOOSING:
        return None
    metas, dropout_p, is_causal, scale, enable_gqa = key
    tensors = [None if m is None else torch.empty_strided(m[0], m[1], dtype=m[2], device="meta").requires_grad_(m[3])
               for m in metas]
    bound = dict(zip(("query", "key", "value", "attn_mask"), tensors), dropout_p=dropout_p, is_causal=is_causal,
                 scale=scale, enable_gqa=enable_gqa)
    return _CHOOSING[-1].sdpa_choice(bound)
