"""An audit leaves no trace in memory either: once the report is returned, nothing of the graph it
recorded (activations, saved tensors, gradaudit's boxes) is alive. The same for a trimmed forward
whose graph is dropped without a backward.

What would leak: a pack hook that stores the tensor it is given. When a node saves its own output
(ReLU, tanh, exp results), that tensor's grad_fn is the node itself, so tensor -> grad_fn -> saved
slot -> box -> tensor is a cycle through C++ that Python's collector cannot see. Every audit then
kept its whole graph, and a branch computed but never used stayed alive and was reported as held.

Memory is judged by storage (a weak reference to every storage an op produced during the audit,
``gradaudit.measure.StorageTracker``), not by tensor objects: an alias of a tensor (what the boxes
keep) holds its storage without holding the tensor object a forward hook sees.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import gradaudit
from gradaudit.errors import ForwardError
from gradaudit.measure import StorageTracker, held_bytes_after_forward
from gradaudit.recorder import Packed
from gradaudit.tensors import storage_key
from gradaudit.trimming import trim
from gradaudit.trimming.session import Box


class Square(torch.autograd.Function):
    """A custom Function that saves its own output, as ``save_for_backward(y)``."""

    @staticmethod
    def forward(ctx, x):
        y = x * x
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return 2 * x * grad + 0 * y


class Saver(nn.Module):
    """Every way a node saves its own output, plus a branch computed and never used."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)  # in place: saves its own result
        self.head = nn.Linear(4, 3)
        self.fail = fail

    def forward(self, x):
        h = self.relu(self.bn(self.conv(x)))
        unused = torch.exp(h)  # noqa: F841  (dropped: freed with the forward, never held)
        a = torch.tanh(h)  # saves its result
        a = a.clone()
        a[:, :2].mul_(torch.sigmoid(a[:, 2:]))  # in place on a view: a CopySlices node
        a = Square.apply(a)
        if self.fail:
            raise ValueError("broken forward")
        return self.head(a.mean((2, 3)))


def _alive_anyway(model: nn.Module, inputs: list[torch.Tensor]) -> set[int]:
    return {storage_key(t) for t in [*model.parameters(), *model.buffers(), *inputs]}


def _boxes() -> int:
    """gradaudit's boxes (the recorder's and trim's) still alive."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Packed or type(o) is Box)


def _assert_nothing_left(tracker: StorageTracker, model: nn.Module, inputs: list[torch.Tensor],
                         boxes_before: int) -> None:
    gc.collect()
    exclude = _alive_anyway(model, inputs)
    assert tracker.storages, "no op ran under the tracker: the test would prove nothing"
    assert tracker.live_bytes(exclude) == 0
    assert _boxes() == boxes_before  # (another test's graph may still be alive: compare, not == 0)


def test_fact_a_pack_hook_must_not_keep_its_tensor():
    """The torch behaviour the boxes rely on: keeping ``t`` closes the cycle, keeping ``t.detach()``
    does not, and backward (double backward too) is bitwise the same: unpacked data is attached
    to the node it was saved for whatever grad_fn the unpacked tensor has."""

    def run(keep):
        boxes = []

        def pack(t):
            boxes.append([keep(t)])
            return boxes[-1]

        x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box[0]):
            y = torch.tanh(x).exp()  # both save their own result
            dropped = torch.tanh(x)
        ref = weakref.ref(dropped)
        del dropped
        gc.collect()
        alive = ref() is not None
        (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.square().sum(), x)
        for box in boxes:
            box.clear()  # breaks the cycles by hand: the test itself leaks nothing
        return gx.detach(), ggx, alive

    torch.manual_seed(0)
    kept = run(lambda t: t)
    torch.manual_seed(0)
    detached = run(lambda t: t.detach())
    assert kept[2] and not detached[2]  # the tensor itself kept: the dropped result never dies
    assert torch.equal(kept[0], detached[0]) and torch.equal(kept[1], detached[1])


@pytest.mark.parametrize("verify", [False, True])
def test_audits_leave_nothing_of_the_graph_alive(verify):
    torch.manual_seed(0)
    model = Saver().train()
    x = torch.randn(2, 3, 8, 8)
    boxes = _boxes()
    tracker = StorageTracker()
    with tracker:
        for _ in range(3):
            report = gradaudit.audit(model, x, verify=verify)
            assert report.saved_bytes > 0
            del report
    _assert_nothing_left(tracker, model, [x], boxes)


def test_resnet_audits_leave_nothing_alive(vision_model):
    model = vision_model("resnet18").train()
    x = torch.randn(2, 3, 32, 32)
    boxes = _boxes()
    tracker = StorageTracker()
    with tracker:
        for _ in range(3):
            gradaudit.audit(model, x)
    _assert_nothing_left(tracker, model, [x], boxes)


def test_a_raising_forward_leaves_nothing_alive():
    torch.manual_seed(0)
    model = Saver(fail=True).train()
    x = torch.randn(2, 3, 8, 8)
    boxes = _boxes()
    tracker = StorageTracker()
    with tracker:
        with pytest.raises(ForwardError, match="broken forward") as caught:
            gradaudit.audit(model, x)
    del caught  # its traceback holds the forward's frames, and their tensors, until here
    _assert_nothing_left(tracker, model, [x], boxes)


def test_a_dropped_branch_is_not_held():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            h = self.lin(x)
            unused = torch.exp(h)  # noqa: F841
            return torch.tanh(h)

    torch.manual_seed(0)
    model, x = M(), torch.randn(32, 64)
    report = gradaudit.audit(model, x)
    # tanh's result: 32*64*4 = 8192 (the Linear saves the caller's x, alive anyway); exp's result
    # dies with the forward
    assert held_bytes_after_forward(model, x) == 8192
    assert report.saved_bytes == 8192
    assert not [t for t in report.tensors if t.attr.startswith("hidden")]


@pytest.mark.parametrize("bitpack", [True, False])
def test_a_trimmed_forward_dropped_without_backward_is_freed(bitpack):
    torch.manual_seed(0)
    model = Saver().train()
    x = torch.randn(2, 3, 8, 8)
    boxes = _boxes()
    tracker = StorageTracker()
    with trim(model, bitpack=bitpack) as handle:
        with tracker:
            for _ in range(3):
                output = model(x)
                del output
        assert handle.stats["kept"] > 0
        _assert_nothing_left(tracker, model, [x], boxes)
        # and an audit of the trimmed model (trim stands aside for it) leaves nothing either
        tracker = StorageTracker()
        with tracker:
            gradaudit.audit(model, x, verify=True)
        _assert_nothing_left(tracker, model, [x], boxes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_audits_give_back_gpu_memory():
    torch.manual_seed(0)
    model = Saver().cuda().train()
    x = torch.randn(2, 3, 8, 8, device="cuda")
    gradaudit.audit(model, x, verify=True)  # warm-up: cuBLAS/cuDNN workspaces stay allocated
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        gradaudit.audit(model, x, verify=True)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
