"""Levers gradaudit names but neither applies nor measures, with the bytes each would take off the
step's peak: the optimizer's state in 8 bits or on the CPU, a loss that never holds the whole
logits where the loss dominates the peak, and DDP's gradients kept in its buckets. Each figure is read off the measured step (the state alive
throughout, the storages the loss made alive at the peak) and says what it assumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# bitsandbytes' 8-bit optimizers keep tensors of fewer elements in 32 bits (min_8bit_size=4096)
EIGHT_BIT_SMALLEST = 4096 * 4
# the ops of a cross-entropy loss over logits (log-softmax, the negative log-likelihood) and of its backward
LOSS_OPS = ("_log_softmax", "log_softmax", "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward",
            "nll_loss2d_backward", "_log_softmax_backward_data", "cross_entropy_loss")
LOSS_SHARE = 0.1  # named where the loss's storages are at least this share of the peak
STATE_SHARE = 0.01  # an optimizer-state lever named where it would save at least this share of the peak


@dataclass(frozen=True)
class Lever:
    """A change gradaudit names but does not apply: what it is, the bytes the step would not hold at
    its peak (an estimate, whose basis ``assumes`` states; a change to what is alive throughout takes
    them off every moment, one to the loss off that moment only, and the peak may then fall at
    another), and how a user makes it."""

    name: str
    saves_bytes: int
    assumes: str
    how: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "saves_bytes": self.saves_bytes, "assumes": self.assumes, "how": self.how}


def other_levers(state_sizes: list[int], peak_bytes: int, attribution: dict[str, Any],
                 separate_gradients: int = 0) -> list[Lever]:
    """The levers that would take bytes off this step's peak: ``state_sizes`` the optimizer state's
    storages (bytes, alive throughout the step), ``attribution`` the peak's (``result.attribute``),
    ``separate_gradients`` the gradients at the peak where DistributedDataParallel copies them into its
    buckets (gradient_as_bucket_view=False; else 0)."""
    levers = []
    if separate_gradients >= STATE_SHARE * peak_bytes:
        levers.append(Lever(
            "DDP's gradients as views of its buckets", separate_gradients,
            "the gradients alive at the peak become views of DDP's gradient buckets, which are there anyway "
            "(no copy of them beside the buckets)",
            "DistributedDataParallel(model, gradient_as_bucket_view=True) (the gradients may then not be "
            "detach_()'ed in place)"))
    state = sum(state_sizes)
    if state >= STATE_SHARE * peak_bytes:
        eight = sum(n * 3 // 4 for n in state_sizes if n >= EIGHT_BIT_SMALLEST)
        if eight:
            levers.append(Lever(
                "8-bit optimizer state", eight,
                "each float32 state tensor of 4096 elements or more kept in 8 bits (its block-wise scales "
                "not counted)",
                "bitsandbytes: bnb.optim.AdamW8bit(params) for torch.optim.AdamW"))
        levers.append(Lever(
            "optimizer state offloaded to the CPU", state,
            "the state and the optimizer's step on the CPU (host memory and a copy of each gradient over "
            "PCIe per step)",
            "DeepSpeed ZeRO-Offload (offload_optimizer), or torchao's CPUOffloadOptimizer"))
    loss = attribution.get("loss_bytes", 0)
    if loss >= LOSS_SHARE * peak_bytes:
        levers.append(Lever(
            "a loss that never holds the whole logits", loss,
            "the loss's log-softmax held for backward and backward's gradients of it, alive at the peak, not "
            "made: a fused kernel recomputes them block by block",
            "a fused linear-cross-entropy (Liger Kernel's LigerFusedLinearCrossEntropyLoss, Apple's "
            "cut-cross-entropy), or the loss over chunks of the sequence"))
    return levers
