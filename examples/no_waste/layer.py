"""A custom layer a library might ship: squared ReLU (Primer, So et al. 2021) as an autograd.Function.

``SquaredReLU`` saves only relu(x), which is all its backward reads. ``SquaredReLUSavingInput`` is the
same layer after a plausible regression: it also saves its input x "in case backward needs it", which
doubles what the layer holds between forward and backward (x is the output of the Linear before it,
kept alive by nothing else). check_layer.py catches it.
"""

import torch
from torch import nn


class SquaredReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        r = torch.relu(x)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    def backward(ctx, grad):
        (r,) = ctx.saved_tensors
        return grad * 2 * r


class SquaredReLUSavingInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        r = torch.relu(x)
        ctx.save_for_backward(x, r)  # the regression: backward never reads x
        return r * r

    @staticmethod
    def backward(ctx, grad):
        _x, r = ctx.saved_tensors
        return grad * 2 * r


class FeedForward(nn.Module):
    """Linear -> squared ReLU -> Linear, the block the activation is used in."""

    def __init__(self, width: int = 64, activation=SquaredReLU) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.activation = activation

    def forward(self, x):
        return self.down(self.activation.apply(self.up(x)))
