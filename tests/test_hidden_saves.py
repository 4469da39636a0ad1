"""Saves hidden inside CopySlices: an in-place op on a view gets the verdict of the node it hides.

An in-place op on a view wraps its node inside a CopySlices node, which exposes none of its
saves; the audit knows the save by the torch function that packed it, and the declaration naming
that function (``in_place=``) says what backward reads. For every function a declaration names:

1. called in place on a tensor that is not a view, it makes one of the declared nodes and saves a
   declared attribute there (the function -> node mapping holds on the installed torch: which of
   the nodes is the installed release's choice, ``x[mask] = 0`` makes IndexPutBackward0 on 2.14
   and MaskedFillBackward0 on 2.15);
2. on a view, the audit gives its hidden save that node's verdict;
3. backward reads the hidden save: replaced at unpack by other values, it changes the gradient.
   ``verify=True`` cannot show this (CopySlices cannot be called on its node's behalf), so the
   check here runs the whole backward instead.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradaudit
from gradaudit.knowledge import Read, declarations, hidden_by
from gradaudit.knowledge.registry import forget
from gradaudit.measure import held_bytes_after_forward
from gradaudit.records import NEEDED, SIGN_ONLY, UNKNOWN
from gradaudit.torchapi.autograd import node_scalars, raw_saved_slots


def _mask_of(v):
    return v > 0.3


# function -> (shape of the input, the in-place call on a tensor (a view of it in 2. and 3.), the
# verdict of its one save). The call's other operands, made inside it, need no gradient.
CASES = {
    "relu": ((3, 6), lambda t: F.relu(t, inplace=True), SIGN_ONLY),
    "relu_": ((3, 6), lambda t: t.relu_(), SIGN_ONLY),
    "leaky_relu": ((3, 6), lambda t: F.leaky_relu(t, 0.1, inplace=True), SIGN_ONLY),
    "leaky_relu_": ((3, 6), lambda t: F.leaky_relu_(t, 0.1), SIGN_ONLY),
    "silu": ((3, 6), lambda t: F.silu(t, inplace=True), NEEDED),
    "silu_": ((3, 6), lambda t: torch._C._nn.silu_(t), NEEDED),
    "mish": ((3, 6), lambda t: F.mish(t, inplace=True), NEEDED),
    "mish_": ((3, 6), lambda t: torch._C._nn.mish_(t), NEEDED),
    "hardswish": ((3, 6), lambda t: F.hardswish(t, inplace=True), NEEDED),
    "hardswish_": ((3, 6), lambda t: torch._C._nn.hardswish_(t), NEEDED),
    "hardsigmoid": ((3, 6), lambda t: F.hardsigmoid(t, inplace=True), NEEDED),
    "hardsigmoid_": ((3, 6), lambda t: torch._C._nn.hardsigmoid_(t), NEEDED),
    "hardtanh": ((3, 6), lambda t: F.hardtanh(t, -0.5, 0.5, inplace=True), NEEDED),
    "hardtanh_": ((3, 6), lambda t: F.hardtanh_(t, -0.5, 0.5), NEEDED),
    "relu6": ((3, 6), lambda t: F.relu6(t, inplace=True), NEEDED),
    "sigmoid_": ((3, 6), lambda t: t.sigmoid_(), NEEDED),
    "tanh_": ((3, 6), lambda t: t.tanh_(), NEEDED),
    "elu": ((3, 6), lambda t: F.elu(t, inplace=True), NEEDED),
    "elu_": ((3, 6), lambda t: F.elu_(t), NEEDED),
    "selu": ((3, 6), lambda t: F.selu(t, inplace=True), NEEDED),
    "selu_": ((3, 6), lambda t: torch.selu_(t), NEEDED),
    "celu": ((3, 6), lambda t: F.celu(t, 0.5, inplace=True), NEEDED),
    "celu_": ((3, 6), lambda t: torch.celu_(t, 0.5), NEEDED),
    "_threshold": ((3, 6), lambda t: F.threshold(t, 0.3, -1.0, inplace=True), NEEDED),
    "threshold_": ((3, 6), lambda t: F.threshold_(t, 0.3, -1.0), NEEDED),
    "dropout": ((3, 6), lambda t: F.dropout(t, 0.5, True, inplace=True), NEEDED),
    "dropout_": ((3, 6), lambda t: torch.dropout_(t, 0.5, True), NEEDED),
    "dropout1d": ((2, 6, 5), lambda t: F.dropout1d(t, 0.5, True, inplace=True), NEEDED),
    "dropout2d": ((2, 6, 3, 3), lambda t: F.dropout2d(t, 0.5, True, inplace=True), NEEDED),
    "dropout3d": ((2, 6, 2, 2, 2), lambda t: F.dropout3d(t, 0.5, True, inplace=True), NEEDED),
    "feature_dropout_": ((2, 6, 3, 3), lambda t: torch.feature_dropout_(t, 0.5, True), NEEDED),
    "alpha_dropout": ((3, 6), lambda t: F.alpha_dropout(t, 0.5, True, inplace=True), NEEDED),
    "alpha_dropout_": ((3, 6), lambda t: torch.alpha_dropout_(t, 0.5, True), NEEDED),
    "feature_alpha_dropout": ((2, 6, 3, 3), lambda t: F.feature_alpha_dropout(t, 0.5, True, inplace=True), NEEDED),
    "feature_alpha_dropout_": ((2, 6, 3, 3), lambda t: torch.feature_alpha_dropout_(t, 0.5, True), NEEDED),
    # a mask of 0 and 1, as Hugging Face's funnel attention multiplies its scores in place
    "mul_": ((3, 6), lambda t: t.mul_(_mask_of(t.detach()).float()), NEEDED),
    "__setitem__": ((3, 6), lambda t: t.__setitem__(_mask_of(t.detach()), 0.0), NEEDED),
}


def _in_place_functions():
    return sorted({function for variant in declarations() for function in variant.in_place})


class _InPlace(nn.Module):
    """Runs ``call`` in place on a copy of the input, or on a view of it (every dimension but the
    second whole, 4 of its 6 entries): the op's saves are activations, not the caller's input."""

    def __init__(self, call, on_view):
        super().__init__()
        self.call, self.on_view = call, on_view

    def forward(self, x):
        h = x.clone()
        self.call(h[:, :4] if self.on_view else h)
        return h


def _input(shape):
    torch.manual_seed(0)
    return torch.randn(*shape, requires_grad=True)


def test_every_in_place_function_has_a_case():
    assert sorted(CASES) == _in_place_functions()


@pytest.mark.parametrize("function", sorted(CASES))
def test_the_function_makes_the_declared_node(function):
    shape, call, _ = CASES[function]
    hidden = {declared.name: (declared, attrs) for declared, attrs in hidden_by(function)}
    h = _InPlace(call, on_view=False)(_input(shape))
    # breadth first from the output: the node (alpha dropout adds after it multiplies)
    nodes, found = [h.grad_fn], None
    while nodes and found is None:
        node = nodes.pop(0)
        if type(node).__name__ in hidden:
            found = node
        nodes.extend(fn for fn, _ in node.next_functions if fn is not None)
    assert found is not None, (function, sorted(hidden))
    inner, attrs = hidden[type(found).__name__]
    slots = [(attr.split("[")[0], raw.data is not None) for attr, raw in raw_saved_slots(found)]
    assert set(attrs) <= {attr for attr, _ in slots}  # the node type has each declared attribute ...
    assert {attr for attr, made in slots if made} & set(attrs)  # ... and this call saved one of them
    if inner.when:
        assert inner.matches(node_scalars(found))


@pytest.mark.parametrize("function", sorted(CASES))
def test_a_hidden_save_gets_the_verdict_of_its_node(function):
    shape, call, verdict = CASES[function]
    model, x = _InPlace(call, on_view=True), _input(shape)
    report = gradaudit.audit(model, x)
    (hidden,) = [t for t in report.tensors if t.node == "CopySlices"]
    assert hidden.attr == "hidden[0]" and hidden.verdict == verdict, (function, hidden.reason)
    assert f"in-place {function} on a view" in hidden.reason
    # every node the function may hide is named: which one it is, the audit cannot see
    assert all(f"{inner.name}.{attrs[0]}" in hidden.reason for inner, attrs in hidden_by(function))
    assert not hidden.bitpackable and hidden.rule is None  # trim cannot reach it: no finding counts it
    assert report.summary()["unknown_tensors"] == 0


@pytest.mark.parametrize("function", sorted(CASES))
def test_backward_reads_the_hidden_save(function):
    """Replacing the hidden save's values (at unpack) changes the input's gradient."""
    shape, call, _ = CASES[function]
    model, x = _InPlace(call, on_view=True), _input(shape)
    weights = torch.randn(*shape, generator=torch.Generator().manual_seed(1))

    def gradient(replace):
        packed = []

        def pack(t):
            packed.append(t)
            return len(packed) - 1

        def unpack(i):
            t = packed[i]
            if not replace:
                return t
            if t.dtype == torch.bool:
                return ~t
            return torch.randn(t.shape, dtype=t.dtype, generator=torch.Generator().manual_seed(2)) * 3

        torch.manual_seed(3)  # the same dropout noise both times
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            h = model(x)
        assert len(packed) == 1, function
        return torch.autograd.grad((h * weights).sum(), x)[0]

    assert not torch.equal(gradient(replace=False), gradient(replace=True)), function


def test_mul_in_place_saves_either_factor_and_both_are_read():
    """mul_ saves other for the self gradient and a copy of self for the other's: with both
    factors needing a gradient, two hidden saves, each needed whichever attribute it is."""
    model = _InPlace(lambda t: t.mul_(model.w), on_view=True)
    model.w = nn.Parameter(torch.randn(3, 4))
    report = gradaudit.audit(model, _input((3, 6)))
    hidden = [t for t in report.tensors if t.node == "CopySlices"]
    assert [t.attr for t in hidden] == ["hidden[0]", "hidden[1]"]
    assert all(t.verdict == NEEDED and "MulBackward0.self or MulBackward0.other" in t.reason for t in hidden)
    # the copy of self (3x4 float32, 48 bytes) is an activation; other is the weight (free)
    assert sorted(t.storage_kind for t in hidden) == ["activation", "parameter"]
    assert [report.storages[t.storage_id].nbytes for t in hidden if t.storage_kind == "activation"] == [3 * 4 * 4]


def test_in_place_dropout_after_a_flatten_holds_only_its_noise():
    """torchvision's efficientnet and mvit heads: Dropout(inplace=True) on the flattened pooled
    features, a view, so its multiply by the noise hides inside CopySlices."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2, inplace=True),
                          nn.Linear(16, 10))
    x = torch.randn(2, 3, 4, 4)
    report = gradaudit.audit(model, x)
    (hidden,) = [t for t in report.tensors if t.node == "CopySlices"]
    assert (hidden.module_class, hidden.verdict, hidden.shape) == ("Dropout", NEEDED, (2, 16))
    assert "MulBackward0.other" in hidden.reason
    # the noise, 2*16 float32 = 128 bytes, held like any other save
    assert report.storages[hidden.storage_id].nbytes == 2 * 16 * 4
    assert report.summary()["unknown_tensors"] == 0
    assert report.saved_bytes == held_bytes_after_forward(model, x)


def test_in_place_ops_whose_hidden_saves_may_go_unread_stay_unknown():
    """div_ with a rounding mode has a zero gradient, yet saves its divisor (DivBackward2): no
    declaration names div_, so its hidden save keeps verdict unknown rather than a wrong one."""
    assert hidden_by("div_") == ()
    model = _InPlace(lambda t: t.div_(torch.full_like(t, 2.0), rounding_mode="floor"), on_view=True)
    report = gradaudit.audit(model, _input((3, 6)))
    (hidden,) = [t for t in report.tensors if t.node == "CopySlices"]
    assert hidden.verdict == UNKNOWN


@pytest.mark.parametrize("index", ["bool mask", "integer index"])
def test_an_indexed_assignment_on_a_view_is_needed_whatever_node_the_release_makes(index):
    """``h[i] = 0`` on a view: IndexPutBackward0 up to torch 2.14; on 2.15 MaskedFillBackward0 for a
    bool mask and IndexFillBackward0 for integer indices. Each reads what it saved (the mask or the
    indices), so the hidden save is needed on every release."""
    def assign(t):
        t[_mask_of(t.detach()) if index == "bool mask" else torch.tensor([0, 2])] = 0.0

    model, x = _InPlace(assign, on_view=True), _input((3, 6))
    report = gradaudit.audit(model, x)
    (hidden,) = [t for t in report.tensors if t.node == "CopySlices"]
    assert hidden.verdict == NEEDED and "in-place __setitem__ on a view" in hidden.reason
    assert report.summary()["unknown_tensors"] == 0


def test_in_place_declarations_are_one_variant_per_node_and_function():
    with pytest.raises(ValueError, match="declare it alone"):
        gradaudit.declare("NoSuchBackward0", "NoSuchBackward1", edges=("self",), saves={"self": Read()},
                          in_place={"no_such_": "self"})
    with pytest.raises(ValueError, match="already hides a variant of ReluBackward0"):
        gradaudit.declare("ReluBackward0", edges=("self",), when={"no_such_scalar": 1}, saves={"result": Read()},
                          in_place={"relu_": "result"})
    forget(["NoSuchBackward0", "NoSuchBackward1"])  # neither check should have declared one; none stays
    assert [declared.name for declared, _ in hidden_by("relu_")] == ["ReluBackward0"]


def test_a_function_hiding_several_nodes_gets_a_verdict_only_where_they_agree():
    """Another node naming relu_ whose save backward reads in full: the hidden ReLU save no longer
    gets SIGN_ONLY (which node relu_ hid is not known), it stays unknown."""
    model, x = _InPlace(lambda t: t.relu_(), on_view=True), _input((3, 6))
    assert [t.verdict for t in gradaudit.audit(model, x).tensors if t.node == "CopySlices"] == [SIGN_ONLY]
    gradaudit.declare("NoSuchBackward0", edges=("self",), saves={"self": Read(why="its values")},
                      in_place={"relu_": "self"})
    try:
        assert [t.verdict for t in gradaudit.audit(model, x).tensors if t.node == "CopySlices"] == [UNKNOWN]
    finally:
        forget(["NoSuchBackward0"])


@pytest.mark.slow
def test_torchvision_efficientnet_head_dropout(vision_model):
    """torchvision's efficientnet_b0 in training: its one hidden save, the head dropout's noise,
    is needed, and no held tensor is left without a verdict."""
    model = vision_model("efficientnet_b0").train()
    images = torch.randn(2, 3, 32, 32)
    report = gradaudit.audit(model, images)
    (hidden,) = [t for t in report.held_tensors if t.node == "CopySlices"]
    assert (hidden.module, hidden.verdict) == ("classifier.0", NEEDED)
    # 2 images * 1280 pooled features, float32: 10240 bytes
    assert report.storages[hidden.storage_id].nbytes == 2 * 1280 * 4
    assert report.summary()["unknown_tensors"] == 0
    assert report.saved_bytes == held_bytes_after_forward(model, images)


def test_verify_leaves_a_hidden_save_unproven_and_says_why():
    # the in-place Hardswish writes through a view (Unflatten's)
    model = nn.Sequential(nn.Linear(2, 16), nn.Unflatten(1, (4, 4)), nn.Hardswish(inplace=True), nn.Flatten(),
                          nn.Linear(16, 4))
    x = torch.randn(3, 2)
    report = gradaudit.audit(model, x, verify=True)
    (hidden,) = [t for t in report.tensors if t.node == "CopySlices"]
    assert (hidden.verdict, hidden.proven) == (NEEDED, False) and not report.disagreements
    assert "hidden inside CopySlices" in hidden.unproven
