"""The bit codec of ``trim``: one bit per element for saves backward reads as a sign or a mask,
and the unfilled stand-ins for saves it does not read.

A packer takes the saved values (in memory order) and returns (packed bits, value a set bit
stands for; 0 elsewhere), or None when the values do not fit that form. Each is written so the
unpacked tensor gives the backward the same results:
  threshold_backward(grad, x, 0): x <= 0 ? 0 : grad   (ReLU result, Threshold with threshold 0)
  leaky_relu_backward(grad, x, slope): x > 0 ? grad : grad * slope
so the bit is that comparison itself (NaN, -0.0 included) and the unpacked value 1.0 or 0.0;
  dropout (a multiplication by a mask of 0 and 1/(1-p)): grad * mask
so the mask must be reproduced exactly: checked to hold only +0.0 and one positive value.
Which packer a save gets comes from the op knowledge (``Read.bit``; a MASK read: ``scaled_mask``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..knowledge import Bit

try:
    import numpy
except ImportError:  # torch runs without numpy; bit-packing then uses torch ops only
    numpy = None

# (same IEEE comparisons: NaN and -0.0 give the same answers); what they write is still allocated
# by torch, so storage trackers see it
_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64})

# Elements compared per chunk: the chunk's bool mask (256 KiB) stays in cache between the
# comparison that writes it and the packing that reads it. A multiple of 8, so that every chunk
# starts on a byte of the packed bits.
_CHUNK = 1 << 18


def _numpy_ok(values: torch.Tensor) -> bool:
    return (numpy is not None and type(values) is torch.Tensor and values.device.type == "cpu"
            and values.dtype in _NUMPY_DTYPES)


def _compare_and_pack(values: torch.Tensor, compare: Any, inverted: bool) -> torch.Tensor:
    """Bits of ``compare(values, 0)`` (their complement when ``inverted``), chunk by chunk."""
    count = values.numel()
    packed = torch.empty(((count + 7) // 8,), dtype=torch.uint8)
    scratch = torch.empty((min(count, _CHUNK),), dtype=torch.bool)
    source, out, mask = values.numpy(), packed.numpy(), scratch.numpy()
    for start in range(0, count, _CHUNK):
        stop = min(count, start + _CHUNK)
        chunk = mask[:stop - start]
        compare(source[start:stop], 0, out=chunk)
        out[start // 8:(stop + 7) // 8] = numpy.packbits(chunk, bitorder="little")
    if inverted:
        numpy.invert(out, out=out)  # the padding bits become 1: never read (see _unpack_bits)
    return packed


def _passes_unless_le_zero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    # the bit is not(x <= 0) (NaN passes, as in threshold_backward): x <= 0 is packed and the
    # bytes flipped, one pass fewer than negating the mask
    if _numpy_ok(values):
        return _compare_and_pack(values, numpy.less_equal, inverted=True), 1.0
    return pack_bits(values <= 0, inverted=True), 1.0


def _passes_if_gt_zero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    if _numpy_ok(values):
        return _compare_and_pack(values, numpy.greater, inverted=False), 1.0
    return pack_bits(values > 0), 1.0


def _scaled_mask(values: torch.Tensor) -> Optional[tuple[torch.Tensor, float]]:
    if values.numel() == 0 or values.device.type == "meta":
        return None  # no values to check: kept
    scale = values.max()
    bits = values == scale
    exact = bool(torch.logical_or(bits, values == 0).all()) and not bool(torch.signbit(values).any())
    if not exact or not bool(scale > 0):
        return None
    return pack_bits(bits), scale.item()



def dropout_mask(values: torch.Tensor, scale: float) -> torch.Tensor:
    """The bits of the keep-mask of a stock ``torch.nn`` dropout module on the CPU, with no look at its
    values from the host: ``bernoulli_(1 - p)`` divided by ``1 - p`` holds +0.0 and one positive value
    by construction (ATen's ``Dropout.cpp``), which for a given ``p`` and dtype is ``scale``, read off
    the same module's mask in the forward trim decided fully. Only the steady plan uses it, for a
    node it found made inside such a module with that ``p`` (``steady.Entry``)."""
    return pack_bits(values != 0)


def _byte_unless_le_zero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    # the byte is x <= 0 (NaN: False, so it passes, as in threshold_backward); unpacked to 0.0 where
    # set and 1.0 elsewhere
    return values <= 0, -1.0


def _byte_if_gt_zero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    return values > 0, 1.0


def _byte_scaled_mask(values: torch.Tensor) -> Optional[tuple[torch.Tensor, float]]:
    found = _scaled_mask(values)
    return None if found is None else (values != 0, found[1])


Packer = Callable[[torch.Tensor], Optional[tuple[torch.Tensor, float]]]
PACKERS: dict[Bit, Packer] = {
    Bit.NOT_LE_ZERO: _passes_unless_le_zero,
    Bit.GT_ZERO: _passes_if_gt_zero,
}
scaled_mask: Packer = _scaled_mask

# masks="bytes": one bool per element instead of one bit, each packer's counterpart. One operation to
# make (the comparison) and one to unpack (a select), where bits take several of each (on a GPU,
# each is a kernel launch); frees 75% of a float32 save instead of ~97%. A byte packer's scale:
# the value a True stands for (False: 0.0), or -1.0 for a mask whose True stands for 0.0 and False 1.0
BYTES: dict[Packer, Packer] = {
    _passes_unless_le_zero: _byte_unless_le_zero,
    _passes_if_gt_zero: _byte_if_gt_zero,
    _scaled_mask: _byte_scaled_mask,
}
MASK_FORMATS = ("bits", "bytes")


def pack_bits(mask: torch.Tensor, inverted: bool = False) -> torch.Tensor:
    """1-D bool -> uint8: bit i of byte k is element 8k+i (``inverted``: its complement).

    The packed bytes are allocated by torch, so storage trackers see them.
    """
    count = mask.numel()
    if mask.device.type != "cpu" or numpy is None:
        return _pack_bits_with_torch(mask, inverted)
    # numpy's packbits is one C loop; the torch expression takes several passes
    packed = torch.empty(((count + 7) // 8,), dtype=torch.uint8, device=mask.device)
    out = packed.numpy()
    out[:] = numpy.packbits(mask.numpy(), bitorder="little")
    if inverted:
        numpy.invert(out, out=out)  # the padding bits become 1: never read (see _unpack_bits)
    return packed


def _pack_bits_with_torch(mask: torch.Tensor, inverted: bool) -> torch.Tensor:
    """``pack_bits`` in torch operations (a GPU, meta): each is a dispatch, and on a GPU a kernel
    launch, so as few as the layout allows (a count that is a multiple of 8 needs no padded copy)."""
    count = mask.numel()
    if count % 8 == 0 and mask.is_contiguous():
        octets = mask.view(torch.uint8).view(-1, 8)
    else:
        octets = torch.zeros((((count + 7) // 8) * 8,), dtype=torch.uint8, device=mask.device)
        octets[:count] = mask.view(torch.uint8)
        octets = octets.view(-1, 8)
    weights = _BIT_WEIGHTS.get(mask.device)
    if weights is None:
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
        if type(weights) is torch.Tensor and weights.device.type == "cuda":
            # kept per GPU: a tensor built from a Python list there is a blocking copy from the host,
            # which per save stalled every trimmed step (benchmarks/gpu_check.py on an H100). Never
            # a fake or meta one: it would outlive the mode that made it
            _BIT_WEIGHTS[mask.device] = weights
    packed = torch.sum(octets * weights, dim=1, dtype=torch.uint8)
    return packed.bitwise_not_() if inverted else packed


_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _bit_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Row b holds the 8 values (1.0 / 0.0) that byte b unpacks to, lowest bit first."""
    table = _TABLES.get((dtype, device))
    if table is None:
        byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        bits = (byte >> torch.arange(8, dtype=torch.int32)) & 1
        table = _TABLES[(dtype, device)] = bits.to(dtype=dtype, device=device)
    return table


def _constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor of ``value``, kept per (value, dtype, device) where it is a plain tensor."""
    key = (value, dtype, device)
    found = _CONSTANTS.get(key)
    if found is None:
        found = torch.full((), value, dtype=dtype, device=device)
        if type(found) is torch.Tensor:  # never a fake one: it would outlive the mode that made it
            _CONSTANTS[key] = found
    return found


_CONSTANTS: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}


def unpack_bytes(box: Any) -> torch.Tensor:
    """The values of a byte-packed save: one select from its bool mask (in memory order)."""
    mask = box.payload
    if box.scale == -1.0:
        values = torch.where(mask, _constant(0.0, box.dtype, mask.device), _constant(1.0, box.dtype, mask.device))
    else:
        values = torch.where(mask, _constant(box.scale, box.dtype, mask.device), _constant(0.0, box.dtype, mask.device))
    return values.as_strided(box.shape, box.stride)


def unpack_bits(box: Any) -> torch.Tensor:
    # one gather from a 256-row table writes the values directly: the fewest passes over memory
    packed = box.payload
    if packed.dtype == torch.bool:
        return unpack_bytes(box)
    table = _bit_table(box.dtype, packed.device)
    if box.scale != 1.0:
        table = table * box.scale  # exact: 1.0 * scale and 0.0 * scale (scale > 0)
    if numpy is not None and type(packed) is torch.Tensor and packed.device.type == "cpu" \
            and box.dtype in _NUMPY_DTYPES:
        # numpy's take (every index is in range: mode="clip" skips its bounds buffer) is about
        # twice as fast as index_select; the values are allocated by torch
        values = torch.empty((packed.numel() * 8,), dtype=box.dtype)
        numpy.take(table.numpy(), packed.numpy(), axis=0, out=values.numpy().reshape(-1, 8), mode="clip")
    else:
        values = torch.index_select(table, 0, packed.int())
    # the bits were taken in memory order from a dense tensor: the saved strides put every value
    # back in place, and a kernel's choice of memory format (and so of algorithm) cannot change
    return values.as_strided(box.shape, box.stride)


_EMPTIES: dict[Any, torch.Tensor] = {}


def unfilled_strided(box: Any) -> torch.Tensor:
    """An unfilled tensor with the saved tensor's shape and strides (overlapping strides included)."""
    if box.shape.numel() == 0:
        # no element can be read or written: one tensor per layout serves every such save (eval-mode
        # batch norm saves two of them per layer)
        key = (box.shape, box.stride, box.dtype, box.device)
        empty = _EMPTIES.get(key)
        if empty is None:
            empty = torch.empty_strided(box.shape, box.stride, dtype=box.dtype, device=box.device)
            if len(_EMPTIES) < 256:
                _EMPTIES[key] = empty
        return empty
    # Never filled: backward does not read these values (the op knowledge says so, verify=True
    # proves it, and the bit-identity tests would catch a read). Unfilled memory costs no pass over
    # it, and the pages of a large allocation that nobody touches are never even committed. One
    # operation: the storage spans the layout's first element to its last, as a view would need.
    return torch.empty_strided(box.shape, box.stride, dtype=box.dtype, device=box.device)


def shape_stand_in(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` whose every element is the one unfilled element of its storage (all
    strides 0): for a save whose values and layout backward never reads, only its shape."""
    return torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=device)


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive memory slots (dense, no overlap)."""
    if t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)):
        return True
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -d))
    return t.permute(order).is_contiguous()

