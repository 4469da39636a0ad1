"""``target="cuda"``: an audit on the meta device that stands for a GPU.

Batch norm takes cuDNN wherever ATen's ``_select_batch_norm_backend`` would (so the node is
CudnnBatchNormBackward0, with cuDNN's saves), ``torch.autocast("cuda")`` inside the forward is
followed, and the report records what it stands for. The proof of the cuDNN declarations needs a
GPU (tests/test_knowledge.py runs it where one is); here everything is static, on meta, and compared
with CPU audits where the two kernels keep the same tensors.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradaudit
from gradaudit import GradauditError, torchapi
from gradaudit.meta import CudaKernelChoices
from gradaudit.records import NEEDED, NOT_NEEDED, UNKNOWN
from gradaudit.report import jsonout, text

BATCH = (2, 3, 64, 64)
# ResNet-18's 20 batch norms: bn1 (64), layer1 4 x 64, layer2 4 x 128 and its downsample's 128,
# layer3 4 x 256 + 256, layer4 4 x 512 + 512
RESNET18_BN_CHANNELS = 64 + 4 * 64 + 5 * 128 + 5 * 256 + 5 * 512  # = 4800


def _resnet18(torchvision, device, mode):
    torch.manual_seed(0)
    with torch.device(device):
        model = torchvision.models.resnet18(num_classes=10)
    return model.train(mode == "train")


def _figures(report):
    return (report.saved_bytes, report.reclaimable_bytes, report.reclaimable_with_bitpacking_bytes,
            report.reclaimable_with_all_fixes_bytes)


def _findings(report):
    return sorted((f.code, f.module, f.bytes, f.bytes_together) for f in report.findings)


def _batch_norm_nodes(report):
    return [n for n in report.nodes if "BatchNorm" in n.name]


def test_resnet18_in_eval_with_only_fc_trainable_takes_cudnn(torchvision):
    # eval mode, only fc trains and the input requires grad (a saliency map, an attack): every batch
    # norm is in the graph with its affine frozen
    x = torch.randn(*BATCH, device="meta", requires_grad=True)
    model = _resnet18(torchvision, "meta", "eval")
    cuda = gradaudit.audit(model, x, trainable=["fc.*"], target="cuda")
    meta_cpu = gradaudit.audit(model, x, trainable=["fc.*"])
    cpu = gradaudit.audit(_resnet18(torchvision, "cpu", "eval"), torch.randn(*BATCH, requires_grad=True),
                          trainable=["fc.*"])
    assert (cuda.device, cuda.target, meta_cpu.target, cpu.target) == ("meta", "cuda", "cpu", "cpu")

    norms = _batch_norm_nodes(cuda)
    assert len(norms) == 20 and {n.name for n in norms} == {"CudnnBatchNormBackward0"}
    assert {n.scalars["training"] for n in norms} == {False}
    saves = [t for t in cuda.tensors if t.node == "CudnnBatchNormBackward0"]
    assert len(saves) == 20 * 7 and UNKNOWN not in {t.verdict for t in saves}
    assert {(t.verdict, t.rule) for t in saves if t.attr == "input"} == {(NOT_NEEDED, "GA201")}
    assert {t.verdict for t in saves if t.attr in ("weight", "running_var")} == {NEEDED}
    assert {(t.attr, t.view_nbytes) for t in saves if t.attr.startswith("result")} == {
        ("result1", 0), ("result2", 0), ("result3", 0)}  # empty in eval
    assert sorted(f.module for f in cuda.findings if f.code == "GA201") == sorted(
        path for path, m in model.named_modules() if isinstance(m, nn.BatchNorm2d))

    # cuDNN's eval forward leaves its batch statistics and reserve space empty, as the CPU's native
    # kernel leaves its statistics: the same tensors, so every figure and finding equals the CPU's
    assert _figures(cuda) == _figures(cpu)
    assert _findings(cuda) == _findings(cpu)
    # standing for the CPU, the meta native kernel keeps batch mean and inverse std (C floats each)
    # in eval: 2 * 4800 channels * 4 bytes = 38400 bytes more held, all unneeded
    assert meta_cpu.saved_bytes - cuda.saved_bytes == 2 * RESNET18_BN_CHANNELS * 4 == 38400
    assert meta_cpu.reclaimable_bytes - cuda.reclaimable_bytes == 38400


def test_resnet18_in_training_takes_cudnn(torchvision):
    x = torch.randn(*BATCH, device="meta")
    cuda = gradaudit.audit(_resnet18(torchvision, "meta", "train"), x, target="cuda")
    cpu = gradaudit.audit(_resnet18(torchvision, "cpu", "train"), torch.randn(*BATCH))
    norms = _batch_norm_nodes(cuda)
    assert len(norms) == 20 and {n.name for n in norms} == {"CudnnBatchNormBackward0"}
    assert {n.scalars["training"] for n in norms} == {True}
    saves = [t for t in cuda.tensors if t.node == "CudnnBatchNormBackward0"]
    assert len(saves) == 20 * 7 and {t.verdict for t in saves} == {NEEDED}
    # cuDNN in training saves the input, the weight and a batch mean and inverse std of C floats, as
    # the native kernel does; its reserve space (result3, uint8) is 0 bytes on meta (its size on a GPU
    # is cuDNN's to say). Every gradient is wanted, so both kernels need every save: equal figures.
    assert {(t.dtype, t.view_nbytes) for t in saves if t.attr == "result3"} == {("uint8", 0)}
    assert sum(t.view_nbytes for t in saves if t.attr in ("result1", "result2")) == 2 * RESNET18_BN_CHANNELS * 4
    assert _figures(cuda) == _figures(cpu)
    assert _findings(cuda) == _findings(cpu)


def test_bias_only_training_keeps_cudnn_saves_needed():
    """In training cuDNN's backward is one call that computes every gradient from every save;
    gradaudit makes no claim about what it leaves unread until a GPU proves one, so GA202 (the
    native kernel's bias-only waste) does not fire for it."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).train()
    x = torch.randn(2, 3, 16, 16, device="meta")
    cpu = gradaudit.audit(model, x, trainable=["1.bias"])
    cuda = gradaudit.audit(model, x, trainable=["1.bias"], target="cuda")
    assert [f.code for f in cpu.findings] == ["GA202"] and cuda.findings == []
    assert {t.verdict for t in cuda.tensors if t.node == "CudnnBatchNormBackward0"} == {NEEDED}
    # native: the conv's output 2*8*14*14*4 = 12544 bytes and the batch statistics 2 * 8 * 4 = 64
    assert cpu.reclaimable_bytes == 12544 + 64 and cuda.reclaimable_bytes == 0


def _bn(cls, features, **kwargs):
    with torch.device("meta"):
        return cls(features, **kwargs)


def _meta(*shape, dtype=torch.float32):
    return torch.randn(*shape, device="meta", dtype=dtype, requires_grad=True)


CUDNN, NATIVE = "CudnnBatchNormBackward0", "NativeBatchNormBackward0"


@pytest.mark.parametrize("module, x, node", [
    # ATen's _select_batch_norm_backend (aten/src/ATen/native/Normalization.cpp), case by case
    (lambda: _bn(nn.BatchNorm2d, 1).eval(), lambda: _meta(65535, 1, 1, 1), CUDNN),  # eval batch limit
    (lambda: _bn(nn.BatchNorm2d, 1).eval(), lambda: _meta(65536, 1, 1, 1), NATIVE),
    (lambda: _bn(nn.BatchNorm2d, 1).train(), lambda: _meta(880801, 1, 1, 1), CUDNN),  # training limit
    (lambda: _bn(nn.BatchNorm2d, 1).train(), lambda: _meta(880802, 1, 1, 1), NATIVE),
    (lambda: _bn(nn.BatchNorm1d, 4), lambda: _meta(8, 4), NATIVE),  # 2-d input
    (lambda: _bn(nn.BatchNorm1d, 4), lambda: _meta(8, 4, 5), CUDNN),
    (lambda: _bn(nn.BatchNorm3d, 4), lambda: _meta(2, 4, 3, 3, 3), CUDNN),
    (lambda: _bn(nn.BatchNorm2d, 4, affine=False), lambda: _meta(2, 4, 5, 5), NATIVE),  # no weight, bias
    (lambda: _bn(nn.BatchNorm2d, 4, track_running_stats=False), lambda: _meta(2, 4, 5, 5), CUDNN),
    (lambda: _bn(nn.BatchNorm2d, 4).to(torch.bfloat16), lambda: _meta(2, 4, 5, 5, dtype=torch.bfloat16), NATIVE),
    (lambda: _bn(nn.BatchNorm2d, 4), lambda: _meta(2, 4, 5, 5, dtype=torch.bfloat16), NATIVE),
    (lambda: _bn(nn.BatchNorm2d, 4), lambda: _meta(2, 4, 5, 5, dtype=torch.float16), CUDNN),  # float weight
    (lambda: _bn(nn.BatchNorm2d, 4).half(), lambda: _meta(2, 4, 5, 5, dtype=torch.float16), NATIVE),
    (lambda: _bn(nn.BatchNorm2d, 4).double(), lambda: _meta(2, 4, 5, 5, dtype=torch.float64), CUDNN),
])
def test_batch_norm_takes_the_kernel_cuda_would(module, x, node):
    with CudaKernelChoices():
        out = module()(x())
    assert type(out.grad_fn).__name__ == node


def test_disabled_cudnn_and_direct_calls():
    bn, x = _bn(nn.BatchNorm2d, 4), _meta(2, 4, 5, 5)
    with CudaKernelChoices():
        with torch.backends.cudnn.flags(enabled=False):
            assert type(bn(x).grad_fn).__name__ == NATIVE
        direct = torch.batch_norm(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, 0.1, 1e-5, True)
        keywords = F.batch_norm(x, bn.running_mean, bn.running_var, weight=bn.weight, bias=bn.bias, training=True)
    assert type(direct.grad_fn).__name__ == type(keywords.grad_fn).__name__ == CUDNN
    with CudaKernelChoices(), pytest.raises(ValueError, match="more than 1 value per channel"):
        bn.train()(_meta(1, 4, 1, 1))  # F.batch_norm's own check still runs


def test_cudnn_saves_the_input_in_its_suggested_memory_format():
    # ATen hands cuDNN input.contiguous(input.suggest_memory_format()): a channels-last input as it
    # is, a strided view as a contiguous copy (which the node then saves)
    bn = _bn(nn.BatchNorm2d, 3)
    channels_last = _meta(2, 3, 8, 8).to(memory_format=torch.channels_last)
    transposed = _meta(2, 3, 8, 8).transpose(2, 3)
    with CudaKernelChoices():
        kept, copied = bn(channels_last).grad_fn._saved_input, bn(transposed).grad_fn._saved_input
    assert torchapi.storage_key(kept) == torchapi.storage_key(channels_last)
    assert kept.is_contiguous(memory_format=torch.channels_last)
    assert torchapi.storage_key(copied) != torchapi.storage_key(transposed) and copied.is_contiguous()


class _CudaAutocastNet(nn.Module):
    """A forward written for a GPU: conv, batch norm and the head under torch.autocast("cuda")."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, x):
        with torch.autocast("cuda", dtype=self.dtype):
            return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


@pytest.mark.parametrize("dtype, node", [(torch.float16, CUDNN), (torch.bfloat16, NATIVE)])
def test_autocast_cuda_inside_the_forward_is_followed(dtype, node):
    init, bf16 = torch.amp.autocast_mode.autocast.__init__, torch.cuda.is_bf16_supported
    with torch.device("meta"):
        model = _CudaAutocastNet(dtype).train()
    x = torch.randn(2, 3, 16, 16, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # without CUDA, torch would warn and turn autocast("cuda") off
        report = gradaudit.audit(model, x, target="cuda")
    saves = {(t.module, t.node, t.attr): t for t in report.tensors}
    # conv runs in the lower precision; its output goes to batch norm, which cuDNN takes for a
    # float16 input with a float32 weight and leaves to the native kernel for bfloat16
    assert saves[("conv", "ConvolutionBackward0", "input")].dtype == str(dtype).split(".")[1]
    bn_input = saves[("bn", node, "input")]
    assert bn_input.dtype == str(dtype).split(".")[1]
    assert bn_input.view_nbytes == 2 * 8 * 14 * 14 * 2 == 6272  # two bytes per element
    # the audit leaves torch's autocast as it found it
    assert torch.amp.autocast_mode.autocast.__init__ is init and torch.cuda.is_bf16_supported is bf16
    assert not torch.is_autocast_enabled("cuda")
    if not torch.cuda.is_available():  # standing for this CPU, the forward runs as it would here
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            on_cpu = gradaudit.audit(model, x)
        assert {t.dtype for t in on_cpu.tensors if t.module == "conv"} == {"float32"}


def test_target_is_checked_and_recorded():
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    x = torch.randn(2, 3, 8, 8, device="meta")
    with pytest.raises(GradauditError, match="target must be one of cpu, cuda, not 'tpu'"):
        gradaudit.audit(model, x, target="tpu")
    cpu_model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    with pytest.raises(GradauditError, match="target='cuda' needs the meta device.*runs on cpu"):
        gradaudit.audit(cpu_model, torch.randn(2, 3, 8, 8), target="cuda")
    assert gradaudit.audit(cpu_model, torch.randn(2, 3, 8, 8), target="cpu").target == "cpu"

    report = gradaudit.audit(model, x, target="cuda")
    assert json.loads(jsonout.render(report))["target"] == "cuda"
    assert report.to_dict()["device"] == "meta"
    assert "(torch " in text.render(report) and ", meta as cuda, train mode," in text.render(report)
    assert ", meta as cpu," in text.render(gradaudit.audit(model, x))


def test_attention_follows_the_cpu_choice_and_says_so():
    class Attention(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q * 2, q * 3)

    q = torch.randn(1, 2, 16, 8, device="meta", requires_grad=True)
    cpu, cuda = gradaudit.audit(Attention(), q), gradaudit.audit(Attention(), q, target="cuda")
    assert [t.node for t in cuda.tensors] == [t.node for t in cpu.tensors]
    assert cuda.saved_bytes == cpu.saved_bytes
    assert any("takes the kernel CPU would choose" in n for n in cuda.notes)
    assert not any("takes the kernel CPU would choose" in n for n in cpu.notes)


def test_what_is_not_emulated_is_noted():
    # CUDA's fused dropout (a bool mask) and the cuDNN batch norm inside F.instance_norm (C++)
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, affine=True), nn.Dropout(0.1)).train()
    x = torch.randn(2, 3, 8, 8, device="meta")
    notes = gradaudit.audit(model, x, target="cuda").notes
    assert any("native_dropout" in n for n in notes) and any("F.instance_norm" in n for n in notes)
    assert not any("target cuda" in n for n in gradaudit.audit(model, x).notes)
    assert not any("native_dropout" in n for n in gradaudit.audit(model.eval(), x, target="cuda").notes)
