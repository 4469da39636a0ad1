"""What a CUDA step's peak holds besides its tensors: the cuBLAS and cuBLASLt workspaces, which come
from PyTorch's caching allocator (so ``torch.cuda.max_memory_allocated`` counts them) and stay cached
for the life of the process once a thread has run a matrix product.

Measured on an H100 and an H200 with torch 2.11.0+cu130 (shared/notes/gpu-facts.md): a step's
allocated peak was the sum of its storages plus exactly 65 MiB, 32 MiB of cuBLAS workspace for the
thread that ran the forward, 32 MiB for autograd's device thread, which runs backward, and 1 MiB of
cuBLASLt workspace. Sizes as torch chooses them (c10/cuda's cuBLAS handle pool,
``getChosenWorkspaceSize``): ``CUBLAS_WORKSPACE_CONFIG`` when set (``:SIZE_KiB:COUNT`` pairs, summed),
else ``:4096:8`` (32 MiB) on sm90 and newer and ``:4096:2:16:8`` (8 MiB + 128 KiB) before; cuBLASLt's
``TORCH_CUBLASLT_WORKSPACE_SIZE`` KiB, else 1024.

Not modelled (the fit's notes say so, where the step runs convolutions, with what an H100 measured):
cuDNN's convolution workspaces, allocated per call through the same allocator and freed after it,
whose size cuDNN's heuristics pick (H100, torch 2.11, benchmarks/gpu_check.py: up to 163 MB in one
call on ResNet-50 at 32x224; the measured step peak 0.3%, 1% and 7.7% above the fit's on ResNet-50,
ViT-B/16 and ResNet-18); a release that allocates cuBLAS's workspace per operation instead of caching
it (torch 2.15's ``TORCH_CUBLAS_WORKSPACE_CACHE``) was not measured.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

KIB, MIB = 1 << 10, 1 << 20

_ATEN = torch.ops.aten
# ops whose CUDA kernels call cuBLAS (matrix products and the BLAS-2/1 calls torch routes there)
GEMMS = frozenset(getattr(_ATEN, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_addmm_activation", "_scaled_mm")
    if hasattr(_ATEN, name))
# addmm of a 1-D bias (nn.Linear with bias): CUDA's addmm runs it through cuBLASLt with a bias epilogue
_BIAS_EPILOGUE = frozenset(getattr(_ATEN, name) for name in ("addmm", "_addmm_activation") if hasattr(_ATEN, name))


def is_gemm(packet: Any) -> bool:
    return packet in GEMMS


def uses_cublaslt(packet: Any, args: tuple) -> bool:
    """Whether this matrix product takes cuBLASLt's bias epilogue (its workspace): addmm of a 1-D bias."""
    return packet in _BIAS_EPILOGUE and bool(args) and isinstance(args[0], torch.Tensor) and args[0].dim() == 1


# ops whose CUDA kernels take a cuDNN convolution workspace (allocated and freed within the call)
CONVOLUTIONS = frozenset(getattr(_ATEN, name) for name in (
    "convolution", "convolution_backward", "_convolution", "cudnn_convolution", "cudnn_convolution_transpose")
    if hasattr(_ATEN, name))


def is_convolution(packet: Any) -> bool:
    return packet in CONVOLUTIONS


@dataclass
class GemmCount:
    """Matrix products an op stream ran: all of them, and those through cuBLASLt; and its convolutions."""

    cublas: int = 0
    cublaslt: int = 0
    convolutions: int = 0

    def count(self, packet: Any, args: tuple) -> None:
        """Count one op (``Lifetimes``' observer): its overload packet and arguments."""
        if is_gemm(packet):
            self.cublas += 1
            self.cublaslt += uses_cublaslt(packet, args)
        elif is_convolution(packet):
            self.convolutions += 1

    def minus(self, other: "GemmCount") -> "GemmCount":
        return GemmCount(self.cublas - other.cublas, self.cublaslt - other.cublaslt,
                         self.convolutions - other.convolutions)


def cublas_workspace_bytes(capability: tuple[int, int], environ: Optional[Mapping[str, str]] = None) -> int:
    """One cuBLAS handle's workspace on a GPU of ``capability``, as torch sizes it."""
    environ = os.environ if environ is None else environ
    config = environ.get("CUBLAS_WORKSPACE_CONFIG", "").strip()
    pairs = re.findall(r":(\d+):(\d+)", config)
    if config and pairs:
        return sum(int(size) * KIB * int(count) for size, count in pairs)
    return 4096 * KIB * 8 if capability >= (9, 0) else 4096 * KIB * 2 + 16 * KIB * 8


def cublaslt_workspace_bytes(environ: Optional[Mapping[str, str]] = None) -> int:
    environ = os.environ if environ is None else environ
    value = environ.get("TORCH_CUBLASLT_WORKSPACE_SIZE", "").strip()
    return int(value) * KIB if value.isdigit() else 1024 * KIB


def workspaces(forward: GemmCount, backward: GemmCount, capability: tuple[int, int],
               environ: Optional[Mapping[str, str]] = None) -> tuple[list[int], Optional[str]]:
    """The workspaces a steady-state step on a GPU of ``capability`` holds (cached since the first
    step, so alive throughout): one cuBLAS workspace per thread that runs a matrix product (the
    forward's, autograd's device thread for backward) and cuBLASLt's where a bias epilogue runs.
    Returns their sizes and a note saying what they are (None when there are none)."""
    sizes, parts = [], []
    cublas = cublas_workspace_bytes(capability, environ)
    for phase, count in (("the forward's thread", forward), ("autograd's device thread (backward)", backward)):
        if count.cublas:
            sizes.append(cublas)
            parts.append(f"cuBLAS {_mib(cublas)} for {phase}")
    if forward.cublaslt or backward.cublaslt:
        sizes.append(cublaslt_workspace_bytes(environ))
        parts.append(f"cuBLASLt {_mib(sizes[-1])}")
    notes = []
    if sizes:
        notes.append(f"workspaces: {', '.join(parts)}, cached by PyTorch's allocator from the first step on and "
                     f"counted by max_memory_allocated (torch 2.11 on an H100: exactly these)")
    convolutions = forward.convolutions + backward.convolutions
    if convolutions:
        notes.append(f"not counted: cuDNN's convolution workspaces, allocated and freed within each of the step's "
                     f"{convolutions} convolution calls and sized by cuDNN's heuristics, which max_memory_allocated "
                     f"counts: on an H100 (torch 2.11, cuDNN 9.19) one call took up to 163 MB (ResNet-50, 32x224) "
                     f"and the measured peak was 0.3% (ResNet-50), 1% (ViT-B/16) and 7.7% (ResNet-18) above the "
                     f"figure; leave that beside it (headroom=)")
    return sizes, "; ".join(notes) or None


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:g} MiB"
