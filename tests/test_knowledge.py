"""The op knowledge tied to the installed torch and to the rules.

1. Every declared node type exists in the installed torch, and on a generated case of it, for every
   pattern of which inputs need a gradient, its static verdicts equal the proof's (both ways: no
   claim of "not needed" the proof refutes, and no "needed" the proof shows to be unread).
   Nodes only CUDA makes (cuDNN batch norm, fused attention) are built on meta and checked
   statically; the proof of cuDNN batch norm runs where a GPU is.
2. Every held activation the op knowledge leaves unneeded or bit-packable is claimed by a rule,
   so no byte of ``reclaimable_bytes`` is without a finding.
3. The declaration API: user declarations for a custom autograd.Function reach the audit, the
   proof's hints and ``trim``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradaudit
from gradaudit.knowledge import Bit, Read, Reads, declaration, declarations, declared_ops
from gradaudit.knowledge.registry import forget
from gradaudit.records import NEEDED, NOT_NEEDED, SIGN_ONLY, UNKNOWN
from gradaudit.rules import all_rules
from gradaudit.torchapi.autograd import node_type_exists


def _float(*shape):
    return lambda: torch.randn(*shape)


def _const(value):
    return lambda: value


def _buffer(make):
    """An input passed as it is, like a module's buffer (alive anyway: its saves cost nothing)."""
    def factory():
        t = make()
        t.case_buffer = True
        return t
    return factory


def _library(module, name):
    """``module.name`` of an optional library; skips the test where the library is not installed."""
    return getattr(pytest.importorskip(module), name)


def _softmax_data(x):
    # the softmax backward's own node, recorded by differentiating it with create_graph
    y = torch.softmax(x, -1)
    (grad,) = torch.autograd.grad(y, x, torch.ones_like(y), create_graph=True)
    return grad


# node -> (function of the inputs, input factories, inputs that may require grad (positions)).
# The function receives copies of the inputs (activations, not the caller's tensors: saves of
# the caller's inputs are free and never proven).
CASES = {
    "ConvolutionBackward0": (lambda x, w: F.conv2d(x, w), [_float(2, 3, 6, 6), _float(4, 3, 3, 3)], (0, 1)),
    "NativeBatchNormBackward0[training=True]": (
        lambda x, w, b, mean, var: F.batch_norm(x, mean, var, w, b, training=True),
        [_float(4, 3, 5, 5), _float(3), _float(3), _buffer(_float(3)), _buffer(lambda: torch.rand(3) + 0.5)],
        (0, 1, 2)),
    "NativeBatchNormBackward0[training=False]": (
        lambda x, w, b, mean, var: F.batch_norm(x, mean, var, w, b, training=False),
        [_float(4, 3, 5, 5), _float(3), _float(3), _buffer(_float(3)), _buffer(lambda: torch.rand(3) + 0.5)],
        (0, 1, 2)),
    "MaxPool2DWithIndicesBackward0": (lambda x: F.max_pool2d(x, 2), [_float(2, 3, 6, 6)], (0,)),
    "MaxPool3DWithIndicesBackward0": (lambda x: F.max_pool3d(x, 2), [_float(1, 2, 4, 4, 4)], (0,)),
    "ReluBackward0": (torch.relu, [_float(4, 8)], (0,)),
    "LeakyReluBackward0": (F.leaky_relu, [_float(4, 8)], (0,)),
    "LeakyReluBackward1": (lambda x: F.leaky_relu(x * 1, inplace=True), [_float(4, 8)], (0,)),
    "ErfBackward0": (torch.erf, [_float(4, 8)], (0,)),
    "BinaryCrossEntropyWithLogitsBackward0": (F.binary_cross_entropy_with_logits, [_float(4, 8), lambda: torch.rand(4, 8)],
                                              (0, 1)),
    "AddcmulBackward0": (lambda s, a, b: torch.addcmul(s, a, b, value=0.5), [_float(4, 8)] * 3, (0, 1, 2)),
    "GridSampler2DBackward0": (lambda i, g: F.grid_sample(i, g, align_corners=False),
                               [_float(1, 2, 4, 4), lambda: torch.rand(1, 3, 3, 2) * 2 - 1], (0, 1)),
    "ThresholdBackward0[threshold=0]": (lambda x: F.threshold(x, 0.0, 0.0), [_float(4, 8)], (0,)),
    "ThresholdBackward0": (lambda x: F.threshold(x, 0.5, -1.0), [_float(4, 8)], (0,)),
    "ThresholdBackward1": (lambda x: F.threshold(x * 1, 0.5, -1.0, inplace=True), [_float(4, 8)], (0,)),
    "EluBackward1": (lambda x: F.elu(x * 1, inplace=True), [_float(4, 8)], (0,)),
    "CeluBackward1": (lambda x: F.celu(x * 1, alpha=0.5, inplace=True), [_float(4, 8)], (0,)),
    "IndexPutBackward0[accumulate=False]": (lambda x, v: x.index_put((torch.tensor([0, 2]),), v),
                                            [_float(4, 3), _float(2, 3)], (0, 1)),
    "IndexFillBackward0": (lambda x: x.index_fill(0, torch.tensor([0, 2]), 0.0), [_float(4, 3)], (0,)),
    "MulBackward0": (torch.mul, [_float(4, 8), _float(4, 8)], (0, 1)),
    "AddmmBackward0": (torch.addmm, [_float(3, 5), _float(3, 4), _float(4, 5)], (0, 1, 2)),
    "MmBackward0": (torch.mm, [_float(3, 4), _float(4, 5)], (0, 1)),
    "BmmBackward0": (torch.bmm, [_float(2, 3, 4), _float(2, 4, 5)], (0, 1)),
    # two groups of rows (0-2 and 3-7), one 8x8 matrix each; rows of 32 bytes (the kernel wants 16-byte strides)
    "GroupedMmBackward0": (lambda a, b, offs: torch._grouped_mm(a, b, offs=offs),
                           [_float(8, 8), _float(2, 8, 8), _const(torch.tensor([3, 8], dtype=torch.int32))], (0, 1)),
    "TopkBackward0": (lambda x: torch.topk(x, 2).values, [_float(4, 6)], (0,)),
    "SortBackward0": (lambda x: torch.sort(x, 1).values, [_float(4, 6)], (0,)),
    "AddbmmBackward0": (torch.addbmm, [_float(3, 5), _float(2, 3, 4), _float(2, 4, 5)], (0, 1, 2)),
    "BaddbmmBackward0": (torch.baddbmm, [_float(2, 3, 5), _float(2, 3, 4), _float(2, 4, 5)], (0, 1, 2)),
    "DivBackward0": (torch.div, [_float(4, 8), lambda: torch.rand(4, 8) + 0.5], (0, 1)),
    "PowBackward0": (lambda x: x ** 3, [_float(4, 8)], (0,)),
    "PowBackward1": (torch.pow, [lambda: torch.rand(4, 8) + 0.5, _float(4, 8)], (0, 1)),
    "PowBackward2": (lambda x: torch.pow(2.0, x), [_float(4, 8)], (0,)),
    "SoftmaxBackward0": (lambda x: torch.softmax(x, -1), [_float(4, 8)], (0,)),
    "SafeSoftmaxBackward0": (lambda x: torch.ops.aten._safe_softmax(x, -1), [_float(4, 8)], (0,)),
    "LogSoftmaxBackward0": (lambda x: torch.log_softmax(x, -1), [_float(4, 8)], (0,)),
    "SoftmaxBackwardDataBackward0": (_softmax_data, [_float(4, 8)], (0,)),
    "GeluBackward0": (F.gelu, [_float(4, 8)], (0,)),
    "SiluBackward0": (F.silu, [_float(4, 8)], (0,)),
    "SigmoidBackward0": (torch.sigmoid, [_float(4, 8)], (0,)),
    "TanhBackward0": (torch.tanh, [_float(4, 8)], (0,)),
    "HardtanhBackward0": (F.hardtanh, [_float(4, 8)], (0,)),
    "EluBackward0": (F.elu, [_float(4, 8)], (0,)),
    "SoftplusBackward0": (F.softplus, [_float(4, 8)], (0,)),
    "HardswishBackward0": (F.hardswish, [_float(4, 8)], (0,)),
    "HardsigmoidBackward0": (F.hardsigmoid, [_float(4, 8)], (0,)),
    "MishBackward0": (F.mish, [_float(4, 8)], (0,)),
    "ExpBackward0": (torch.exp, [_float(4, 8)], (0,)),
    "LogBackward0": (torch.log, [lambda: torch.rand(4, 8) + 0.5], (0,)),
    "SqrtBackward0": (torch.sqrt, [lambda: torch.rand(4, 8) + 0.5], (0,)),
    "RsqrtBackward0": (torch.rsqrt, [lambda: torch.rand(4, 8) + 0.5], (0,)),
    "SinBackward0": (torch.sin, [_float(4, 8)], (0,)),
    "CosBackward0": (torch.cos, [_float(4, 8)], (0,)),
    "ReciprocalBackward0": (torch.reciprocal, [lambda: torch.rand(4, 8) + 0.5], (0,)),
    "NegBackward0": (torch.neg, [_float(4, 8)], (0,)),
    "AbsBackward0": (torch.abs, [_float(4, 8)], (0,)),
    "NativeLayerNormBackward0": (lambda x, w, b: F.layer_norm(x, (8,), w, b), [_float(4, 8), _float(8), _float(8)],
                                 (0, 1, 2)),
    "NativeGroupNormBackward0": (lambda x, w, b: F.group_norm(x, 2, w, b), [_float(2, 4, 3, 3), _float(4), _float(4)],
                                 (0, 1, 2)),
    "EmbeddingBackward0": (lambda w, i: F.embedding(i, w), [_float(10, 4), _const(torch.tensor([[1, 3], [9, 0]]))], (0,)),
    "IndexBackward0": (lambda x, i: x[i], [_float(6, 4), _const(torch.tensor([0, 5, 2]))], (0,)),
    "GatherBackward0": (lambda x, i: torch.gather(x, 1, i), [_float(3, 5), _const(torch.tensor([[0, 4], [1, 1], [3, 2]]))],
                        (0,)),
    "MeanBackward1": (lambda x: x.mean(1), [_float(4, 8)], (0,)),
    "NormBackward1": (lambda x: torch.ops.aten.norm.ScalarOpt_dim(x, 2, [1]), [_float(4, 8)], (0,)),
    "LinalgVectorNormBackward0": (lambda x: torch.linalg.vector_norm(x, dim=1), [_float(4, 8)], (0,)),
    "ScaledDotProductFlashAttentionForCpuBackward0": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [_float(1, 2, 4, 8)] * 3, (0, 1, 2)),
    # a padded batch: the second sequence's last key is padding (SDPA saves the mask it makes of it)
    "ScaledDotProductFlashAttentionForCpuBackward0 (padding mask)": (
        lambda q, k, v, keep: F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
        [*[_float(2, 2, 4, 8)] * 3, _const(torch.tensor([True] * 4 + [True, True, True, False]).view(2, 1, 1, 4))],
        (0, 1, 2)),
    "SmoothL1LossBackward0": (F.smooth_l1_loss, [_float(4, 8), _float(4, 8)], (0, 1)),  # |x - y| on both sides of beta 1
    "IndexSelectBackward0": (lambda x, i: torch.index_select(x, 0, i), [_float(6, 4), _const(torch.tensor([0, 5, 2]))],
                             (0,)),
    "MaximumBackward0": (torch.maximum, [_float(4, 8), _float(4, 8)], (0, 1)),
    "MinimumBackward0": (torch.minimum, [_float(4, 8), _float(4, 8)], (0, 1)),
    # the fused kernels: one norm per row (dim 0) and one per column (the last dim)
    "WeightNormInterfaceBackward0": (lambda v, g: torch._weight_norm(v, g, 0),
                                     [_float(4, 8), lambda: torch.rand(4, 1) + 0.5], (0, 1)),
    "WeightNormInterfaceBackward0 (last dim)": (lambda v, g: torch._weight_norm(v, g, 1),
                                                [_float(4, 8), lambda: torch.rand(1, 8) + 0.5], (0, 1)),
    "NllLossBackward0": (lambda x, t: F.nll_loss(x, t), [_float(4, 5), _const(torch.tensor([0, 4, 2, 1]))], (0,)),
    "MseLossBackward0": (F.mse_loss, [_float(4, 8), _float(4, 8)], (0, 1)),
    "ClampBackward1": (lambda x: x.clamp(-0.5, 0.5), [_float(4, 8)], (0,)),
    "ClampMinBackward0": (lambda x: x.clamp_min(0.1), [_float(4, 8)], (0,)),
    "ClampMaxBackward0": (lambda x: x.clamp_max(0.1), [_float(4, 8)], (0,)),
    "WhereBackward0": (lambda c, x, y: torch.where(c > 0, x, y), [_float(4, 8), _float(4, 8), _float(4, 8)], (1, 2)),
    "MaxBackward0": (lambda x: x.max(1)[0], [_float(4, 8)], (0,)),
    "MaxBackward1": (lambda x: x.max(), [_float(4, 8)], (0,)),
    "MinBackward0": (lambda x: x.min(1)[0], [_float(4, 8)], (0,)),
    "MinBackward1": (lambda x: x.min(), [_float(4, 8)], (0,)),
    "AdaptiveMaxPool2DBackward0": (lambda x: F.adaptive_max_pool2d(x, 2), [_float(2, 3, 6, 6)], (0,)),
    "AvgPool2DBackward0": (lambda x: F.avg_pool2d(x, 2), [_float(2, 3, 6, 6)], (0,)),
    "AdaptiveAvgPool2DBackward0": (lambda x: F.adaptive_avg_pool2d(x, 2), [_float(2, 3, 6, 6)], (0,)),
    "UpsampleNearest2DBackward0": (lambda x: F.interpolate(x, scale_factor=2), [_float(1, 2, 3, 3)], (0,)),
    "MaskedFillBackward0": (lambda x, m: x.masked_fill(m > 0, 0.0), [_float(4, 8), _float(4, 8)], (0,)),
    "PreluKernelBackward0": (lambda x, w: F.prelu(x, w), [_float(2, 3, 4), _float(3)], (0, 1)),
    "RreluWithNoiseBackward0[training=True]": (lambda x: F.rrelu(x, training=True), [_float(4, 8)], (0,)),
    "RreluWithNoiseBackward0[training=False]": (lambda x: F.rrelu(x, training=False), [_float(4, 8)], (0,)),
    "ProdBackward0": (lambda x: x.prod(), [_float(2, 3)], (0,)),
    "ProdBackward1": (lambda x: x.prod(1), [_float(2, 3)], (0,)),
    "CumsumBackward0": (lambda x: x.cumsum(1), [_float(4, 8)], (0,)),
    "VarMeanBackward0": (lambda x: torch.var_mean(x, 1)[0], [_float(4, 8)], (0,)),
    "StdMeanBackward0": (lambda x: torch.std_mean(x, 1)[0], [_float(4, 8)], (0,)),
    "SliceBackward0": (lambda x: x[1:], [_float(4, 8)], (0,)),
    "SelectBackward0": (lambda x: x[1], [_float(4, 8)], (0,)),
    "ViewBackward0": (lambda x: x.view(8, 4), [_float(4, 8)], (0,)),
    "UnsafeViewBackward0": (lambda x, w: x @ w, [_float(2, 3, 4), _float(4, 5)], (0, 1)),
    # libraries' custom Functions (knowledge/libraries.py): BLOOM's GELU, torchvision's roi_align. The boxes
    # never require grad here: with only them wanted, the backward would still read them as indices for
    # the input's gradient it computes anyway (declared needed), but the proof would find them unread and
    # poison them with out-of-range batch indices the kernel does not check
    "GeLUFunctionBackward": (lambda x: _library("transformers.models.bloom.modeling_bloom", "GeLUFunction").apply(x),
                             [_float(4, 8)], (0,)),
    "GeneratedBackwardFor_torchvision_roi_align_defaultBackward": (
        lambda x, boxes: _library("torchvision.ops", "roi_align")(x, boxes, (2, 2), 1.0, 2, False),
        [_float(2, 3, 8, 8), _const(torch.tensor([[0, 0.5, 0.5, 5.0, 6.0], [1, 1.0, 2.0, 7.0, 7.0]]))], (0,)),
    # CUDA's dropout (target="cuda" builds it on meta); the CPU runs the op too, so it is proven here
    "NativeDropoutBackward0": (lambda x: torch.native_dropout(x, 0.5, True)[0], [_float(4, 8)], (0,)),
}

# Nodes made only by kernels this machine cannot run (CUDA) or by dispatch paths a CPU forward
# does not take: built on the meta device, where the kernel still builds its node. Their claims
# are proven only where such a device is at hand (no proof runs on meta).
META_CASES = {
    "ScaledDotProductEfficientAttentionBackward0": lambda q: torch.ops.aten._scaled_dot_product_efficient_attention(
        q, q, q, None, True)[0],
    "ScaledDotProductFlashAttentionBackward0": lambda q: torch.ops.aten._scaled_dot_product_flash_attention(q, q, q)[0],
    "ScaledDotProductCudnnAttentionBackward0": lambda q: torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, q, q, None, True)[0],
}

# cuDNN batch norm (what CUDA runs for most batch norms, and gradaudit's target="cuda" on meta):
# ATen's cudnn_batch_norm builds its node on meta, one case per variant. Static verdicts only:
# the proof needs a GPU (test_cudnn_batch_norm_verdicts_hold_on_a_gpu below runs where one is).
def _meta(*shape):
    return lambda: torch.randn(*shape, device="meta")


def _cudnn_batch_norm(training):
    return lambda x, w, b, mean, var: torch.ops.aten.cudnn_batch_norm(x, w, b, mean, var, training, 0.1, 1e-5)[0]


_BATCH_NORM_META_INPUTS = [_meta(4, 3, 5, 5), _meta(3), _meta(3), _buffer(_meta(3)), _buffer(_meta(3))]
CUDNN_CASES = {
    "CudnnBatchNormBackward0[training=True]": (_cudnn_batch_norm(True), _BATCH_NORM_META_INPUTS, (0, 1, 2)),
    "CudnnBatchNormBackward0[training=False]": (_cudnn_batch_norm(False), _BATCH_NORM_META_INPUTS, (0, 1, 2)),
}

# Linear has a node of its own only for nested tensors (dense linear decomposes into addmm/mm)
STATIC_CASES = {
    "LinearBackward0": lambda: F.linear(torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)],
                                                                   requires_grad=True),
                                        torch.randn(5, 3, requires_grad=True)),
}


def _node_name(case_name: str) -> str:
    # "Name[key=value]" is a variant's case; "Name (label)" another case of the same node
    return case_name.split("[")[0].split(" (")[0]


class _Function(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, *inputs):
        # copies: the saves are activations (the caller's inputs are alive anyway and never proven)
        return self.function(*[t if hasattr(t, "case_buffer") else t.clone() for t in inputs])


def _patterns(case):
    function, factories, trainable = case
    for count in range(1, len(trainable) + 1):
        for chosen in itertools.combinations(trainable, count):
            torch.manual_seed(0)
            inputs = [make() for make in factories]
            for i in chosen:
                inputs[i].requires_grad_(True)
            yield chosen, _Function(function), tuple(inputs)


def test_every_declared_node_type_exists_in_the_installed_torch():
    # a library's Function makes its node when it runs: its generated case checks that it does
    libraries = {v.name for v in declarations() if v.library}
    missing = [name for name in declared_ops() if name not in libraries and not node_type_exists(name)]
    assert not missing, f"declared but not a node type of torch {torch.__version__}: {missing}"
    assert libraries <= set(CASES) and not libraries & {name for name in declared_ops() if node_type_exists(name)}


def test_every_declared_node_type_has_a_generated_case():
    covered = {_node_name(c) for c in [*CASES, *CUDNN_CASES]} | set(META_CASES) | set(STATIC_CASES)
    assert covered == set(declared_ops())
    # every variant of a node with variants has its own case
    for variant in declarations():
        if variant.when:
            label = variant.name + "[" + ",".join(f"{k}={v}" for k, v in variant.when.items()) + "]"
            assert label in CASES or label in CUDNN_CASES, label


def _older_library_node(node_name, report):
    """Whether a library declaration's node is missing because the installed release of the library
    makes another one: torchvision 0.26 (beside torch 2.11) runs roi_align as a C++ Function
    (``CppFunction``, exposing no saves), 0.29 through torch.library.register_autograd. The
    declaration then applies to nothing, and the audit claims nothing of that node's saves."""
    if not any(v.library for v in declarations() if v.name == node_name):
        return False
    assert "CppFunction" in {n.name for n in report.nodes}, node_name
    assert report.tensors and all(t.verdict == UNKNOWN for t in report.tensors if t.storage_kind == "activation")
    return True


@pytest.mark.parametrize("case_name", list(CASES))
def test_static_verdicts_equal_the_proven_ones(case_name):
    node_name = _node_name(case_name)
    compared = 0
    for chosen, model, inputs in _patterns(CASES[case_name]):
        static = gradaudit.audit(model, inputs)
        proven = gradaudit.audit(model, inputs, verify=True)
        if node_name not in {n.name for n in static.nodes} and _older_library_node(node_name, static):
            return
        assert node_name in {n.name for n in static.nodes}, (case_name, chosen)
        assert not proven.disagreements, (case_name, chosen, proven.disagreements)
        for s, p in zip(static.tensors, proven.tensors):
            if p.node != node_name or not p.proven:
                continue
            compared += 1
            read = declaration(node_name, static.nodes[s.node_id].scalars).read(s.attr)
            if (s.verdict, p.verdict) == (NEEDED, NOT_NEEDED) and read is not None and read.sometimes:
                continue  # read for some values only (the declaration says which)
            assert (s.attr, s.verdict) == (p.attr, p.verdict), (case_name, chosen, s.reason, p.reason)
            if s.verdict in (NEEDED, SIGN_ONLY):
                # bit-packable statically: the proof found the values to take one bit (or a mask)
                assert not s.bitpackable or p.bitpackable or s.verdict == NEEDED, (case_name, s.attr)
    saves = any(n.saved for n in static.nodes if n.name == node_name)
    assert compared or not saves, f"{case_name}: no save of the node was proven"


@pytest.mark.parametrize("case_name", sorted(META_CASES) + sorted(STATIC_CASES))
def test_nodes_of_other_kernels_and_layouts_are_built_here(case_name):
    if case_name in META_CASES:
        output = META_CASES[case_name](torch.randn(1, 2, 4, 8, device="meta", requires_grad=True))
    else:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nested tensors are a prototype
            output = STATIC_CASES[case_name]()
    assert type(output.grad_fn).__name__ == case_name
    known = declaration(case_name)
    assert known is not None and all(known.outcome(attr, [True, True, True]).verdict == NEEDED
                                     for attr in known.saves)


def _verdicts(report, node_name):
    return [{t.attr: t.verdict for t in report.tensors if t.node_id == n.id}
            for n in report.nodes if n.name == node_name]


@pytest.mark.parametrize("case_name", sorted(CUDNN_CASES))
def test_cudnn_batch_norm_is_built_on_meta_with_the_declared_verdicts(case_name):
    """Every pattern of which inputs need a gradient builds the node on meta and gets a verdict on every
    save. In eval mode derivatives.yaml gives cuDNN's node the very native_batch_norm_backward call
    NativeBatchNormBackward0 makes (training=false, the output mask): its verdicts on input, weight
    and running statistics equal the ones the proof finds for the native node on CPU, pattern by
    pattern. In training its backward is one cudnn_batch_norm_backward call with no output mask:
    every save is declared read, whichever gradients are wanted."""
    training = case_name.endswith("[training=True]")
    native = CASES[f"NativeBatchNormBackward0[training={training}]"]
    for (chosen, model, inputs), (_, cpu_model, cpu_inputs) in zip(_patterns(CUDNN_CASES[case_name]),
                                                                   _patterns(native)):
        report = gradaudit.audit(model, inputs)
        (saves,) = _verdicts(report, "CudnnBatchNormBackward0")
        assert set(saves) == {"input", "weight", "running_mean", "running_var", "result1", "result2", "result3"}
        assert UNKNOWN not in saves.values(), (case_name, chosen, saves)
        if training:
            assert set(saves.values()) == {NEEDED}, (chosen, saves)
            continue
        (proven,) = _verdicts(gradaudit.audit(cpu_model, cpu_inputs, verify=True), "NativeBatchNormBackward0")
        for attr in ("input", "weight", "running_mean", "running_var"):
            assert saves[attr] == proven[attr], (chosen, attr, saves[attr], proven[attr])
        # cuDNN's eval forward leaves the batch statistics and the reserve space empty
        assert {saves[a] for a in ("result1", "result2", "result3")} == {NOT_NEEDED}


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.backends.cudnn.is_available()),
                    reason="the proof of cuDNN's batch norm needs a GPU with cuDNN")
@pytest.mark.parametrize("training", [True, False])
def test_cudnn_batch_norm_verdicts_hold_on_a_gpu(training):
    """Where a GPU is at hand: F.batch_norm takes cuDNN, and the proof refutes no static verdict. In
    eval the verdicts must agree both ways; in training a "needed" the proof finds unread (the bias
    gradient alone) is the declaration's caution about cuDNN's one-call backward, allowed here."""
    def cuda(*shape, positive=False):
        return lambda: (torch.rand(*shape, device="cuda") + 0.5) if positive else torch.randn(*shape, device="cuda")

    case = (lambda x, w, b, mean, var: F.batch_norm(x, mean, var, w, b, training=training),
            [cuda(4, 3, 5, 5), cuda(3), cuda(3), _buffer(cuda(3)), _buffer(cuda(3, positive=True))], (0, 1, 2))
    for chosen, model, inputs in _patterns(case):
        static = gradaudit.audit(model, inputs)
        proven = gradaudit.audit(model, inputs, verify=True)
        assert "CudnnBatchNormBackward0" in {n.name for n in static.nodes}, chosen
        assert not proven.disagreements, (chosen, proven.disagreements)
        for s, p in zip(static.tensors, proven.tensors):
            if p.node != "CudnnBatchNormBackward0" or not p.proven:
                continue
            if training and (s.verdict, p.verdict) == (NEEDED, NOT_NEEDED):
                continue
            assert (s.attr, s.verdict) == (p.attr, p.verdict), (training, chosen, s.reason, p.reason)


# -- every unneeded or bit-packable held activation is claimed by a rule ---------------------------

def test_every_unneeded_or_bitpackable_read_names_a_registered_rule():
    codes = {r.code for r in all_rules()}
    for variant in declarations():
        for attr, read in [*variant.saves.items(), ("<default>", variant.default)]:
            if read is not None and read.rule is not None:
                assert read.rule in codes, (variant.name, attr, read.rule)


@pytest.mark.parametrize("case_name", list(CASES) + list(CUDNN_CASES))
def test_unneeded_and_bitpackable_saves_are_claimed_by_findings(case_name):
    case, proofs = (CASES[case_name], (False, True)) if case_name in CASES else (CUDNN_CASES[case_name], (False,))
    for chosen, model, inputs in _patterns(case):
        for verify in proofs:  # no proof on meta
            report = gradaudit.audit(model, inputs, verify=verify)
            storages = report.storages
            for t in report.held_tensors:
                if t.storage_id < 0 or storages[t.storage_id].kind not in ("activation", "output"):
                    continue
                if storages[t.storage_id].nbytes == 0:
                    continue  # an empty save (eval batch norm's batch statistics) holds nothing
                if t.verdict == NOT_NEEDED or t.bitpackable:
                    assert t.rule is not None, (case_name, chosen, verify, t.node, t.attr, t.verdict)


# -- declaring one's own op --------------------------------------------------------------------------

class ScaleByWeight(torch.autograd.Function):
    """y = x * w; saves x and w, as many hand-written Functions do, whatever needs a gradient."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return (grad * w if ctx.needs_input_grad[0] else None,
                (grad * x).sum(0) if ctx.needs_input_grad[1] else None)


class ScaleLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return ScaleByWeight.apply(torch.tanh(x), self.w)


@pytest.fixture
def declared_scale():
    gradaudit.declare_function(ScaleByWeight, edges=("x", "w"), saves=[
        Read(by=("w",), rule="GA000"),  # x: read only by the weight gradient
        Read(by=("x",), rule="GA000"),  # w: read only by the input gradient
    ])
    yield
    forget(["ScaleByWeightBackward"])


def test_a_declared_custom_function_gets_static_verdicts(declared_scale):
    layer = ScaleLayer().requires_grad_(False)
    x = torch.randn(8, 16, requires_grad=True)
    report = gradaudit.audit(layer, x)
    saves = {t.attr: t for t in report.tensors if t.node == "ScaleByWeightBackward"}
    # x is the tanh result, read only by the frozen weight's gradient; w by the input's gradient
    assert saves["saved_tensors[0]"].verdict == NOT_NEEDED and saves["saved_tensors[1]"].verdict == NEEDED
    assert report.reclaimable_bytes == 0  # TanhBackward0 keeps the same tensor
    proven = gradaudit.audit(layer, x, verify=True)
    assert not proven.disagreements


def test_trim_follows_a_user_declaration(declared_scale):
    layer = ScaleLayer().requires_grad_(False)
    x = torch.randn(8, 16, requires_grad=True)
    plain = torch.autograd.grad(layer(x).sum(), x)[0]
    with gradaudit.trim(layer) as handle:
        trimmed = torch.autograd.grad(layer(x).sum(), x)[0]
    assert torch.equal(plain, trimmed) and handle.stats["dropped"] == 1  # x dropped; w is a parameter


def test_declarations_validate_what_they_say():
    with pytest.raises(ValueError, match="edge"):
        gradaudit.declare("NoSuchBackward0", edges=("self",), saves={"x": Read(by=("other",), rule="GA000")})
    with pytest.raises(ValueError, match="rule"):
        Read(reads=Reads.SHAPE)  # a save left unneeded must name the rule that explains it
    with pytest.raises(ValueError, match="bit"):
        Read(reads=Reads.SIGN, rule="GA401")
    with pytest.raises(ValueError, match="twice"):
        gradaudit.declare("ReluBackward0", edges=("self",),
                          saves={"result": Read(reads=Reads.SIGN, bit=Bit.GT_ZERO, rule="GA401")})


def test_a_libraries_function_declared_by_name_says_only_needed():
    """A Function of the same class name elsewhere makes a node of the same name: a declaration by
    name may not leave a save unneeded or bit-packable, and saves it does not name stay unknown."""
    with pytest.raises(ValueError, match="same name"):
        gradaudit.declare("SomeFunctionBackward", library="somelib", edges=("x", "y"),
                          saves={"saved_tensors[0]": Read(by=("y",), rule="GA001")})
    with pytest.raises(ValueError, match="same name"):
        gradaudit.declare("SomeFunctionBackward", library="somelib", edges=("x",), default=Read(why="read"))
    assert "SomeFunctionBackward" not in declared_ops()

    class GeLUFunction(torch.autograd.Function):  # not BLOOM's: saves its input and an unread copy
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x, x * 2)
            return F.gelu(x)

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.saved_tensors[0]

    report = gradaudit.audit(_Function(lambda x: GeLUFunction.apply(x)), torch.randn(4, 8, requires_grad=True))
    saves = {t.attr: t.verdict for t in report.tensors if t.node == "GeLUFunctionBackward"}
    assert saves == {"saved_tensors[0]": NEEDED, "saved_tensors[1]": UNKNOWN}


def test_an_in_place_op_on_a_view_gets_the_verdict_of_the_node_it_hides():
    """In-place ReLU on a view (torchvision swin_v2's position MLP: Linear on a 4-D input, then
    ReLU(inplace=True), whose Linear output is a view up to torch 2.14; here Unflatten's view on
    every release) hides its ReluBackward0 inside CopySlices, which exposes no saves. The
    audit knows it by the function that packed it, and says what backward reads; trim cannot
    reach it, so it is in no reclaimable figure."""
    from gradaudit.measure import held_bytes_after_forward

    model = nn.Sequential(nn.Linear(2, 16), nn.Unflatten(-1, (4, 4)), nn.ReLU(inplace=True), nn.Flatten(-2),
                          nn.Linear(16, 4))
    x = torch.randn(3, 5, 5, 2)
    report = gradaudit.audit(model, x)
    (hidden,) = [t for t in report.tensors if t.attr.startswith("hidden")]
    assert (hidden.node, hidden.module_class, hidden.verdict) == ("CopySlices", "ReLU", SIGN_ONLY)
    assert "ReluBackward0.result" in hidden.reason and not hidden.bitpackable and hidden.rule is None
    assert report.summary()["unknown_tensors"] == 0
    # 3*5*5*16 float32 = 4800 bytes for the ReLU's result, counted as held like any other save
    assert report.saved_bytes == held_bytes_after_forward(model, x)
    assert report.reclaimable_with_bitpacking_bytes == report.reclaimable_bytes  # nothing trim cannot do


def test_in_place_declarations_name_a_declared_save():
    with pytest.raises(ValueError, match="not a declared save"):
        gradaudit.declare("NoSuchBackward1", edges=("self",), saves={"result": Read(reads=Reads.SIGN, bit=Bit.GT_ZERO,
                                                                                   rule="GA401")},
                          in_place={"no_such_": "self"})
