"""Property: static "not needed" verdicts are always confirmed by the proof, on random networks."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradaudit
from gradaudit.records import NOT_NEEDED


class Clip(torch.autograd.Function):
    """A custom Function in the mix: saves its input and reads it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1)


class ClipModule(nn.Module):
    def forward(self, x):
        return Clip.apply(x)


class Attention(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.qkv = nn.Linear(channels, 3 * channels)

    def forward(self, x):
        b, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(tokens).chunk(3, dim=-1)
        probs = (q @ k.transpose(-2, -1) / c ** 0.5).softmax(-1)
        return (probs @ v).transpose(1, 2).reshape(b, c, h, w)


LAYERS = ["conv", "convt", "bn", "gn", "relu", "gelu", "leaky", "maxpool", "avgpool", "dropout",
          "attention", "clip", "linear"]


def build(kinds, channels=4):
    layers = []
    for kind in kinds:
        layers.append({
            "conv": lambda: nn.Conv2d(channels, channels, 3, padding=1),
            "convt": lambda: nn.ConvTranspose2d(channels, channels, 3, padding=1),
            "bn": lambda: nn.BatchNorm2d(channels),
            "gn": lambda: nn.GroupNorm(2, channels),
            "relu": nn.ReLU,
            "gelu": nn.GELU,
            "leaky": nn.LeakyReLU,
            "maxpool": lambda: nn.MaxPool2d(3, 1, 1),
            "avgpool": lambda: nn.AvgPool2d(3, 1, 1),
            "dropout": lambda: nn.Dropout(0.3),
            "attention": lambda: Attention(channels),
            "clip": ClipModule,
            "linear": lambda: nn.Linear(6, 6),  # acts on the last (width) dimension
        }[kind]())
    layers.append(nn.Conv2d(channels, 2, 1))
    return nn.Sequential(*layers)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(st.sampled_from(LAYERS), min_size=1, max_size=6),
       frozen=st.lists(st.booleans(), min_size=7, max_size=7),
       input_grad=st.booleans(), train=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_static_not_needed_is_always_confirmed(kinds, frozen, input_grad, train, seed):
    torch.manual_seed(seed)
    model = build(kinds).train(train)
    for layer, freeze in zip(model, frozen):
        if freeze:
            layer.requires_grad_(False)
    x = torch.randn(2, 4, 6, 6, requires_grad=input_grad)
    if not input_grad and not any(p.requires_grad for p in model.parameters()):
        model[-1].requires_grad_(True)
    static = gradaudit.audit(model, x)
    proven = gradaudit.audit(model, x, verify=True)
    assert not proven.disagreements, proven.disagreements
    for before, after in zip(static.tensors, proven.tensors):
        assert (before.node, before.attr) == (after.node, after.attr)
        if before.verdict == NOT_NEEDED and after.managed_by == "autograd" and after.storage_kind == "activation":
            assert after.verdict == NOT_NEEDED and after.proven, (after.node, after.attr, after.reason)
    assert static.reclaimable_bytes <= proven.reclaimable_bytes
