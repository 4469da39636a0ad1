"""A custom layer whose ``autograd.Function`` saves more than its backward reads: does the scan find it?

A gated MLP computes ``up(x) * sigmoid(gate(x))`` with a hand-written sigmoid Function that saves
its input and its result, although its backward ``grad * s * (1 - s)`` never reads the input. No rule can know what a hand-written backward reads, so
the static scan lists the saves as undecided (a blind spot); ``--verify`` calls the Function's
backward with the saved input poisoned, sees bit-identical gradients, and reports the input as not
needed.

    gradaudit scan examples/custom_function.py:build --verify
    gradaudit scan examples/custom_function.py:build_fixed --verify     # the lean version: clean
"""

import torch
from torch import nn


class SigmoidSavingInput(torch.autograd.Function):
    """sigmoid(x), saving x although backward reads only the result."""

    @staticmethod
    def forward(ctx, x):
        s = torch.sigmoid(x)
        ctx.save_for_backward(x, s)  # x is never read below: it is held until backward for nothing
        return s

    @staticmethod
    def backward(ctx, grad):
        _x, s = ctx.saved_tensors
        return grad * s * (1 - s)


class Sigmoid(torch.autograd.Function):
    """sigmoid(x), saving only the result its backward reads."""

    @staticmethod
    def forward(ctx, x):
        s = torch.sigmoid(x)
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx, grad):
        (s,) = ctx.saved_tensors
        return grad * s * (1 - s)


class GatedMLP(nn.Module):
    def __init__(self, width: int = 256, lean: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.gate = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.sigmoid = Sigmoid if lean else SigmoidSavingInput

    def forward(self, x):
        return self.down(self.up(x) * self.sigmoid.apply(self.gate(x)))


def _build(lean: bool):
    torch.manual_seed(0)
    model = nn.Sequential(GatedMLP(lean=lean), nn.LayerNorm(256), GatedMLP(lean=lean))
    return model, torch.randn(32, 256)


def build():
    return _build(lean=False)


def build_fixed():
    return _build(lean=True)
