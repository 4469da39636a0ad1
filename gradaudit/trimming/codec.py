"""The bit codec of ``trim``: one bit per element for saves backward reads as a sign or a mask,
and the unfilled stand-ins for saves it does not read.

A packer takes the saved values (in memory order) and returns (packed bits, value a set bit
stands for; 0 elsewhere), or None when the values do not fit that form; -1.0 for that value marks
bits whose set bit stands for 0.0 and clear bit for 1.0 (an unpacking table's choice, so that packing
needs no pass to flip them). Each is written so the
unpacked tensor gives the backward the same results:
  threshold_backward(grad, x, 0): x <= 0 ? 0 : grad   (ReLU result, Threshold with threshold 0)
  leaky_relu_backward(grad, x, slope): x > 0 ? grad : grad * slope
so the bit is that comparison itself (NaN, -0.0 included) and the unpacked value 1.0 or 0.0;
  dropout (a multiplication by a mask of 0 and 1/(1-p)): grad * mask
so the mask must be reproduced exactly: checked to hold only +0.0 and one positive value.
Which packer a save gets comes from the op knowledge (``Read.bit``; a MASK read: ``scaled_mask``; a bool
keep-mask, a BOOL read: its own values as bits, unpacked to bools).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch

from ..knowledge import Bit
from . import fused

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


def _compare_and_pack(values: torch.Tensor, compare: Any) -> torch.Tensor:
    """Bits of ``compare(values, 0)``, chunk by chunk."""
    count = values.numel()
    packed = torch.empty(((count + 7) // 8,), dtype=torch.uint8)
    scratch = torch.empty((min(count, _CHUNK),), dtype=torch.bool)
    source, out, mask = values.numpy(), packed.numpy(), scratch.numpy()
    for start in range(0, count, _CHUNK):
        stop = min(count, start + _CHUNK)
        chunk = mask[:stop - start]
        compare(source[start:stop], 0, out=chunk)
        out[start // 8:(stop + 7) // 8] = numpy.packbits(chunk, bitorder="little")
    return packed


def _passes_unless_le_zero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    # the gradient passes unless x <= 0 (NaN passes, as in threshold_backward): the bit is x <= 0
    # and unpacks to 0.0 where set, 1.0 elsewhere (scale -1.0), so no pass flips it
    if _numpy_ok(values):
        return _compare_and_pack(values, numpy.less_equal), -1.0
    return pack_bits(values <= 0, scratch=True), -1.0


def _passes_if_gt_zero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    if _numpy_ok(values):
        return _compare_and_pack(values, numpy.greater), 1.0
    return pack_bits(values > 0, scratch=True), 1.0


def _passes_if_nonzero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    # a save never negative (relu's result, Bit.NE_ZERO): the gradient passes where x != 0, NaN
    # included; the conversion to bool is that comparison in one operation on every device (and on
    # meta one of its C++ kernels, where a comparison with a scalar runs torch's Python reference)
    if _numpy_ok(values):
        return _compare_and_pack(values, numpy.not_equal), 1.0
    return pack_bits(values.bool(), scratch=True), 1.0


def _bool_bits(values: torch.Tensor) -> Optional[tuple[torch.Tensor, float]]:
    # a bool keep-mask (native_dropout's result1): its own values as bits, read back as bools; no
    # look at the values (a bool holds one of two by its dtype)
    if values.dtype != torch.bool:
        return None
    return pack_bits(values), 1.0


def _bool_kept(values: torch.Tensor) -> None:
    return None  # masks="bytes": a bool mask is one byte per element already


def _mask_scale(values: torch.Tensor) -> Optional[float]:
    """The one positive value of a mask holding only it and +0.0, or None (read from the device)."""
    if values.numel() == 0 or values.device.type == "meta":
        return None  # no values to check: kept
    scale = values.max()
    exact = torch.logical_or(values == scale, values == 0).all() & ~torch.signbit(values).any() & (scale > 0)
    # both answers in one read back to the host (on a GPU one copy, one synchronisation; each bool()
    # and .item() was one), exact: a float64 holds every float16, bfloat16 and float32 value
    found, ok = torch.stack([scale.double(), exact.double()]).cpu().tolist()
    return found if ok else None


def _scaled_mask(values: torch.Tensor) -> Optional[tuple[torch.Tensor, float]]:
    scale = _mask_scale(values)
    return None if scale is None else (pack_bits(values != 0, scratch=True), scale)


def dropout_mask(values: torch.Tensor, scale: float, fused_kernels: bool = False) -> torch.Tensor:
    """The bits of the keep-mask of a stock ``torch.nn`` dropout module on the CPU, with no look at its
    values from the host: ``bernoulli_(1 - p)`` divided by ``1 - p`` holds +0.0 and one positive value
    by construction (ATen's ``Dropout.cpp``), which for a given ``p`` and dtype is ``scale``, read off
    the same module's mask in the forward trim decided fully. Only the steady plan uses it, for a
    node it found made inside such a module with that ``p`` (``steady.Entry``); ``fused_kernels``:
    in one Triton kernel where ``fused`` takes the values."""
    if fused_kernels and fused.takes(values):
        return fused.pack(values, fused.NE_ZERO)
    return pack_bits(values != 0, scratch=True)


def _byte_unless_le_zero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    # the byte is x <= 0 (NaN: False, so it passes, as in threshold_backward); unpacked to 0.0 where
    # set and 1.0 elsewhere. On the CPU its complement, negated in place (no second mask), so that
    # unpacking is one conversion (unpack_bytes)
    if values.device.type == "cpu" and type(values) is torch.Tensor:
        return (values <= 0).logical_not_(), 1.0
    return values <= 0, -1.0


def _byte_if_nonzero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    # x != 0 as one conversion to bool, unpacked by one conversion back (unpack_bytes, scale 1.0)
    return values.bool(), 1.0


def _byte_if_gt_zero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    return values > 0, 1.0


def _byte_scaled_mask(values: torch.Tensor) -> Optional[tuple[torch.Tensor, float]]:
    scale = _mask_scale(values)
    return None if scale is None else (values != 0, scale)


Packer = Callable[[torch.Tensor], Optional[tuple[torch.Tensor, float]]]
PACKERS: dict[Bit, Packer] = {
    Bit.NOT_LE_ZERO: _passes_unless_le_zero,
    Bit.GT_ZERO: _passes_if_gt_zero,
    Bit.NE_ZERO: _passes_if_nonzero,
    Bit.BOOL: _bool_bits,
}
scaled_mask: Packer = _scaled_mask

# masks="bytes": one bool per element instead of one bit, each packer's counterpart. One operation to
# make (the comparison) and one to unpack (a select), where bits take several of each (on a GPU,
# each is a kernel launch); frees 75% of a float32 save instead of ~97%. A byte packer's scale:
# the value a True stands for (False: 0.0), or -1.0 for a mask whose True stands for 0.0 and False 1.0
BYTES: dict[Packer, Packer] = {
    _passes_unless_le_zero: _byte_unless_le_zero,
    _passes_if_gt_zero: _byte_if_gt_zero,
    _passes_if_nonzero: _byte_if_nonzero,
    _scaled_mask: _byte_scaled_mask,
    _bool_bits: _bool_kept,
}
MASK_FORMATS = ("auto", "bits", "bytes")


def mask_form(masks: str, device_type: str, kernels: str = "torch") -> str:
    """What the ``masks`` option makes of a save needed only as a sign or a two-valued mask on a device
    of ``device_type``: "bits" or "bytes". "auto" chooses by what each costs there: on the CPU (and
    meta, where no kernel runs) bits, whose packing is one numpy loop each way beside kernels that
    take far longer; on a GPU bytes, one kernel each way where bits take four or five (H200, ResNet-50
    with its weights frozen: 1.35-1.51x a plain step with bytes, 1.70-1.88x with bits,
    docs/benchmarks.md), unless ``kernels="triton"`` packs bits in one fused kernel each way."""
    if masks != "auto":
        return masks
    if kernels == "triton" or device_type in ("cpu", "meta"):
        return "bits"
    return "bytes"


def _fused_passes_unless_le_zero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    if fused.takes(values):
        return fused.pack(values, fused.LE_ZERO), -1.0
    return _passes_unless_le_zero(values)


def _fused_passes_if_gt_zero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    if fused.takes(values):
        return fused.pack(values, fused.GT_ZERO), 1.0
    return _passes_if_gt_zero(values)


def _fused_passes_if_nonzero(values: torch.Tensor) -> tuple[torch.Tensor, float]:
    if fused.takes(values):
        return fused.pack(values, fused.NE_ZERO), 1.0
    return _passes_if_nonzero(values)


def _fused_scaled_mask(values: torch.Tensor) -> Optional[tuple[torch.Tensor, float]]:
    if not fused.takes(values):
        return _scaled_mask(values)
    scale = _mask_scale(values)
    return None if scale is None else (fused.pack(values, fused.NE_ZERO), scale)


# kernels="triton": each bit packer's counterpart packing in one fused kernel where ``fused`` takes the
# values (the same bytes; elsewhere the packer itself runs)
FUSED: dict[Packer, Packer] = {
    _passes_unless_le_zero: _fused_passes_unless_le_zero,
    _passes_if_gt_zero: _fused_passes_if_gt_zero,
    _passes_if_nonzero: _fused_passes_if_nonzero,
    _scaled_mask: _fused_scaled_mask,
    _bool_bits: _bool_bits,  # (no fused kernel for bools: two elementwise ones each way)
}
KERNELS = ("torch", "triton")


def pack_bits(mask: torch.Tensor, scratch: bool = False) -> torch.Tensor:
    """1-D bool -> uint8: bit i of byte k is element 8k+i (the padding bits of a partial last byte
    are 0 and never read: unpacking keeps the first ``numel`` values). ``scratch``: the mask is the
    caller's own temporary (a comparison's result), which packing may overwrite; never a save itself.

    The packed bytes are allocated by torch, so storage trackers see them.
    """
    count = mask.numel()
    if mask.device.type != "cpu" or numpy is None:
        return _pack_bits_with_torch(mask, scratch)
    # numpy's packbits is one C loop; the torch expression takes several passes
    packed = torch.empty(((count + 7) // 8,), dtype=torch.uint8, device=mask.device)
    packed.numpy()[:] = numpy.packbits(mask.numpy(), bitorder="little")
    return packed


def _pack_bits_with_torch(mask: torch.Tensor, scratch: bool = False) -> torch.Tensor:
    """``pack_bits`` in torch operations (a GPU, meta): each is a dispatch, and on a GPU a kernel
    launch, so as few as the layout allows (a count that is a multiple of 8 needs no padded copy),
    and each elementwise: a sum over rows of 8 bytes ran as a reduction that took a GPU ~40 us per
    ResNet-50 activation (an H200, benchmarks/gpu_check.py).

    Each 8 bools, read as one little-endian 64-bit word (byte k is element k, 0 or 1), times
    ``_GATHER`` has bit k of element k at bit 56 + k, and no other product lands on bits 56-63 or
    carries into them (element j's copies land at bits 8j + 56 - 7i, all distinct): the word's top
    byte is the packed byte, read through a strided view and copied out. The multiplication keeps
    the low 64 bits of the product, as every torch backend's integer multiplication does; it runs in
    place on a mask that is ``scratch`` or a padded copy (one allocation fewer; and on meta a C++
    kernel, where the out-of-place one runs torch's Python reference, ~50-90 us)."""
    count = mask.numel()
    if count % 8 == 0 and mask.is_contiguous() and mask.storage_offset() % 8 == 0:
        octets, own = mask, scratch
    else:
        octets = torch.zeros((((count + 7) // 8) * 8,), dtype=torch.uint8, device=mask.device)
        octets[:count] = mask.view(torch.uint8)
        own = True
    if not _LITTLE_ENDIAN:
        weights = _bit_weights(mask.device)
        return torch.sum(octets.view(torch.uint8).view(-1, 8) * weights, dim=1, dtype=torch.uint8)
    # (each view is a dispatch too, a few microseconds of host time: as few as the layout allows)
    words = octets.view(torch.int64)
    words = words.mul_(_GATHER) if own else torch.mul(words, _GATHER)
    return words.view(torch.uint8)[7::8].contiguous()


# sum of 2**(56 - 7k), k = 0..7: gathers the low bit of each byte of a word into its top byte
_GATHER = 0x0102040810204080
_LITTLE_ENDIAN = sys.byteorder == "little"


def _bit_weights(device: torch.device) -> torch.Tensor:
    """The 8 bit weights 1, 2, ..., 128 as uint8 on ``device``, kept per GPU: a tensor built from a
    Python list there is a blocking copy from the host, which per save stalled every trimmed step
    (benchmarks/gpu_check.py on an H100). Never a fake or meta one: it would outlive the mode that
    made it."""
    weights = _BIT_WEIGHTS.get(device)
    if weights is None:
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)
        if type(weights) is torch.Tensor and weights.device.type == "cuda":
            _BIT_WEIGHTS[device] = weights
    return weights


_TABLES: dict[tuple[float, torch.dtype, torch.device], torch.Tensor] = {}
_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    """0, 1, ..., 7 as uint8 on ``device``, kept per GPU as ``_bit_weights`` is."""
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = torch.arange(8, dtype=torch.uint8, device=device)
        if type(shifts) is torch.Tensor and shifts.device.type == "cuda":
            _SHIFTS[device] = shifts
    return shifts


def _bit_table(scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Row b holds the 8 values that byte b unpacks to, lowest bit first: ``scale`` where a bit is
    set and 0.0 where clear, or for ``scale`` -1.0, 0.0 where set and 1.0 where clear. Kept per
    (scale, dtype, device), so that unpacking is the same two operations for every save; never a
    fake tensor (it would outlive the mode that made it)."""
    key = (scale, dtype, device)
    table = _TABLES.get(key)
    if table is None:
        byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        bits = (byte >> torch.arange(8, dtype=torch.int32)) & 1
        if scale == -1.0:
            table = (1 - bits).to(dtype=dtype, device=device)
        else:
            # exact: 1.0 * scale and 0.0 * scale (scale > 0), as the mask's own values
            table = bits.to(dtype=dtype, device=device) * scale
        if type(table) is torch.Tensor and len(_TABLES) < 256:
            _TABLES[key] = table
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
    """The values of a byte-packed save from its bool mask (in memory order, or in the save's own
    layout: then the values come in it too, and need no view): a mask whose True stands for 1.0 (a
    ReLU result's, x != 0) by one conversion of the bools on every device; others by one select on a
    GPU and meta, and on the CPU by a conversion (a scaled mask multiplied in place), since the CPU's
    select between two 0-dim tensors runs ~9x slower than a conversion (2 x 256 x 16 x 16: 383 us
    against 47; 32 x 64 x 56 x 56: 20.5 ms against 2.3, one thread). Either way the values are the
    only tensor it makes, and the same: 0.0 and 1.0, or +0.0 and ``scale`` (1.0 * scale and 0.0 *
    scale are exact, ``scale`` > 0; 1 - 1.0 is +0.0)."""
    mask = box.payload
    if box.scale == 1.0:
        # True stands for 1.0 and False for 0.0: one conversion on every device (a GPU's is one
        # kernel as the select is; on meta a C++ kernel where the select runs torch's Python one)
        values = mask.to(box.dtype)
    elif mask.device.type == "cpu" and type(mask) is torch.Tensor:
        values = mask.to(box.dtype)
        if box.scale == -1.0:
            values.neg_().add_(1)
        else:
            values.mul_(box.scale)
    elif box.scale == -1.0:
        values = torch.where(mask, _constant(0.0, box.dtype, mask.device), _constant(1.0, box.dtype, mask.device))
    else:
        values = torch.where(mask, _constant(box.scale, box.dtype, mask.device), _constant(0.0, box.dtype, mask.device))
    if values.shape == box.shape and values.stride() == box.stride:
        return values
    return values.as_strided(box.shape, box.stride)


def unpack_bits(box: Any, fused_kernels: bool = False) -> torch.Tensor:
    """The values of a bit- or byte-packed save (``fused_kernels``: bits unpacked in one Triton kernel
    where ``fused`` takes them)."""
    # one gather from a 256-row table writes the values directly: the fewest passes over memory
    packed = box.payload
    if packed.dtype == torch.bool:
        return unpack_bytes(box)
    if fused_kernels and box.dtype in fused.DTYPES and fused.usable(packed):
        return fused.unpack(packed, box.shape.numel(), box.scale, box.dtype).as_strided(box.shape, box.stride)
    if numpy is not None and type(packed) is torch.Tensor and packed.device.type == "cpu" \
            and box.dtype in _NUMPY_DTYPES:
        table = _bit_table(box.scale, box.dtype, packed.device)
        # numpy's take (every index is in range: mode="clip" skips its bounds buffer) is about
        # twice as fast as index_select; the values are allocated by torch
        values = torch.empty((packed.numel() * 8,), dtype=box.dtype)
        numpy.take(table.numpy(), packed.numpy(), axis=0, out=values.numpy().reshape(-1, 8), mode="clip")
    else:
        values = _unpack_with_torch(box)
    # the bits were taken in memory order from a dense tensor: the saved strides put every value
    # back in place, and a kernel's choice of memory format (and so of algorithm) cannot change
    return values.as_strided(box.shape, box.stride)


def _unpack_with_torch(box: Any) -> torch.Tensor:
    """The values of bits in torch operations (a GPU, meta), each elementwise: each byte shifted
    right by 0..7, the lowest bit kept (0 or 1), then converted as they are where a set bit stands
    for 1.0 (a ReLU's x != 0), else read as bools with no pass and a select between the two values
    made. A gather of rows from a 256-row table was one operation fewer, but on a GPU it ran
    at a tenth of the memory's speed: on an H200, 1,960 us for a 32x64x112x112 float32 activation
    where these three take 148 us (a mask, a conversion to bools and a select: 182 us;
    benchmarks/gpu_check.py --sections codec)."""
    packed = box.payload
    bits = torch.bitwise_and(torch.bitwise_right_shift(packed.view(-1, 1), _shifts(packed.device)), 1)
    if box.scale == 1.0 and box.dtype != torch.bool:
        # 1.0 where set, 0.0 where clear: the 0s and 1s converted as they are (no view as bools)
        return bits.to(box.dtype)
    bits = bits.view(torch.bool)
    if box.dtype == torch.bool:
        return bits  # a bool mask's values are the bits themselves
    if box.scale == -1.0:
        set_value, clear_value = 0.0, 1.0
    else:
        set_value, clear_value = box.scale, 0.0
    return torch.where(bits, _constant(set_value, box.dtype, packed.device),
                       _constant(clear_value, box.dtype, packed.device))


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


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive memory slots (dense, no overlap)."""
    if t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)):
        return True
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -d))
    return t.permute(order).is_contiguous()

