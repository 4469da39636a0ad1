"""Fused bit kernels for ``trim(model, kernels="triton")``: one Triton kernel compares a save's values
and packs the bits, one unpacks them, where the torch operations take three kernels to pack and two
to unpack (``codec``: a comparison, a multiplication and a sum; an index conversion and a gather),
each a launch and a pass over memory on a GPU.

The packed bytes are the torch path's, bit for bit (bit i of byte k is element 8k+i; the padding
bits of a partial last byte 0), so plans, fits and the trim statistics count them alike, and the
unpacked values are read from a two-element tensor of the save's dtype (clear, set), exact in every
dtype. They run on CUDA tensors; elsewhere (the CPU, meta) the torch path runs. With
``TRITON_INTERPRET=1`` set before the first use, Triton's interpreter runs them on CPU tensors too:
that is how the suite checks them on a machine without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional

import torch

# the comparisons a packer makes against 0: backward's own (``codec``'s packers)
LE_ZERO, GT_ZERO, NE_ZERO = 0, 1, 2

DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_PACK_BYTES = 512  # bytes a program of the pack kernel writes (4,096 elements)
_UNPACK_VALUES = 4096  # values a program of the unpack kernel writes

_built: Optional[tuple[Any, Any]] = None
_pairs: dict[tuple[float, float, torch.dtype, torch.device], torch.Tensor] = {}


def installed() -> bool:
    """Whether Triton can be imported."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def usable(t: torch.Tensor) -> bool:
    """Whether the fused kernels take ``t``: a plain CUDA tensor (or a CPU one under Triton's
    interpreter) of a floating dtype; packed bits (uint8) for unpacking."""
    if type(t) is not torch.Tensor or not installed():
        return False
    device = t.device.type
    return device == "cuda" or (device == "cpu" and _interpreting())


def _kernels() -> tuple[Any, Any]:
    """The two kernels, defined on first use (Triton reads ``TRITON_INTERPRET`` when it defines
    them)."""
    global _built
    if _built is not None:
        return _built
    import triton
    import triton.language as tl

    @triton.jit
    def pack_kernel(values, out, count, nbytes, comparison: tl.constexpr, widen: tl.constexpr,
                    block: tl.constexpr):
        byte = tl.program_id(0) * block + tl.arange(0, block)
        lane = tl.arange(0, 8)
        index = byte[:, None] * 8 + lane[None, :]
        inside = index < count
        v = tl.load(values + index, mask=inside, other=0.0)
        if widen:
            # a 16-bit float compared as float32: exact (every value, NaN and -0.0 included, keeps
            # its order against 0); Triton's interpreter compares bfloat16 by its bits otherwise
            v = v.to(tl.float32)
        if comparison == 0:
            bit = v <= 0
        elif comparison == 1:
            bit = v > 0
        else:
            bit = v != 0
        bit = bit & inside  # padding bits: 0, as the torch path's
        weighted = bit.to(tl.int32) << lane[None, :]
        tl.store(out + byte, tl.sum(weighted, axis=1).to(tl.uint8), mask=byte < nbytes)

    @triton.jit
    def unpack_kernel(packed, pair, out, count, block: tl.constexpr):
        index = tl.program_id(0) * block + tl.arange(0, block)
        inside = index < count
        byte = tl.load(packed + index // 8, mask=inside, other=0).to(tl.int32)
        bit = (byte >> (index % 8)) & 1
        clear = tl.load(pair)
        set_ = tl.load(pair + 1)
        tl.store(out + index, tl.where(bit != 0, set_, clear), mask=inside)

    _built = (pack_kernel, unpack_kernel)
    return _built


def pack(values: torch.Tensor, comparison: int) -> torch.Tensor:
    """The bits of ``values <= 0``, ``> 0`` or ``!= 0`` (``comparison``) of a 1-D dense tensor, packed
    in one kernel: uint8, ``ceil(numel / 8)`` bytes."""
    count = values.numel()
    nbytes = (count + 7) // 8
    out = torch.empty((nbytes,), dtype=torch.uint8, device=values.device)
    if nbytes:
        pack_kernel, _ = _kernels()
        grid = ((nbytes + _PACK_BYTES - 1) // _PACK_BYTES,)
        widen = values.dtype in (torch.float16, torch.bfloat16)
        pack_kernel[grid](values, out, count, nbytes, comparison=comparison, widen=widen, block=_PACK_BYTES)
    return out


def _pair(clear: float, set_: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (clear, set_, dtype, device)
    found = _pairs.get(key)
    if found is None:
        found = torch.tensor([clear, set_], dtype=dtype, device=device)
        if len(_pairs) < 256:
            _pairs[key] = found  # kept: a tensor from a Python list on a GPU is a copy from the host
    return found


def unpack(packed: torch.Tensor, count: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``count`` values of ``dtype`` from packed bits, in one kernel: ``scale`` where a bit is set and
    0.0 where clear, or for ``scale`` -1.0, 0.0 where set and 1.0 where clear (``codec``'s tables)."""
    clear, set_ = (1.0, 0.0) if scale == -1.0 else (0.0, scale)
    out = torch.empty((count,), dtype=dtype, device=packed.device)
    if count:
        _, unpack_kernel = _kernels()
        grid = ((count + _UNPACK_VALUES - 1) // _UNPACK_VALUES,)
        unpack_kernel[grid](packed, _pair(clear, set_, dtype, packed.device), out, count, block=_UNPACK_VALUES)
    return out


def takes(values: torch.Tensor) -> bool:
    """Whether ``pack`` takes these saved values (``usable``, and a floating dtype it compares)."""
    return values.dtype in DTYPES and usable(values)
