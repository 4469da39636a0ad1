"""An audit leaves the model exactly as it found it - also when the forward raises."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradaudit
from gradaudit.errors import ForwardError


def snapshot(model):
    """Everything an audit could disturb, as comparable values."""
    return {
        "params": {n: (p, p.detach().clone(), p.requires_grad, p.grad, None if p.grad is None else p.grad.clone())
                   for n, p in model.named_parameters()},
        "buffers": {n: (b, b.clone()) for n, b in model.named_buffers()},
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
        "hooks": [(dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks),
                   dict(m._backward_pre_hooks)) for m in model.modules()],
    }


def assert_same(before, after):
    assert before["params"].keys() == after["params"].keys()
    for name, (p, value, flag, grad, grad_value) in before["params"].items():
        p2, value2, flag2, grad2, grad_value2 = after["params"][name]
        assert p2 is p and torch.equal(value2, value) and flag2 == flag and grad2 is grad, name
        if grad is not None:
            assert torch.equal(grad_value2, grad_value), name
    assert before["buffers"].keys() == after["buffers"].keys()
    for name, (b, value) in before["buffers"].items():
        b2, value2 = after["buffers"][name]
        assert b2 is b and torch.equal(value2, value), name
    assert after["training"] == before["training"]
    assert torch.equal(after["rng"], before["rng"])
    assert after["hooks"] == before["hooks"]


class Net(nn.Module):
    def __init__(self, width=6, fail=False):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(width, 2)
        self.fail = fail

    def forward(self, x):
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        if self.fail:
            raise ValueError("broken forward")
        return self.head(h.mean((2, 3)))


def _prepared(model):
    # some state to keep: a .grad, a user hook, a frozen parameter
    model.head.weight.grad = torch.ones_like(model.head.weight)
    model.conv.register_forward_hook(lambda m, a, o: None)
    model.bn.register_forward_pre_hook(lambda m, a: None)
    model.conv.bias.requires_grad_(False)
    return model


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batch_norm_statistics_and_everything_else_survive(mode):
    torch.manual_seed(0)
    model = getattr(_prepared(Net()), mode)()
    torch.randn(3)  # move the RNG off its seed
    x = torch.randn(2, 3, 8, 8)
    before = snapshot(model)
    report = gradaudit.audit(model, x, trainable=["head.*", "bn.*"])
    assert report.saved_bytes > 0
    assert_same(before, snapshot(model))
    # the forward did update the statistics (and draw dropout masks) in train mode: they were put back
    if mode == "train":
        model(torch.randn(2, 3, 8, 8))
        assert not torch.equal(model.bn.running_mean, before["buffers"]["bn.running_mean"][1])


def test_a_raising_forward_leaves_no_trace():
    torch.manual_seed(0)
    model = _prepared(Net(fail=True)).train()
    x = torch.randn(2, 3, 8, 8)
    before = snapshot(model)
    with pytest.raises(ForwardError, match="broken forward"):
        gradaudit.audit(model, x, trainable=["conv.*"])
    assert_same(before, snapshot(model))
    # and no hook of gradaudit's is left behind: saved-tensor hooks and node hooks are popped
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    assert isinstance(y.grad_fn._raw_saved_result.data, torch.Tensor)


def test_audit_restores_after_a_model_that_reassigns_its_own_attributes():
    class Swapper(Net):
        def forward(self, x):
            self.bn = nn.BatchNorm2d(self.bn.num_features)  # a model that replaces a submodule
            self.training = not self.training
            return super().forward(x)

    torch.manual_seed(0)
    model = _prepared(Swapper()).train()
    bn = model.bn
    x = torch.randn(2, 3, 8, 8)
    before = snapshot(model)
    gradaudit.audit(model, x)
    assert model.bn is bn
    assert_same(before, snapshot(model))


# -- property: random small models, random freezing patterns ------------------------------------

LAYERS = {
    "conv": lambda c: nn.Conv2d(c, c, 3, padding=1),
    "bn": lambda c: nn.BatchNorm2d(c),
    "relu": lambda c: nn.ReLU(),
    "relu_": lambda c: nn.ReLU(inplace=True),
    "pool": lambda c: nn.MaxPool2d(3, stride=1, padding=1),
    "drop": lambda c: nn.Dropout(0.3),
    "gelu": lambda c: nn.GELU(),
}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(sorted(LAYERS)), min_size=1, max_size=6),
    frozen=st.lists(st.booleans(), min_size=6, max_size=6),
    train=st.booleans(),
    input_grad=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_models_leave_no_trace(kinds, frozen, train, input_grad, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), *[LAYERS[k](4) for k in kinds]).train(train)
    for layer, freeze in zip(model, frozen):
        layer.requires_grad_(not freeze)
    x = torch.randn(2, 3, 6, 6, requires_grad=input_grad)
    before = snapshot(model)
    try:
        report = gradaudit.audit(model, x)
    except gradaudit.NothingRequiresGradError:
        report = None
    assert_same(before, snapshot(model))
    if report is not None:
        assert 0 <= report.reclaimable_bytes <= report.reclaimable_with_bitpacking_bytes <= report.saved_bytes
