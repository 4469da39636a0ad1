"""Pins the autograd behaviour gradaudit is built on (see ../shared/notes/autograd-facts.md).

If one of these fails on a new torch, the recorder or a rule's claim needs re-checking before
anything else: these are the facts, the rest of the suite is what we built on them.
"""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt


# torch 2.13 has no node-creation hook; the recorder then attributes saves at pack time
# (tests/test_audit.py checks that fallback gives the same modules)
needs_node_hook = pytest.mark.skipif(not hasattr(torch._C._autograd, "_push_node_creation_hook"),
                                     reason="this torch has no node-creation hook")


def _boxing_hooks(log):
    """Pack into a list box (so the packed object is not a tensor); unpack counts its calls."""

    def pack(t):
        log["packed"].append(t)
        return [t]

    def unpack(box):
        log["unpacked"] += 1
        return box[0]

    return pack, unpack


def _log():
    return {"packed": [], "unpacked": 0}


def test_pack_hook_sees_builtin_saves_and_save_for_backward():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            return x * x * y

        @staticmethod
        def backward(ctx, grad):
            x, y = ctx.saved_tensors
            return 2 * x * y * grad, x * x * grad

    log = _log()
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(*_boxing_hooks(log)):
        s = torch.sin(x)  # SinBackward0 saves self
        out = Square.apply(s, y)
    ids = [id(t) for t in log["packed"]]
    assert id(x) in ids  # sin's input
    assert ids.count(id(y)) == 1 and id(s) in ids  # both save_for_backward arguments
    assert len(log["packed"]) == 3
    out.sum().backward()
    assert log["unpacked"] == 3  # backward reads each packed object once


def test_saved_tensor_data_is_the_packed_object_and_runs_no_unpack():
    log = _log()
    x = torch.randn(4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(*_boxing_hooks(log)):
        y = x.exp()  # ExpBackward0 saves its result (an output, packed after the kernel)
    raw = y.grad_fn._raw_saved_result
    assert isinstance(raw.data, list) and raw.data[0] is log["packed"][0]
    assert log["unpacked"] == 0
    # whereas reading the public attribute unpacks
    assert torch.equal(y.grad_fn._saved_result, y)
    assert log["unpacked"] == 1


def test_custom_function_nodes_expose_raw_saved_tensors():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return 2 * x

        @staticmethod
        def backward(ctx, grad):
            return 2 * grad

    x = torch.randn(2, requires_grad=True)
    log = _log()
    with torch.autograd.graph.saved_tensors_hooks(*_boxing_hooks(log)):
        y = Twice.apply(x)
    node = y.grad_fn
    assert isinstance(node, torch.autograd.function.BackwardCFunction)
    (raw,) = node._raw_saved_tensors
    assert raw.data[0] is x and log["unpacked"] == 0


def test_unpack_hook_names_checkpoint_and_save_on_cpu():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)

    def block(v):
        return torch.tanh(lin(v))

    y = ckpt.checkpoint(block, x, use_reentrant=False)
    raw = y.grad_fn._raw_saved_result
    assert raw.unpack_hook.__module__ == "torch.utils.checkpoint"
    assert not isinstance(raw.data, torch.Tensor)  # a checkpoint handle, not the tensor

    with torch.autograd.graph.save_on_cpu():
        z = torch.tanh(lin(x))
    raw = z.grad_fn._raw_saved_result
    assert "save_on_cpu" in raw.unpack_hook.__qualname__
    device, tensor = raw.data  # (original device, cpu copy): the shape is readable without unpacking
    assert tuple(tensor.shape) == (2, 4)


def test_wrapped_python_numbers_are_saved_without_pack_hooks():
    # `0.5 * x` saves `other`, a 0-dim float64 tensor made from the Python number; the pack hook
    # never sees it, so the recorder must read such slots as plain tensors (it does: index -1).
    log = _log()
    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(*_boxing_hooks(log)):
        y = 0.5 * x
    assert log["packed"] == []
    other = y.grad_fn._raw_saved_other.data
    assert isinstance(other, torch.Tensor) and other.dim() == 0 and other.dtype == torch.float64
    assert other.untyped_storage().nbytes() == 8


def test_next_functions_none_means_no_gradient():
    conv = torch.nn.Conv2d(2, 3, 3, bias=False)
    conv.weight.requires_grad_(False)
    x = torch.randn(1, 2, 5, 5, requires_grad=True)
    node = conv(x).grad_fn
    assert type(node).__name__ == "ConvolutionBackward0"
    input_edge, weight_edge = node.next_functions[0][0], node.next_functions[1][0]
    assert type(input_edge).__name__ == "AccumulateGrad" and input_edge.variable is x
    assert weight_edge is None


@needs_node_hook
def test_node_creation_hook_fires_after_the_saves_and_sequence_numbers_exist():
    assert hasattr(torch._C._autograd, "_get_sequence_nr")
    events = []

    def on_node(node):
        events.append(("node", type(node).__name__, node._sequence_nr()))

    def pack(t):
        events.append(("pack",))
        return t

    x = torch.randn(3, requires_grad=True)
    before = torch._C._autograd._get_sequence_nr()
    torch._C._autograd._push_node_creation_hook(on_node)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = x.sin()
    finally:
        torch._C._autograd._pop_node_creation_hook()
    after = torch._C._autograd._get_sequence_nr()
    nodes = [e for e in events if e[0] == "node" and e[1] == "SinBackward0"]
    assert len(nodes) == 1
    # the pack for sin's input comes first: a pack hook alone cannot tell which node saves
    assert events.index(("pack",)) < events.index(nodes[0])
    assert before <= y.grad_fn._sequence_nr() < after


def test_sequence_numbers_exist():
    x = torch.randn(3, requires_grad=True)
    before = torch._C._autograd._get_sequence_nr()
    y = x.sin()
    assert before <= y.grad_fn._sequence_nr() < torch._C._autograd._get_sequence_nr()


@needs_node_hook
def test_in_place_on_a_view_hides_its_node_inside_copy_slices():
    events = []
    w = torch.randn(4, requires_grad=True)
    torch._C._autograd._push_node_creation_hook(lambda n: events.append(type(n).__name__))
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: events.append("pack") or t, lambda t: t):
            y = w * 2
            y[:3].mul_(w[:3].sigmoid())
    finally:
        torch._C._autograd._pop_node_creation_hook()
    assert type(y.grad_fn).__name__ == "CopySlices"
    assert not any(n.startswith("_raw_saved") for n in dir(y.grad_fn))  # the inner node is not exposed
    # the in-place MulBackward0 itself is never announced; its saves come shortly before CopySlices
    assert events.count("MulBackward0") == 1  # only `w * 2`
    last_pack = len(events) - 1 - events[::-1].index("pack")
    assert 0 < events.index("CopySlices") - last_pack <= 4


def _grad_with_saved_poisoned(fn, inputs, target, poison):
    """Gradients of fn(*inputs).sum() when the saved tensor that *is* ``target`` is unpacked poisoned."""

    def pack(t):
        return (t is target, t)

    def unpack(box):
        is_target, t = box
        return poison(t) if is_target else t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fn(*inputs)
    wanted = [t for t in inputs if t.requires_grad]
    return torch.autograd.grad(out.sum(), wanted)


def _assert_not_read(fn, inputs, target):
    clean = _grad_with_saved_poisoned(fn, inputs, target, lambda t: t)
    for poison in (torch.zeros_like, lambda t: torch.full_like(t, 7.5), lambda t: -t):
        dirty = _grad_with_saved_poisoned(fn, inputs, target, poison)
        for a, b in zip(clean, dirty):
            assert torch.equal(a, b)


def test_conv_input_is_saved_but_unused_when_the_weight_is_frozen():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    w = torch.randn(4, 3, 3, 3)  # frozen
    node = F.conv2d(x, w).grad_fn
    assert node._saved_input is x  # saved anyway (pytorch/pytorch#133566)
    _assert_not_read(F.conv2d, (x, w), x)
    # and symmetric: a frozen input makes the saved weight unused
    x2 = torch.randn(2, 3, 8, 8)
    w2 = torch.randn(4, 3, 3, 3, requires_grad=True)
    assert F.conv2d(x2, w2).grad_fn._saved_weight is w2
    _assert_not_read(F.conv2d, (x2, w2), w2)


def test_batch_norm_eval_with_frozen_affine_does_not_read_its_input():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3).eval().requires_grad_(False)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    node = bn(x).grad_fn
    assert type(node).__name__ == "NativeBatchNormBackward0" and node._saved_training is False
    assert node._saved_input is x
    _assert_not_read(lambda v: bn(v), (x,), x)


def test_max_pool_reads_only_the_indices():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    node = F.max_pool2d(x, 2).grad_fn
    assert type(node).__name__ == "MaxPool2DWithIndicesBackward0"
    assert node._saved_self is x and node._saved_result1.dtype == torch.int64
    _assert_not_read(lambda v: F.max_pool2d(v, 2), (x,), x)


def test_relu_result_is_needed_but_only_as_a_sign():
    torch.manual_seed(0)
    x = torch.randn(50, requires_grad=True)

    def run(poison):
        def pack(t):
            return t

        def unpack(t):
            return poison(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = torch.relu(x)
        return torch.autograd.grad(y.sum(), x)[0]

    clean = run(lambda t: t)
    assert torch.equal(run(lambda t: (t > 0).float() * 123.0), clean)  # same sign pattern: same grad
    assert not torch.equal(run(torch.zeros_like), clean)  # but the pattern itself is read


def test_relu_result_is_never_negative_and_its_conversion_to_bool_is_not_le_zero():
    """trim keeps a ReLU's result as x != 0 (Bit.NE_ZERO: one conversion to bool each way) where
    threshold_backward reads x <= 0: the same bit only because relu never writes a negative value
    (-0.0 compares equal to 0, NaN passes both), whatever the input holds."""
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-45, -1e-45, -3.0, 2.0])
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = torch.cat([special, torch.randn(200)]).to(dtype)
        for result in (torch.relu(x), torch.relu_(x.clone()), torch.nn.functional.relu(x.clone(), inplace=True)):
            assert not (result < 0).any()
            assert torch.equal(result.bool(), ~(result <= 0))
            grad = torch.randn(result.shape).to(dtype)
            assert torch.equal(torch.ops.aten.threshold_backward(grad, result, 0),
                               torch.ops.aten.threshold_backward(grad, result.bool().to(dtype), 0))


def test_a_pack_hook_set_by_register_hooks_runs_with_grad_mode_off():
    """trim's steady pack hooks make their masks without a no_grad block of their own: autograd runs a
    pack hook set on a saved tensor (SavedTensor.register_hooks) under its own no-grad guard."""
    x = torch.randn(3, requires_grad=True)
    y = torch.relu(x * 2)
    seen = []

    def pack(t):
        seen.append((torch.is_grad_enabled(), t.requires_grad))
        return t.bool()

    y.grad_fn._raw_saved_result.register_hooks(pack, lambda packed: packed.to(torch.float32))
    assert seen == [(False, False)]


def test_meta_device_builds_the_graph_and_packs_meta_tensors():
    packed = []
    with torch.device("meta"):
        lin = torch.nn.Linear(8, 8)
        x = torch.randn(2, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = torch.tanh(lin(x))
    assert y.device.type == "meta" and y.grad_fn is not None
    assert packed and all(t.device.type == "meta" for t in packed)
    assert packed[-1].untyped_storage().nbytes() == 2 * 8 * 4  # storages carry their size on meta


def test_non_reentrant_checkpoint_recomputes_when_a_saved_attribute_is_read():
    calls = []
    lin = torch.nn.Linear(4, 4)

    def block(v):
        calls.append(1)
        return torch.tanh(lin(v))

    x = torch.randn(2, 4, requires_grad=True)
    y = ckpt.checkpoint(block, x, use_reentrant=False)
    assert len(calls) == 1
    _ = y.grad_fn._raw_saved_result.data  # safe
    assert len(calls) == 1
    _ = y.grad_fn._saved_result  # the trap gradaudit avoids: this reruns the block
    assert len(calls) == 2
