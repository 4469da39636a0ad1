"""Byte accounting by storage, checked against hand arithmetic on tiny models."""

import torch
import torch.nn.functional as F
from torch import nn

import gradaudit
from gradaudit.accounting import Accountant
from gradaudit.measure import held_bytes_after_forward
from gradaudit.records import NOT_NEEDED, SavedTensor, Storage


class Fn(nn.Module):
    """A module whose forward is a plain function (keeps each test's graph next to its numbers)."""

    def __init__(self, fn, **params):
        super().__init__()
        self.fn = fn
        for name, value in params.items():
            self.register_parameter(name, value)

    def forward(self, *args):
        return self.fn(self, *args)


def _saves(report, node):
    return {t.attr: t for t in report.tensors if t.node == node}


def test_a_saved_view_keeps_its_whole_base_alive():
    x = torch.randn(4, 8, requires_grad=True)
    model = Fn(lambda m, v: (v * 3 + 1)[:, :2].sin())  # sin saves its input: a 4x2 view of a 4x8 tensor
    report = gradaudit.audit(model, x)
    (saved,) = _saves(report, "SinBackward0").values()
    assert saved.view_nbytes == 4 * 2 * 4  # 32
    # 4*8*4 = 128: the whole base, not the view
    assert report.storages[saved.storage_id].nbytes == 128
    assert report.saved_bytes == 128 + 8  # + the 0-dim float64 `3` that MulBackward0 saves as `other`
    assert report.saved_bytes == held_bytes_after_forward(model, x)


def test_a_storage_saved_twice_is_counted_once():
    x = torch.randn(4, 8, requires_grad=True)
    model = Fn(lambda m, v: (v + 1).exp().sin())  # exp saves result y; sin saves self = the same y
    report = gradaudit.audit(model, x)
    exp, sin = _saves(report, "ExpBackward0")["result"], _saves(report, "SinBackward0")["self"]
    assert exp.storage_id == sin.storage_id
    assert report.saved_bytes == 4 * 8 * 4  # 128, not 256
    assert report.saved_bytes == held_bytes_after_forward(model, x)


def test_parameters_buffers_and_inputs_cost_nothing():
    model = Fn(lambda m, v: v * m.w * m.scale, w=nn.Parameter(torch.randn(8)))
    model.register_buffer("scale", torch.randn(8))
    x = torch.randn(4, 8, requires_grad=True)
    report = gradaudit.audit(model, x)
    kinds = sorted(t.storage_kind for t in report.held_tensors)
    # v*w saves v and w; (v*w)*scale saves only scale (v*w is read only for scale's gradient)
    assert kinds == ["buffer", "input", "parameter"]
    assert report.saved_bytes == 0
    assert report.saved_bytes == held_bytes_after_forward(model, x)


def test_outputs_are_held_but_never_reclaimable():
    # the conv's saved input is not needed (its weight is frozen), but it is also a model output,
    # so it stays alive whatever autograd does
    model = Fn(lambda m, v: ((a := v + 1), F.conv2d(a, m.w)), w=nn.Parameter(torch.randn(5, 4, 3, 3)))
    model.requires_grad_(False)
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    report = gradaudit.audit(model, x)
    saved = _saves(report, "ConvolutionBackward0")["input"]
    assert saved.storage_kind == "output" and saved.verdict == NOT_NEEDED
    assert report.saved_bytes == 2 * 4 * 6 * 6 * 4  # 1152: outputs a graph keeps are held
    assert report.reclaimable_bytes == 0
    assert report.reclaimable_with_bitpacking_bytes == 0
    assert report.saved_bytes == held_bytes_after_forward(model, x)


def test_plain_tensor_attributes_of_modules_cost_nothing():
    # a tensor kept on a module without register_buffer lives as long as the module does
    model = Fn(lambda m, v: v * m.mask + m.table["bias"] * v)
    model.mask = torch.randn(8)
    model.table = {"bias": torch.randn(8)}
    x = torch.randn(4, 8, requires_grad=True)
    report = gradaudit.audit(model, x)
    assert sorted(t.storage_kind for t in report.held_tensors) == ["buffer", "buffer"]
    assert report.saved_bytes == 0
    assert report.saved_bytes == held_bytes_after_forward(model, x)


class ConvReluFrozenConv(nn.Module):
    """The ResNet pattern: a frozen conv whose input is the previous ReLU's result."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 5, 3, padding=1, bias=False).requires_grad_(False)

    def forward(self, x):
        return self.conv2(self.relu(self.conv1(x)))


def test_frozen_conv_input_that_is_a_relu_result_frees_nothing_alone():
    torch.manual_seed(0)
    model = ConvReluFrozenConv()
    x = torch.randn(2, 3, 8, 8)
    report = gradaudit.audit(model, x)
    relu = _saves(report, "ReluBackward0")["result"]
    conv2_input = [t for t in report.tensors if t.module == "conv2" and t.attr == "input"][0]
    assert relu.storage_id == conv2_input.storage_id
    assert conv2_input.verdict == NOT_NEEDED and relu.bitpackable
    # held: the ReLU result only, 2*4*8*8*4 = 2048 bytes (conv1's input is the caller's input)
    assert report.saved_bytes == 2048
    assert report.saved_bytes == held_bytes_after_forward(model, x)
    # the ReLU needs the storage, so dropping conv2's input alone frees 0 bytes
    assert report.reclaimable_bytes == 0
    # bit-packing the ReLU's result frees it: 2048 - ceil(512 / 8) = 2048 - 64 = 1984
    assert report.reclaimable_with_bitpacking_bytes == 1984
    ga101 = [f for f in report.findings if f.code == "GA101"]
    assert len(ga101) == 1 and ga101[0].bytes == 0 and ga101[0].module == "conv2"


def test_frozen_conv_with_a_private_input_frees_it():
    # the same without the ReLU: conv1's output is saved only by conv2, which does not need it
    torch.manual_seed(0)
    model = ConvReluFrozenConv()
    model.relu = nn.Identity()
    x = torch.randn(2, 3, 8, 8)
    report = gradaudit.audit(model, x)
    assert report.saved_bytes == 2048  # 2*4*8*8*4, conv2's input
    assert report.reclaimable_bytes == 2048
    assert report.reclaimable_with_bitpacking_bytes == 2048
    totals = {m.path: m for m in report.modules}
    assert totals["conv2"].own_bytes == 2048 and totals[""].total_bytes == report.saved_bytes
    assert totals["conv2"].own_reclaimable_bytes == 2048


def _tensor(index, storage_id, numel, verdict="needed", bitpackable=False, offset=0):
    return SavedTensor(index=index, node_id=0, node="X", attr=f"a{index}", shape=(numel,), dtype="float32",
                       device="cpu", numel=numel, itemsize=4, storage_id=storage_id,
                       storage_kind="activation", module="", module_class="", source=None,
                       verdict=verdict, bitpackable=bitpackable, storage_offset=offset, stride=(1,))


def test_accountant_frees_a_storage_only_when_every_save_of_it_goes():
    # storage 0 (400 bytes) is saved twice: two views of 50 elements at different offsets
    storages = [Storage(id=0, nbytes=400, kind="activation", module="", tensors=[0, 1])]
    a = _tensor(0, 0, 50, verdict=NOT_NEEDED)
    b = _tensor(1, 0, 50, offset=50, bitpackable=True, verdict="sign-only")
    acc = Accountant([a, b], storages)
    assert acc.saved_bytes() == 400
    assert acc.freed({0}) == 0  # b still needs the storage
    assert acc.freed({0, 1}) == 400
    # b bit-packed: 400 - ceil(50 / 8) = 400 - 7 = 393
    assert acc.freed({0}, {1}) == 393
    assert acc.reclaimable_bytes() == 0 and acc.reclaimable_with_bitpacking_bytes() == 393


def test_a_sign_only_save_the_proof_found_three_signed_is_not_bit_packed():
    # verify=True clears `bitpackable` for a sign-only save whose values are negative, zero and
    # positive: its sign pattern needs more than one bit, so bit-packing frees nothing of it
    storages = [Storage(id=0, nbytes=400, kind="activation", module="", tensors=[0])]
    three_signs = _tensor(0, 0, 100, verdict="sign-only", bitpackable=False)
    acc = Accountant([three_signs], storages)
    assert acc.bitpackable() == set()
    assert acc.reclaimable_with_bitpacking_bytes() == 0
    two_signs = _tensor(0, 0, 100, verdict="sign-only", bitpackable=True)
    # 400 - ceil(100 / 8) = 400 - 13 = 387
    assert Accountant([two_signs], storages).reclaimable_with_bitpacking_bytes() == 387


def test_activations_a_forward_stores_on_a_module_are_named_not_dropped():
    """A module that stores an activation as an attribute (torchvision's RAFT keeps its correlation
    pyramid so): the module holds it, after backward too. It is not autograd's memory, so it is not
    in saved_bytes, but it is reported, and the two add up to what is alive after the forward."""
    class KeepsItsCache(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)
            self.scale = torch.randn(64)  # module state from __init__: like a buffer

        def forward(self, x):
            self.cache = self.lin(x) * 2  # 32x64 float32 = 8192 bytes, made by this forward
            return (self.cache * self.scale).tanh()

    model, x = KeepsItsCache(), torch.randn(32, 64)
    report = gradaudit.audit(model, x)
    assert report.kept_on_modules_bytes == 32 * 64 * 4
    assert any("cache" in note and "kept on modules" in note for note in report.notes)
    assert report.saved_bytes + report.kept_on_modules_bytes == held_bytes_after_forward(model, x)
    assert report.to_dict()["summary"]["kept_on_modules_bytes"] == 8192


def test_model_tree_lists_what_the_module_methods_list():
    # one walk serves every stage of an audit: it must list what torch's own methods list
    from gradaudit.tensors import ModelTree

    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.BatchNorm1d(3), nn.Sequential(shared, nn.Linear(3, 2)), nn.LazyLinear(2))
    model[1].register_buffer("extra", None)
    tree = ModelTree(model)
    assert tree.modules == list(model.named_modules())
    assert tree.module_list == list(model.modules())
    assert [(n, id(p)) for n, p in tree.parameters] == [(n, id(p)) for n, p in model.named_parameters()]
    assert [id(b) for b in tree.buffers] == [id(b) for b in model.buffers()]


def test_tensor_attributes_keep_attribute_order_within_a_module():
    from gradaudit.tensors import tensor_attributes

    model = nn.Sequential(nn.Linear(2, 2))
    h = torch.randn(2)
    model[0].z = h
    model[0].a = [h, 1, torch.randn(1)]
    model[0].m = {"k": h}
    model.kernel = (3, 3)  # a tuple of numbers holds no tensor
    found = tensor_attributes(model)
    assert [(where, id(t)) for where, t in found] == [("0.z", id(h)), ("0.a", id(h)), ("0.a", id(model[0].a[2])),
                                                       ("0.m", id(h))]
