"""gradaudit.trim: gradients bit-identical to the untrimmed model, memory actually freed, model restored."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradaudit
from gradaudit.measure import held_bytes_after_forward
from gradaudit.errors import GradauditError
from gradaudit.knowledge import Bit
from gradaudit import torchapi
from gradaudit.trimming import compare, trim
from torch.utils._python_dispatch import TorchDispatchMode


from gradaudit.scenarios import SCENARIOS, apply_scenario


def gradients(model: nn.Module, inputs: dict | tuple, *, seed: int = 0) -> list:
    """One forward+backward from a fixed RNG state; every gradient that exists, in order."""
    leaves = [t for t in (inputs.values() if isinstance(inputs, dict) else inputs)
              if isinstance(t, torch.Tensor) and t.requires_grad]
    for t in [*model.parameters(), *leaves]:
        t.grad = None
    torch.manual_seed(seed)
    output = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    if not isinstance(output, torch.Tensor):
        output = output[0]
    # a non-uniform upstream gradient: a uniform one would hide sign and scale mistakes
    (output.float() * torch.linspace(-1, 1, output.numel()).view(output.shape)).sum().backward()
    return [None if t.grad is None else t.grad.clone() for t in [*model.parameters(), *leaves]]


def assert_identical(plain: list, trimmed: list) -> None:
    assert len(plain) == len(trimmed)
    assert any(g is not None for g in plain), "nothing received a gradient: the test would prove nothing"
    for i, (a, b) in enumerate(zip(plain, trimmed)):
        assert (a is None) == (b is None), f"gradient {i}: presence differs"
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), f"gradient {i}"
            assert torch.equal(a.reshape(-1).view(torch.uint8) if a.dtype.is_floating_point else a,
                               b.reshape(-1).view(torch.uint8) if b.dtype.is_floating_point else b), \
                f"gradient {i} is not bit-identical"


def plain_and_trimmed(model: nn.Module, inputs, **trim_options) -> tuple[list, list, dict]:
    """Plain gradients, and trimmed ones from the forward trim decides fully (its counts returned).
    A second trimmed forward, which follows the steady plan the first left, must give the same
    gradients and change the same saves: those the first left changed (bit-packed ones given back
    their tensor are kept), less drops that free nothing (empty saves, storages kept whole)."""
    state = copy.deepcopy(model.state_dict())
    plain = gradients(model, inputs)
    model.load_state_dict(state)  # train-mode BN updated its running statistics
    with trim(model, **trim_options) as handle:
        trimmed = gradients(model, inputs)
        first = handle.stats
        model.load_state_dict(state)
        again = gradients(model, inputs)
        steady = {k: v - first[k] for k, v in handle.stats.items()}
        assert handle.forwards == {"full": 1, "steady": 1}, handle.forwards
    model.load_state_dict(state)
    assert_identical(trimmed, again)
    assert steady["bitpacked"] == first["bitpacked"] - first["unpacked_again"], (first, steady)
    assert steady["dropped"] <= first["dropped"] and (steady["dropped"] > 0) == (first["dropped"] > 0), \
        (first, steady)
    return plain, trimmed, first


# ----------------------------------------------------------------------------------------------
# sign-only saves: one bit per element, same comparison results on every value


@pytest.mark.parametrize("activation", [nn.ReLU(), nn.ReLU(inplace=True), nn.LeakyReLU(0.1),
                                        nn.Threshold(0.0, 0.0)], ids=["relu", "relu_", "leaky", "threshold"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("masks", ["bits", "bytes"])
def test_bitpacked_sign_gives_identical_gradients_on_special_values(activation, dtype, masks):
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, float("inf"), float("-inf"), float("nan"), 3.0, -2.0],
                           dtype=dtype)
    # 9 special values, then 13 random ones: 22 elements, not a multiple of 8 (padding of the last byte)
    x0 = torch.cat([special, torch.randn(13, dtype=dtype)]).view(2, 11)
    model = nn.Sequential(nn.Linear(11, 11).to(dtype), activation)
    x = x0.clone().requires_grad_(True)
    plain, trimmed, stats = plain_and_trimmed(model, (x,), masks=masks)
    assert stats["bitpacked"] == 1
    assert_identical(plain, trimmed)


def test_bitpacking_without_numpy_uses_torch_ops(monkeypatch):
    """The torch-only packing path (GPU, or no numpy) gives the same bits as numpy's packbits."""
    import gradaudit.trimming.codec as codec

    masks = [torch.rand(1001) > 0.5,  # 1001 = 125*8 + 1: a partial last byte
             torch.rand(1000) > 0.5]  # a multiple of 8: packed with no padded copy
    with_numpy = [codec.pack_bits(mask) for mask in masks]
    monkeypatch.setattr(codec, "numpy", None)
    copies = [mask.clone() for mask in masks]
    assert [torch.equal(codec.pack_bits(mask), expected) for mask, expected in zip(masks, with_numpy)] \
        == [True, True]
    # a mask that is not scratch (a bool keep-mask: the save itself) is read, never written; a scratch
    # one (a comparison's own result) may be overwritten by the in-place multiplication, same bits
    assert all(torch.equal(mask, copy) for mask, copy in zip(masks, copies))
    assert [torch.equal(codec.pack_bits(copy.clone(), scratch=True), expected)
            for copy, expected in zip(copies, with_numpy)] == [True, True]
    model = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 2))
    model[2].weight.requires_grad_(False)  # so that the last linear does not keep the ReLU result
    plain, trimmed, stats = plain_and_trimmed(model, (torch.randn(5, 7),))
    assert stats["bitpacked"] == 1
    assert_identical(plain, trimmed)


@pytest.mark.parametrize("chunk", [8, 24, 1 << 18])
def test_chunked_packing_matches_packing_the_whole_mask(monkeypatch, chunk):
    """ReLU-style bits are packed chunk by chunk (a cache-sized mask); any chunk size that is a
    multiple of 8 gives the bytes packing the whole mask at once gives, partial last byte included."""
    import gradaudit.trimming.codec as codec

    monkeypatch.setattr(codec, "_CHUNK", chunk)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-30, -1e-30])
    values = torch.cat([special, torch.randn(93)])  # 100 elements: 12 full bytes and 4 bits
    le, le_scale = codec.PACKERS[Bit.NOT_LE_ZERO](values)
    gt, gt_scale = codec.PACKERS[Bit.GT_ZERO](values)
    assert torch.equal(le, codec.pack_bits(values <= 0))
    assert torch.equal(gt, codec.pack_bits(values > 0))

    def bits(packed):  # element i is bit i % 8 of byte i // 8; the last 4 bits are padding
        return [(int(packed[i // 8]) >> (i % 8)) & 1 for i in range(values.numel())]

    # the bit is x <= 0, unpacked to 0.0 where set (scale -1.0): NaN passes, as in backward
    assert (bits(le), le_scale) == ((values <= 0).int().tolist(), -1.0)
    assert (bits(gt), gt_scale) == ((values > 0).int().tolist(), 1.0)


class Expand(nn.Module):
    def forward(self, x):
        return (x * 2).expand(4, 3, 6, 5)


def test_dropped_save_with_overlapping_strides():
    """An expanded (stride 0) activation saved as a BN input: the zero placeholder keeps its strides."""
    model = nn.Sequential(Expand(), nn.BatchNorm2d(3), nn.Conv2d(3, 2, 1)).eval()
    model[1].weight.requires_grad_(False)
    model[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(1, 3, 1, 5, requires_grad=True)
    plain, trimmed, stats = plain_and_trimmed(model, (x,))
    assert stats["dropped"] == 3  # BN's input, and its batch mean and inverse std (unused in eval)
    assert_identical(plain, trimmed)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.3])
@pytest.mark.parametrize("masks", ["bits", "bytes"])
def test_dropout_mask_bitpacked_with_its_scale(p, masks):
    """nn.Dropout on CPU saves a float mask of 0 and 1/(1-p): one bit (or bool) plus the scale,
    reproduced exactly."""
    model = nn.Sequential(nn.Linear(6, 50), nn.Dropout(p), nn.Linear(50, 3)).train()
    x = torch.randn(7, 6, requires_grad=True)  # 7*50 = 350 mask elements, not a multiple of 8
    plain, trimmed, stats = plain_and_trimmed(model, (x,), masks=masks)
    assert stats["bitpacked"] == 1
    assert_identical(plain, trimmed)


class _FusedDropout(nn.Module):
    """Dropout as CUDA's nn.Dropout runs it in training: native_dropout, which saves a bool keep-mask."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        return torch.native_dropout(x, self.p, self.training)[0]


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("masks", ["bits", "bytes"])
@pytest.mark.parametrize("with_numpy", [True, False], ids=["numpy", "torch-ops"])
def test_a_bool_dropout_mask_becomes_bits(monkeypatch, p, masks, with_numpy):
    """native_dropout's bool keep-mask (GA403) is kept as bits by default, read back as the same bools:
    gradients bit-identical, 7/8 of the mask freed; masks="bytes" leaves it as it is. The torch path
    (a GPU's) packs by a word multiplication and a copy, and unpacks by a shift and a mask: no select."""
    import gradaudit.trimming.codec as codec

    if not with_numpy:
        monkeypatch.setattr(codec, "numpy", None)
    # 7 x 50 = 350 mask elements, not a multiple of 8; the frozen last layer keeps no input of its own
    model = nn.Sequential(nn.Linear(6, 50), _FusedDropout(p), nn.Linear(50, 3).requires_grad_(False)).train()
    x = torch.randn(7, 6)
    plain, trimmed, stats = plain_and_trimmed(model, (x,), masks=masks)
    assert_identical(plain, trimmed)
    assert stats["bitpacked"] == (1 if masks == "bits" else 0)
    figures = compare(model, (x,), masks=masks)
    # the bool mask holds 350 bytes; its bits ceil(350 / 8) = 44
    assert figures["held_before"] - figures["held_after"] == (350 - 44 if masks == "bits" else 0), figures
    if masks == "bits" and not with_numpy:
        steady = steady_ops_added(model, x)
        kernels = [name for name in steady if name not in ("as_strided", "detach", "view", "empty_strided", "lift_fresh",
                                                           "arange", "full", "slice", "select", "empty", "zeros")]
        # (350 is not a multiple of 8: the bools are first copied into a zeroed buffer of whole words,
        # multiplied in place there; the save itself is read only)
        assert sorted(kernels) == ["bitwise_and", "bitwise_right_shift", "clone", "copy_", "mul_"], steady


def test_checking_a_mask_reads_nothing_back_value_by_value():
    """A mask whose two values trim checks (the first forward; a module that is not a stock dropout in
    every forward) is checked on the device, and both answers (its scale, and whether it holds only
    +0.0 and that scale) come back to the host together: no .item() or bool() per answer (on a GPU each
    was a synchronisation; now one copy)."""
    from gradaudit.trimming.codec import scaled_mask

    mask = torch.tensor([0.0, 2.0, 2.0, 0.0, 2.0]).repeat(20)
    with OpNames() as reads:
        bits, scale = scaled_mask(mask)
    assert scale == 2.0 and not {"_local_scalar_dense", "is_nonzero", "item", "equal"} & set(reads.names), reads.names
    for not_a_mask in (torch.tensor([0.0, 2.0, 1.0]), torch.tensor([-0.0, 2.0]), torch.tensor([0.0, -2.0]),
                       torch.tensor([0.0, float("nan")]), torch.zeros(4)):
        assert scaled_mask(not_a_mask) is None, not_a_mask


def test_a_mask_that_is_not_zero_or_one_value_is_kept():
    """A multiplication inside a module named Dropout whose factor is not a 0/c mask stays as is."""

    class Dropout(nn.Module):  # same class name as torch's; not a mask
        def forward(self, x):
            return x * torch.linspace(0.5, 2.0, x.shape[-1])

    model = nn.Sequential(nn.Linear(4, 5), Dropout(), nn.Linear(5, 2))
    plain, trimmed, stats = plain_and_trimmed(model, (torch.randn(3, 4),))
    assert stats["bitpacked"] == 0
    assert_identical(plain, trimmed)


def test_a_relu_result_kept_by_its_consumer_is_not_bit_packed():
    """A trainable layer after the ReLU keeps the result: packing it would add bits and free nothing."""
    model = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 2))
    x = torch.randn(5, 7)
    with trim(model) as handle:
        model(x)
    assert handle.stats["bitpacked"] == 0  # decided one boundary later, after the consumer saved it

    class LateConsumer(nn.Module):
        """The ReLU result is saved again two modules later (a skip connection)."""

        def __init__(self):
            super().__init__()
            self.a, self.relu, self.b, self.c = nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 9), nn.Linear(9, 9)
            self.b.weight.requires_grad_(False)

        def forward(self, x):
            r = self.relu(self.a(x))
            return self.c(self.b(r) + r)  # c saves b(r) + r, not r; so r is saved only by the ReLU...

    class SkipSaved(LateConsumer):
        def forward(self, x):
            r = self.relu(self.a(x))
            y = self.b(r)
            return self.c(y) * r  # ...here the multiplication saves r after b and c have run

    for cls, packed, given_back in ((LateConsumer, 1, 0), (SkipSaved, 1, 1)):
        model = cls()
        plain, trimmed, stats = plain_and_trimmed(model, (x.clone().requires_grad_(True),))
        assert (stats["bitpacked"], stats["unpacked_again"]) == (packed, given_back), cls.__name__
        assert_identical(plain, trimmed)


def test_bitpacked_channels_last_keeps_layout_and_gradients():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 4, 3))
    model = model.to(memory_format=torch.channels_last).requires_grad_(False)
    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last).requires_grad_(True)
    plain, trimmed, stats = plain_and_trimmed(model, (x,))
    assert stats["bitpacked"] == 1
    assert stats["dropped"] == 2  # the pool's input (= the ReLU result) and the second conv's input
    assert_identical(plain, trimmed)


@pytest.mark.parametrize("shape", [(2, 1, 3, 3), (4, 6, 9, 9)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_dropped_batch_norm_input_keeps_the_kernel_path(shape, channels_last):
    """Eval BN, frozen weight, trainable bias: the input is not needed, but CPU batch norm picks its
    reduction order (so the bias gradient's last bit) from the input's layout. Found by the property
    test with a zero-stride placeholder; the placeholder now has the saved strides."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(shape[1], shape[1], 3, padding=1, bias=False), nn.BatchNorm2d(shape[1]),
                          nn.Flatten(), nn.Linear(shape[1] * shape[2] * shape[3], 3)).eval()
    model[1].weight.requires_grad_(False)
    model[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(shape)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    plain, trimmed, stats = plain_and_trimmed(model, (x,))
    assert stats["dropped"] == 3  # BN's input, and its batch mean and inverse std (unused in eval)
    assert_identical(plain, trimmed)


# ----------------------------------------------------------------------------------------------
# torchvision and transformers models in the selective-differentiation scenarios


# ResNet-18 in every scenario; the others in two each, to keep the file's runtime modest
TORCHVISION_CASES = [("resnet18", s) for s in SCENARIOS] + [
    ("mobilenet_v3_small", "input-only-bn-eval"), ("mobilenet_v3_small", "norm-only"),
    ("efficientnet_b0", "input-only"), ("efficientnet_b0", "surgical"),
    ("vgg11_bn", "all-trainable"), ("vgg11_bn", "input-only-bn-eval"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,scenario", TORCHVISION_CASES)
def test_torchvision_gradients_bit_identical(name, scenario, torchvision):
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    apply_scenario(model, scenario, x)
    plain, trimmed, stats = plain_and_trimmed(model, (x,))
    assert_identical(plain, trimmed)
    # every case here has something to trim (all-trainable VGG: the max-pool inputs), so the
    # comparison above is not between two untouched runs
    assert stats["dropped"] + stats["bitpacked"] > 0


def test_resnet_frees_exactly_what_the_audit_reclaims_and_lowers_the_peak(torchvision):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    apply_scenario(model, "input-only-bn-eval", x)
    report = gradaudit.audit(model, x)
    measured = compare(model, x)
    # held_before is the independent tracker's figure for what autograd holds: the audit agrees
    assert measured["held_before"] == report.saved_bytes
    assert measured["held_before"] - measured["held_after"] == report.reclaimable_with_bitpacking_bytes
    # in eval with nothing trainable, almost all is reclaimable: conv inputs, BN inputs, pool inputs
    assert report.reclaimable_with_bitpacking_bytes > 0.8 * report.saved_bytes
    assert measured["peak_after"] < measured["peak_before"]


def test_resnet_channels_last_gradients_bit_identical(torchvision):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64).to(memory_format=torch.channels_last)
    apply_scenario(model, "input-only-bn-eval", x)
    plain, trimmed, stats = plain_and_trimmed(model, (x,))
    assert_identical(plain, trimmed)
    assert stats["bitpacked"] > 0


def _bert(hidden_act: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, hidden_act=hidden_act,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.BertModel(config)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("hidden_act", ["gelu", "relu"])
def test_transformers_bert_gradients_bit_identical(scenario, hidden_act):
    model = _bert(hidden_act)
    embeds = torch.randn(2, 16, 32)
    apply_scenario(model, scenario, embeds)
    inputs = {"inputs_embeds": embeds, "attention_mask": torch.ones(2, 16, dtype=torch.long)}
    plain, trimmed, stats = plain_and_trimmed(model, inputs)
    assert_identical(plain, trimmed)
    if hidden_act == "relu" and scenario != "all-trainable":
        # the ReLU result feeds a linear layer with a frozen weight, which does not save it
        assert stats["bitpacked"] - stats["unpacked_again"] > 0


def test_transformers_bert_frees_exactly_what_the_audit_reclaims():
    """ReLU results and nn.Dropout masks (train mode): trim and audit agree save by save."""
    model = _bert("relu").train()
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.requires_grad_(True)
    inputs = {"input_ids": torch.randint(0, 64, (2, 16))}
    report = gradaudit.audit(model, inputs)
    measured = compare(model, inputs)
    assert report.reclaimable_with_bitpacking_bytes > 0
    assert measured["held_before"] - measured["held_after"] == report.reclaimable_with_bitpacking_bytes


# ----------------------------------------------------------------------------------------------
# without the node-creation hook (torch 2.11 to 2.13): nodes found by walking the graph


def _without_node_hook(monkeypatch):
    monkeypatch.setitem(torchapi.FEATURES, "node creation hook", False)


@pytest.mark.parametrize("scenario", ["input-only-bn-eval", "surgical"])
def test_without_the_node_hook_resnet_holds_and_peaks_as_with_it(monkeypatch, torchvision, scenario):
    """Where torch has no node-creation hook, trim finds each module's nodes by walking back from the
    tensors at its boundaries and attributes them by the module that packed their saves: the same
    decisions at the same boundaries, so the same held and peak bytes (the independent tracker's)
    and bit-identical gradients."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    apply_scenario(model, scenario, x)
    with_hook = compare(model, x)
    _without_node_hook(monkeypatch)
    assert compare(model, x) == with_hook
    assert with_hook["held_after"] < with_hook["held_before"]
    plain, trimmed, stats = plain_and_trimmed(model, (x,))
    assert_identical(plain, trimmed)
    assert stats["dropped"] > 0 and stats["bitpacked"] > 0


def test_without_the_node_hook_bert_frees_exactly_what_the_audit_reclaims(monkeypatch):
    """ReLU results and dropout masks found by the walk: every one the audit calls reclaimable."""
    model = _bert("relu").train()
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.requires_grad_(True)
    inputs = {"input_ids": torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)),
              "attention_mask": torch.tensor([[1] * 16, [1] * 10 + [0] * 6])}
    report = gradaudit.audit(model, inputs)
    with_hook = compare(model, inputs)
    _without_node_hook(monkeypatch)
    without = compare(model, inputs)
    assert without == with_hook
    assert without["held_before"] - without["held_after"] == report.reclaimable_with_bitpacking_bytes > 0
    plain, trimmed, _ = plain_and_trimmed(model, inputs)
    assert_identical(plain, trimmed)


def test_without_the_node_hook_a_node_no_boundary_reaches_is_decided_at_the_end(monkeypatch):
    """A node whose output reaches neither its own module's output nor the next module's input is
    found from the model's output: its unneeded save is still dropped once the forward ends."""
    class Side(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3).requires_grad_(False)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            pooled = F.max_pool2d(x * 2, 2)  # made in the root, used only after the conv
            h = self.conv(x).mean((2, 3))
            return self.head(h) + pooled.mean()

    _without_node_hook(monkeypatch)
    model, x = Side(), torch.randn(2, 3, 8, 8, requires_grad=True)
    report = gradaudit.audit(model, x)
    measured = compare(model, x)
    assert measured["held_before"] - measured["held_after"] == report.reclaimable_with_bitpacking_bytes > 0
    plain, trimmed, _ = plain_and_trimmed(model, (x,))
    assert_identical(plain, trimmed)


# ----------------------------------------------------------------------------------------------
# the handle


def _hook_state(model: nn.Module) -> list:
    return [(dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks),
             dict(m._forward_hooks_always_called), dict(m._forward_hooks_with_kwargs),
             dict(m._forward_pre_hooks_with_kwargs)) for m in model.modules()]


def test_remove_restores_the_model_exactly():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    model[0].requires_grad_(False)
    model.register_forward_hook(lambda *args: None)  # a user's hook stays
    before_hooks = _hook_state(model)
    before_state = copy.deepcopy(model.state_dict())
    flags = [p.requires_grad for p in model.parameters()]
    handle = gradaudit.trim(model)
    assert handle.installed and _hook_state(model) != before_hooks
    handle.remove()
    assert not handle.installed
    assert _hook_state(model) == before_hooks
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(torch.equal(a, b) for a, b in zip(before_state.values(), model.state_dict().values()))
    # after remove, autograd stores plain tensors again: nothing of gradaudit's is in the graph
    out = model(torch.randn(1, 3, 8, 8))
    assert isinstance(out.grad_fn._raw_saved_result.data, torch.Tensor)
    handle.remove()  # twice is harmless


def test_context_manager_and_double_trim():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with gradaudit.trim(model) as handle:
        with pytest.raises(GradauditError, match="already trimmed"):
            gradaudit.trim(model)
        model(torch.randn(2, 4))
        assert handle.stats["bitpacked"] == 1
    assert not handle.installed
    gradaudit.trim(model).remove()  # can be trimmed again once removed


def test_trimmed_submodule_inside_a_trimmed_model():
    """The outer handle's session covers the inner model; the inner one stands aside."""
    model, x = _frozen_blocks()
    plain = gradients(model, (x,))
    with trim(model.stages[1]) as inner:
        inner_only = gradients(model, (x,))
        inner_stats = inner.stats
        assert inner_stats["dropped"] > 0
        with trim(model) as outer:
            both = gradients(model, (x,))
        assert inner.stats == inner_stats  # stood aside
        assert outer.stats["dropped"] > inner_stats["dropped"]
    assert_identical(plain, inner_only)
    assert_identical(plain, both)


def test_cached_decisions_follow_the_scalars_the_op_knowledge_reads():
    """Decisions are cached per node type keyed on the scalars its op knowledge declares it reads:
    the same threshold node, shapes and edges with another threshold decide apart."""
    from gradaudit.trimming import plan

    plan.KINDS.clear()  # kinds hold the cached plans
    model = nn.Sequential(nn.Linear(11, 11), nn.Threshold(0.0, 0.0))
    x = torch.randn(2, 11)
    packed = []
    with trim(model) as handle:
        for threshold in (0.0, 0.5, 0.0):
            model[1].threshold = threshold
            model(x).sum().backward()
            packed.append(handle.stats["bitpacked"])
    # threshold 0: one bit per element says x > 0; threshold 0.5 compares against 0.5: kept
    assert packed == [1, 1, 2]
    kind = next(k for k in plan.KINDS.values() if k.name == "ThresholdBackward0")
    assert kind.scalars == ("threshold",)
    model[1].threshold = 0.5
    plain, trimmed, _ = plain_and_trimmed(model, (x.clone().requires_grad_(True),))
    assert_identical(plain, trimmed)


def test_decisions_are_made_during_the_forward():
    """The peak falls: BN's unneeded input is dropped before the next module runs."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3)).eval().requires_grad_(False)
    x = torch.randn(1, 3, 12, 12, requires_grad=True)
    states = []
    with trim(model):
        def before_second_conv(module, args):
            states.append(args[0].grad_fn._raw_saved_input.data.state)  # BN's saved input
        handle = model[2].register_forward_pre_hook(before_second_conv)
        model(x)
        handle.remove()
    assert states == [1]  # dropped (the conv output is not needed by eval-mode BN with frozen affine)


# ----------------------------------------------------------------------------------------------
# composing with checkpoint, save_on_cpu, autocast and the user's hooks


class Blocks(nn.Module):
    """conv-bn-relu stages; ``wrap`` decides how the middle stage runs."""

    def __init__(self, wrap=None):
        super().__init__()
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c_in, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
            for c_in in (3, 8, 8))
        self.wrap = wrap

    def forward(self, x):
        x = self.stages[0](x)
        x = self.wrap(self.stages[1], x) if self.wrap else self.stages[1](x)
        return self.stages[2](x)


def _frozen_blocks(wrap=None, *, eval_mode=True):
    torch.manual_seed(0)
    model = Blocks(wrap).train(not eval_mode)
    model.requires_grad_(False)
    model.stages[2][0].requires_grad_(True)  # one trainable conv at the end
    return model, torch.randn(2, 3, 16, 16, requires_grad=True)


@pytest.mark.parametrize("reentrant", [False, True])
def test_composes_with_checkpoint_inside_the_model(reentrant):
    from torch.utils.checkpoint import checkpoint

    model, x = _frozen_blocks(lambda stage, x: checkpoint(stage, x, use_reentrant=reentrant))
    plain, trimmed, stats = plain_and_trimmed(model, (x,))
    assert_identical(plain, trimmed)
    assert stats["dropped"] > 0  # the stages outside the checkpoint are still trimmed


def test_a_result_a_checkpoint_keeps_is_not_bit_packed_for_nothing():
    """A non-reentrant checkpoint saves its region's inputs on no autograd node, through trim's
    hooks (they are outside the region): trim keeps them, so the ReLU result passed in stays whole
    once, and is not also bit-packed (which would add its bits and free nothing)."""
    from torch.utils.checkpoint import checkpoint

    class ReluIntoCheckpoint(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return checkpoint(self.second, torch.relu(self.first(x)), use_reentrant=False)

    torch.manual_seed(0)
    model, x = ReluIntoCheckpoint(), torch.randn(8, 16, requires_grad=True)
    model.requires_grad_(False)
    report = gradaudit.audit(model, x)
    with trim(model) as handle:
        held = held_bytes_after_forward(model, x)
    # the ReLU result, 8x16 float32: ReluBackward0's save is sign-only, the checkpoint's is needed
    assert report.saved_bytes - report.reclaimable_with_bitpacking_bytes == held == 8 * 16 * 4
    assert handle.stats["bitpacked"] == 0
    plain, trimmed, _ = plain_and_trimmed(model, (x,))
    assert_identical(plain, trimmed)


def test_composes_with_checkpoint_around_the_model():
    from torch.utils.checkpoint import checkpoint

    model, x = _frozen_blocks()
    inner = model

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    plain, trimmed, stats = plain_and_trimmed(Outer(), (x,))
    assert_identical(plain, trimmed)
    # every save inside the checkpoint is packed by checkpoint's hooks: left alone
    assert stats["dropped"] == 0 and stats["bitpacked"] == 0


def test_composes_with_save_on_cpu_inside_and_around():
    from torch.autograd.graph import save_on_cpu

    def offloaded(stage, x):
        with save_on_cpu():
            return stage(x)

    model, x = _frozen_blocks(offloaded)
    plain, trimmed, _ = plain_and_trimmed(model, (x,))
    assert_identical(plain, trimmed)

    model, x = _frozen_blocks()
    with save_on_cpu():
        plain = gradients(model, (x,))
        with trim(model) as handle:
            trimmed = gradients(model, (x,))
    assert_identical(plain, trimmed)
    assert handle.stats["dropped"] > 0 and handle.stats["bitpacked"] == 0  # outer hooks: drop only


def test_users_own_hooks_still_see_what_backward_needs():
    model, x = _frozen_blocks()
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.shape)
        return t

    def unpack(t):
        unpacked.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        plain = gradients(model, (x,))
        plain_counts = (len(packed), len(unpacked))
        packed.clear(), unpacked.clear()
        with trim(model) as handle:
            trimmed = gradients(model, (x,))
    assert_identical(plain, trimmed)
    assert len(packed) == plain_counts[0]  # the user's pack still sees every save, when it happens
    # dropped saves are never unpacked: backward never asks the user's hook for them
    assert len(unpacked) == plain_counts[1] - handle.stats["dropped"]


def test_composes_with_autocast_bfloat16():
    model, x = _frozen_blocks()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, trimmed, stats = plain_and_trimmed(model, (x,))
    assert_identical(plain, trimmed)
    assert stats["dropped"] > 0 and stats["bitpacked"] > 0


def test_refuses_double_backward():
    model, x = _frozen_blocks()
    with trim(model):
        y = model(x)
    with pytest.raises(GradauditError, match="double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_refuses_when_saved_tensor_hooks_are_disabled():
    model, x = _frozen_blocks()
    with trim(model):
        with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
            with pytest.raises(GradauditError, match="disabled"):
                model(x)
        model(x)  # the failed forward left nothing installed behind


def test_audit_of_a_trimmed_model_sees_the_untrimmed_graph():
    model, x = _frozen_blocks()
    plain = gradaudit.audit(model, x)
    with trim(model):
        trimmed = gradaudit.audit(model, x)
    assert trimmed.saved_bytes == plain.saved_bytes
    assert trimmed.reclaimable_bytes == plain.reclaimable_bytes > 0
    # and says so, with what the trimmed forward holds, which the independent tracker confirms
    with trim(model):
        held = held_bytes_after_forward(model, x)
    kept = plain.saved_bytes - plain.reclaimable_with_bitpacking_bytes
    assert held == kept and any(f"= {kept} bytes" in note and "gradaudit.trim is installed" in note
                                for note in trimmed.notes)
    assert not any("gradaudit.trim" in note for note in plain.notes)


def test_compare_leaves_model_and_inputs_as_found():
    model, x = _frozen_blocks(eval_mode=False)
    x.grad = torch.full_like(x, 7.0)
    grad_before = x.grad
    weight = model.stages[2][0].weight
    weight.grad = torch.ones_like(weight)
    weight_grad = weight.grad
    state = copy.deepcopy(model.state_dict())
    result = compare(model, x)
    assert set(result) == {"held_before", "held_after", "peak_before", "peak_after"}
    assert result["held_after"] < result["held_before"]
    assert x.grad is grad_before and torch.equal(x.grad, torch.full_like(x, 7.0))
    assert weight.grad is weight_grad and torch.equal(weight.grad, torch.ones_like(weight))
    assert all(torch.equal(a, b) for a, b in zip(state.values(), model.state_dict().values()))
    assert model.training


def test_sparse_saves_are_kept():
    from tests.fixtures.functions import LinearThen, SavesSparse

    plain, trimmed, stats = plain_and_trimmed(LinearThen(SavesSparse, torch.relu), (torch.randn(2, 3),))
    assert stats["kept"] >= 1
    assert_identical(plain, trimmed)



def test_handle_forward_trims_work_that_does_not_call_the_model():
    # Lightning runs training_step, which may call only the model's submodules: the model's own hooks never
    # fire, and handle.forward() covers such a step instead
    torch.manual_seed(0)
    model = nn.Module()
    model.features = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.MaxPool1d(2))
    model.head = nn.Linear(3, 2)
    x = torch.randn(4, 6)

    def step():
        return model.head(model.features(x)).square().sum()

    step().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with trim(model) as handle:
        step().backward()  # not covered: nothing is trimmed
        assert handle.stats["dropped"] == handle.stats["bitpacked"] == 0
        model.zero_grad(set_to_none=True)
        with handle.forward(x):
            loss = step()
        loss.backward()
        # the max-pool's input dropped (it keeps its indices), the ReLU's result bit-packed
        assert handle.stats["dropped"] == 1 and handle.stats["bitpacked"] == 1, handle.stats
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    with pytest.raises(GradauditError, match="was removed"):
        with handle.forward(x):
            pass


# ----------------------------------------------------------------------------------------------
# the steady plan: decided in the first forward, applied in the next ones only where it still holds


class OpNames(TorchDispatchMode):
    """The names of the aten ops dispatched inside it, in order."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def steady_ops_added(model: nn.Module, x: torch.Tensor, **trim_options) -> list:
    """The aten ops (names, sorted) a steady trimmed forward and backward dispatch beyond a plain one."""
    def counted() -> list:
        for t in [*model.parameters(), x]:
            t.grad = None
        with OpNames() as count:
            torch.manual_seed(0)
            model(x).sum().backward()
        return count.names

    plain = counted()
    with trim(model, **trim_options) as handle:
        counted()
        steady = counted()
        assert handle.forwards == {"full": 1, "steady": 1}
    for name in plain:
        steady.remove(name)
    return sorted(steady)


class Branching(nn.Module):
    """Which op follows the frozen convolution depends on the input's values: ReLU (its result one
    bit per element) or tanh (its result needed as it is), at the same place in the graph."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3).requires_grad_(False)
        self.inner = nn.Identity()

    def forward(self, x):
        y = self.inner(self.conv(x))
        return torch.relu(y) if x.sum() > 0 else torch.tanh(y)


def test_a_branch_the_plan_did_not_see_keeps_what_it_needs():
    model = Branching()
    positive = torch.rand(2, 3, 8, 8).requires_grad_(True)
    negative = (-torch.rand(2, 3, 8, 8)).requires_grad_(True)
    plain = [gradients(model, (x,)) for x in (positive, negative, positive)]
    with trim(model) as handle:
        trimmed = []
        for x in (positive, negative, positive):
            before = handle.stats
            trimmed.append(gradients(model, (x,)))
            after = handle.stats
            trimmed_counts = after["bitpacked"] - before["bitpacked"]
            # the ReLU's result is packed where the branch is the planned one; tanh's is left alone
            assert trimmed_counts == (1 if x is positive else 0)
        assert handle.forwards == {"full": 1, "steady": 2}
    for a, b in zip(plain, trimmed):
        assert_identical(a, b)


def test_a_hook_that_replaces_an_output_changes_nothing_trim_decides():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)).requires_grad_(False)
    model[1].register_forward_hook(lambda module, args, output: output * 2)  # the user's hook
    x = torch.randn(2, 3, 10, 10).requires_grad_(True)
    plain, trimmed, stats = plain_and_trimmed(model, (x,))
    assert_identical(plain, trimmed)


def test_a_changed_requires_grad_pattern_decides_again():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    model.requires_grad_(False)
    x = torch.randn(2, 3, 10, 10).requires_grad_(True)
    with trim(model) as handle:
        gradients(model, (x,))
        gradients(model, (x,))
        assert handle.forwards == {"full": 1, "steady": 1}
        model[2].weight.requires_grad_(True)  # now the second conv's input is needed
        trimmed = gradients(model, (x,))
        assert handle.forwards == {"full": 2, "steady": 1}
        again = gradients(model, (x,))
        assert handle.forwards == {"full": 2, "steady": 2}
        model.eval()
        gradients(model, (x,))
        assert handle.forwards == {"full": 3, "steady": 2}
    model.train()
    plain = gradients(model, (x,))
    assert_identical(plain, trimmed)
    assert_identical(plain, again)


def test_a_dropout_whose_p_changed_decides_again():
    """The steady plan packs a stock dropout's mask without reading it (its value follows from p):
    a forward after p changed decides fully again, and reads the new mask's value."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.25), nn.Linear(8, 2))
    model[2].requires_grad_(False)
    x = torch.randn(4, 6)
    with trim(model) as handle:
        gradients(model, (x,))
        gradients(model, (x,))
        model[1].p = 0.5
        before = handle.stats
        trimmed = gradients(model, (x,))
        assert handle.stats["bitpacked"] == before["bitpacked"] + 1
        assert handle.forwards == {"full": 2, "steady": 1}
        again = gradients(model, (x,))
        assert handle.forwards == {"full": 2, "steady": 2}
    plain = gradients(model, (x,))
    assert_identical(plain, trimmed)
    assert_identical(plain, again)


def test_a_steady_forward_syncs_nothing_and_adds_few_ops():
    """The steady forward adds, per save it changes, only the operations of its pack and unpack
    hooks, and none reads a value back to the host (a dropout mask is packed without checking it)."""
    # a frozen conv's input (the trainable conv's output) dropped: one unfilled tensor in backward,
    # and two detaches autograd itself makes for a save with hooks (one as register_hooks hands
    # the tensor to the pack hook, one as it attaches what the unpack hook returns to the graph)
    drop = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3).requires_grad_(False))
    assert steady_ops_added(drop, torch.randn(2, 3, 10, 10)) == ["detach", "detach", "empty_strided"]
    # a dropout's keep-mask before a frozen linear layer: bits (numpy packs them into a
    # torch-allocated byte tensor), and in backward the values from the bits: no .item(), .all()
    # or any other host read
    mask = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 2).requires_grad_(False))
    added = steady_ops_added(mask, torch.randn(4, 6))
    syncs = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "item"}
    assert not syncs & set(added) and "ne" in added, added
    # measured on 2.14.1 (11): the flat view, the comparison, the bytes (numpy reads and writes
    # torch's memory through detached views); in backward the values from a kept table and their
    # layout; and autograd's own detaches around the hooks
    assert len(added) <= 12, added


def test_bits_in_torch_operations_take_three_elementwise_kernels_each_way(monkeypatch):
    """Without numpy (as on a GPU, where each operation is a kernel launch and a pass over memory), a
    ReLU's result before a frozen conv is packed by a conversion to bool (result != 0: a ReLU's result
    is never negative, so that is result > 0), a multiplication of each 8 bools read as one word, and
    a copy of each word's top byte; unpacked by a shift, a mask and a conversion back: every one
    elementwise (on an H200 a row-wise sum took 4x, and a gather from a kept table 13x,
    the time of these; benchmarks/gpu_check.py --sections codec), and no table made per save."""
    import gradaudit.trimming.codec as codec

    monkeypatch.setattr(codec, "numpy", None)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3)).requires_grad_(False)
    steady = steady_ops_added(model, torch.randn(2, 3, 8, 8, requires_grad=True))
    # not kernels: views, autograd's detaches, allocations, and the constants made from Python
    # numbers on the CPU (kept per GPU: codec._shifts, codec._constant)
    kernels = [name for name in steady if name not in ("as_strided", "detach", "view", "empty_strided", "lift_fresh",
                                                       "arange", "full", "slice", "select", "empty")]
    # (the multiplication in place on the conversion's own bools: the save itself is never written)
    assert sorted(kernels) == ["_to_copy", "_to_copy", "bitwise_and", "bitwise_right_shift", "clone", "mul_"], steady


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_a_byte_mask_costs_one_operation_each_way_in_the_saves_own_layout(layout):
    """masks="bytes" converts a ReLU's result itself to bools (result != 0, which for a result never
    negative is result > 0; the bools come in its layout) and back in backward (the values come in
    that layout too): one dispatch each way and no view, on a GPU two launches and a few microseconds
    of host time per save, the same two conversions on meta and the CPU; gradients bit-identical."""
    def build(device):
        with torch.device(device):
            model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3)).requires_grad_(False)
            x = torch.randn(2, 3, 8, 8).to(memory_format=layout).requires_grad_()
        return model.to(memory_format=layout), x

    # beside autograd's detaches and the first conv's input dropped (its stand-in, empty_strided)
    beside = ("detach", "lift_fresh", "full", "empty_strided")
    assert [name for name in steady_ops_added(*build("meta"), masks="bytes") if name not in beside] == \
        ["_to_copy", "_to_copy"]
    model, x = build("cpu")
    steady = steady_ops_added(model, x, masks="bytes")
    assert [name for name in steady if name not in beside] == ["_to_copy", "_to_copy"], steady
    plain = gradients(model, (x,))
    with trim(model, masks="bytes"):
        gradients(model, (x,))
        trimmed = gradients(model, (x,))
    assert_identical(plain, trimmed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_bytes_unpack_on_the_cpu_to_the_values_the_select_gives(dtype):
    """The CPU's conversion of a byte mask gives the values, strides and dtype the select gives on a
    GPU (run here on meta for the layout, and as torch.where on the CPU for the values), for a mask
    whose set byte stands for 0.0 (a ReLU's x <= 0) and for a scaled one (dropout's keep-mask, p=0.1
    and p=0.5), contiguous and channels-last; the values keep the mask's layout (no view) and are the
    only tensor unpacking makes (the rest in place: a backward's peak as with the select)."""
    from types import SimpleNamespace
    from gradaudit.trimming import codec

    generator = torch.Generator().manual_seed(0)
    values = torch.randn(2, 3, 4, 5, generator=generator).to(dtype)
    for layout in (torch.contiguous_format, torch.channels_last):
        x = values.to(memory_format=layout)
        for scale, mask in ((-1.0, x <= 0), (1.0, x > 0), (1 / 0.9, x != 0), (2.0, x > 0.5)):
            scale = torch.tensor(scale, dtype=dtype).item()  # the mask's own value, as read off it
            box = SimpleNamespace(payload=mask, scale=scale, shape=x.shape, stride=x.stride(), dtype=dtype)
            with OpNames() as ops:
                unpacked = codec.unpack_bytes(box)
            assert [name for name in ops.names if not name.endswith("_")] == ["_to_copy"], ops.names
            set_value, other = (0.0, 1.0) if scale == -1.0 else (scale, 0.0)
            expected = torch.where(mask, torch.tensor(set_value, dtype=dtype), torch.tensor(other, dtype=dtype))
            assert unpacked.dtype == dtype and unpacked.stride() == x.stride()
            assert torch.equal(unpacked, expected) and unpacked._base is None
            assert not torch.signbit(unpacked).any()  # +0.0 where the mask says 0, as the save held
            on_meta = codec.unpack_bytes(SimpleNamespace(**{**vars(box), "payload": mask.to("meta")}))
            assert on_meta.stride() == unpacked.stride() and on_meta.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_bits_in_torch_operations_equal_numpys_bits_and_the_tables_values(monkeypatch, dtype):
    """The torch path (a GPU's) packs the bytes numpy's packbits makes, for every count (a partial
    last byte included) and a mask starting off a word's boundary, from a mask it may overwrite
    (scratch) too; and unpacks the values a kept table's rows give, for a mask whose set bit stands
    for 0.0, for 1.0 (a ReLU's x != 0: a conversion) and for a scaled one."""
    import numpy
    import gradaudit.trimming.codec as codec

    generator = torch.Generator().manual_seed(0)
    for count in (1, 7, 8, 9, 63, 64, 65, 1000, 4104):
        for offset in (0, 3, 8):
            mask = (torch.rand(count + offset, generator=generator) < 0.5)[offset:]
            expected = torch.from_numpy(numpy.packbits(mask.numpy(), bitorder="little"))
            assert torch.equal(codec._pack_bits_with_torch(mask), expected), (count, offset)
            assert torch.equal(codec._pack_bits_with_torch(mask.clone(), scratch=True), expected), (count, offset)

    class Box:
        pass

    for scale in (-1.0, 1.0, torch.tensor(1 / 0.9, dtype=dtype).item()):
        box = Box()
        box.payload = torch.randint(0, 256, (37,), dtype=torch.uint8, generator=generator)
        box.scale, box.dtype = scale, dtype
        table = codec._bit_table(scale, dtype, box.payload.device)
        expected = torch.index_select(table, 0, box.payload.int()).view(-1)
        values = codec._unpack_with_torch(box)  # a row of 8 per byte, read in memory order
        assert values.dtype == dtype and torch.equal(values.view(-1), expected)


def test_kernels_option_is_checked_up_front(monkeypatch):
    """kernels="triton" only where there are bits to pack and Triton to pack them; an unknown value
    is an error."""
    from gradaudit.trimming import fused

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(GradauditError, match="choose one of 'torch', 'triton'"):
        trim(model, kernels="cuda")
    with pytest.raises(GradauditError, match="masks='bytes' there are none to pack"):
        trim(model, masks="bytes", kernels="triton")
    with pytest.raises(GradauditError, match="bitpack=False"):
        trim(model, bitpack=False, kernels="triton")
    monkeypatch.setattr(fused, "installed", lambda: False)
    with pytest.raises(GradauditError, match="needs Triton"):
        trim(model, kernels="triton")
    with trim(model) as handle:
        assert handle.kernels == "torch"


def test_fused_triton_kernels_give_the_torch_paths_bytes_and_identical_gradients():
    """kernels="triton", run by Triton's interpreter on the CPU in a process of its own
    (tests/fixtures/fused_interpreted.py): for every float dtype, the three comparisons and counts
    with a partial last byte, special values included (NaN, -0.0, subnormals, infinities), the
    fused kernel's bytes equal the torch path's and its unpacked values the torch path's for each
    scale; trimming a model with ReLU, LeakyReLU and a stock dropout gives
    gradients bit-identical to plain ones in the forward decided fully and a steady one, changes the
    saves kernels="torch" changes, and runs the fused kernels for every bit-packed save."""
    import json
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("triton")  # the test extra installs it where it ships (Linux x86-64)
    script = pathlib.Path(__file__).parent / "fixtures" / "fused_interpreted.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    # 4 dtypes x 4 counts x 3 comparisons
    assert found["codec"] == {"checked": 48, "packs_differing": [], "unpacks_differing": []}
    runs = found["trim"]
    assert runs["torch"]["identical"] and runs["triton"]["identical"]
    assert runs["torch"]["stats"] == runs["triton"]["stats"]
    assert runs["torch"]["forwards"] == runs["triton"]["forwards"] == {"full": 1, "steady": 1}
    packed = runs["triton"]["stats"]["bitpacked"]
    assert packed == 6  # ReLU, LeakyReLU, the dropout's mask, in each of the two forwards
    assert runs["fused calls with torch kernels"] == {"pack": 0, "unpack": 0}
    assert runs["fused calls"] == {"pack": packed, "unpack": packed}


def test_masks_as_bytes_hold_one_byte_per_element_and_cost_one_operation_each_way():
    """masks="bytes": a frozen conv after a ReLU in eval, input gradient: the ReLU's result (2*4*8*8 =
    512 float32 elements, 2048 bytes) is held as 512 bools; packing is one conversion to bool,
    unpacking one conversion back (on meta too: the test above)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3)).requires_grad_(False)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    figures = {masks: compare(model, x, masks=masks) for masks in ("bits", "bytes")}
    # held: the ReLU's result packed (the second conv's input is that result: dropped), the first
    # conv's input is x (alive anyway): bits 512 / 8 = 64 bytes, bools 512 bytes
    assert figures["bits"]["held_after"] == 64 and figures["bytes"]["held_after"] == 512
    assert figures["bytes"]["held_before"] == 2048

    steady = steady_ops_added(model, x, masks="bytes")
    kernels = [name for name in steady if name not in ("as_strided", "detach", "view")]
    # the conversion to bools and back; the second conv's input dropped: one unfilled tensor
    assert kernels == ["_to_copy", "_to_copy", "empty_strided"], steady


def test_masks_takes_auto_bits_or_bytes_and_plans_count_each():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2).requires_grad_(False))
    x = torch.randn(3, 4)
    with pytest.raises(GradauditError, match="choose one of 'auto', 'bits', 'bytes'"):
        trim(model, masks="bit")
    # the ReLU's result (3 x 4 float32, 48 B) is read by its backward as a sign, and the frozen
    # Linear's save of it is dropped: bits keep 12 / 8 -> 2 B of it, bools 12 B; a plan follows the
    # installed trim's masks, and the default (auto) keeps bits on the CPU
    for masks, form, held in (("bytes", "bytes", 12), ("bits", "bits", 2), ("auto", "bits", 2)):
        with trim(model, masks=masks) as handle:
            assert handle.masks == masks and handle.masks_on("cpu") == form
            planned = gradaudit.plan(model, x, 10**9, measure_peak=False)
        assert (planned.masks, planned.unplanned_held_bytes) == (form, held)


def test_auto_masks_are_bits_on_the_cpu_and_bytes_on_a_gpu():
    """masks="auto" (trim's default) by device: bits where packing is one numpy loop beside slow kernels
    (the CPU; meta, which runs none), bytes on a GPU (one kernel each way where bits take more), bits
    there too with the fused Triton kernels."""
    from gradaudit.trimming.codec import mask_form

    assert [mask_form("auto", d) for d in ("cpu", "meta", "cuda", "xpu")] == ["bits", "bits", "bytes", "bytes"]
    assert mask_form("auto", "cuda", "triton") == "bits"
    assert [mask_form(m, "cuda") for m in ("bits", "bytes")] == ["bits", "bytes"]
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3)).requires_grad_(False)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    # the CPU trim's default holds what bits hold (the test above: the ReLU's 512 elements as 64 bytes)
    assert compare(model, x)["held_after"] == compare(model, x, masks="bits")["held_after"] == 64
    with trim(model) as handle:
        assert (handle.masks, handle.masks_on("cpu"), handle.masks_on("cuda")) == ("auto", "bits", "bytes")


def test_a_plan_for_a_gpu_counts_byte_masks_by_default():
    """A plan with trim for target="cuda" (the model on meta) counts what trim's default keeps there, a
    bool per element of the ReLU's result (2 x 4 x 8 x 8 = 512 elements: 512 B, the second conv's save of
    it dropped); for the CPU target, bits (512 / 8 = 64 B); an explicit masks= is counted as given."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3)).requires_grad_(False)
        x = torch.randn(2, 3, 8, 8, requires_grad=True)
    found = {(target, masks): gradaudit.plan(model, x, 10**9, trim=True, target=target, masks=masks,
                                             measure_peak=False)
             for target, masks in (("cuda", None), ("cpu", None), ("cuda", "bits"), ("cpu", "bytes"))}
    assert {key: (p.masks, p.unplanned_held_bytes) for key, p in found.items()} == {
        ("cuda", None): ("bytes", 512), ("cpu", None): ("bits", 64),
        ("cuda", "bits"): ("bits", 64), ("cpu", "bytes"): ("bytes", 512)}


# ----------------------------------------------------------------------------------------------
# a save modified in place after it was saved: backward raises as plain autograd does, never reads
# the new values (autograd checks a saved tensor's version only where no hook packed it)

class _SquareThenShift(nn.Module):
    """z = y * y saves y (both factors); y is then modified in place: plain backward raises."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        y = self.linear(x)
        z = y * y
        y.add_(1.0)
        return z


class _ReluThenShift(nn.Module):
    """A ReLU's result (which trim packs) shifted in place inside the same call, when ``modify``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.modify = False

    def forward(self, x):
        y = F.relu(self.linear(x))
        out = y * 2.0  # (saves no tensor; the output's node still leads to relu's, which saved y)
        if self.modify:
            y.sub_(0.3)  # some results turn negative: a sign pattern other than relu's
        return out


def _backward_error(model: nn.Module, x: torch.Tensor) -> str:
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        model(x).sum().backward()
    return str(raised.value)


def test_a_kept_save_modified_in_place_raises_in_backward_as_without_trim():
    model, x = _SquareThenShift(), torch.randn(5, 3)
    _backward_error(model, x)
    with trim(model) as handle:
        # the forward that decides keeps y (the multiplication reads it); before this check backward
        # read y + 1 and gave a gradient, silently wrong
        message = _backward_error(model, x)
        assert "gradaudit.trim" in message and "expected version 0" in message
        assert handle.forwards["full"] == 1


@pytest.mark.parametrize("masks", ["bits", "bytes"])
def test_a_packed_save_modified_in_place_before_it_is_packed_raises_as_without_trim(masks):
    """In the forward that decides, the ReLU's result is packed at the next module boundary, after the
    shift: it is kept and backward raises. In a steady forward planned without the shift (a branch
    the plan did not see), it is packed at the module's end, after the shift: kept, and backward
    raises too; with no shift the gradients stay bit-identical."""
    model = nn.Sequential(_ReluThenShift(), nn.Linear(4, 2).requires_grad_(False))
    x = torch.randn(6, 4)
    model[0].modify = True
    _backward_error(model, x)
    with trim(model, masks=masks):
        _backward_error(model, x)
    model[0].modify = False
    plain = gradients(model, (x,))
    with trim(model, masks=masks) as handle:
        gradients(model, (x,))  # decides: the result is packed
        model[0].modify = True
        _backward_error(model, x)
        model[0].modify = False
        trimmed = gradients(model, (x,))
        assert handle.forwards == {"full": 1, "steady": 2}, handle.forwards
        assert handle.stats["bitpacked"] >= 2
    assert_identical(plain, trimmed)
