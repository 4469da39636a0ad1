"""torch.optim: its fused implementations on meta tensors."""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator

from .features import FEATURES


_OPTIMIZER_MODULE = importlib.import_module("torch.optim.optimizer")


FEATURES["fused optimizers on meta"] = hasattr(_OPTIMIZER_MODULE, "_get_fused_kernels_supported_devices")


@contextlib.contextmanager
def fused_optimizers_on_meta() -> Iterator[None]:
    """While in force, torch.optim's fused implementations (``fused=True``) take meta tensors: their
    kernels have meta versions (Adam, AdamW), and only the optimizers' device check, which reads
    ``_get_fused_kernels_supported_devices``, leaves meta out. A fused optimizer without a meta kernel
    still raises when it steps."""
    if not FEATURES["fused optimizers on meta"]:
        yield
        return
    original = _OPTIMIZER_MODULE._get_fused_kernels_supported_devices
    _OPTIMIZER_MODULE._get_fused_kernels_supported_devices = lambda: [*original(), "meta"]
    try:
        yield
    finally:
        _OPTIMIZER_MODULE._get_fused_kernels_supported_devices = original
