"""``target="cuda"``: an audit on the meta device that stands for a GPU.

Batch norm takes cuDNN wherever ATen's ``_select_batch_norm_backend`` would (so the node is
CudnnBatchNormBackward0, with cuDNN's saves), ``F.scaled_dot_product_attention`` takes the backend
CUDA's ``select_sdp_backend`` would pick on the assumed GPU (an H100 with the installed torch's cuDNN),
dropout in training runs the fused ``native_dropout`` (a bool mask), ``torch.autocast("cuda")`` inside
the forward is followed, and the report records what it stands for. The proof of the cuDNN declarations
needs a GPU (tests/test_knowledge.py runs it where one is); here everything is static, on meta, and
compared with CPU audits where the kernels keep the same tensors. No GPU confirmed the attention
choices: they follow torch's checks as read in its source (gradaudit/cuda_choices.py).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradaudit
from gradaudit import GradauditError, cuda_choices
from gradaudit.cuda_choices import Gpu, SdpaCall
from gradaudit.meta import CudaKernelChoices
from gradaudit.records import NEEDED, NOT_NEEDED, UNKNOWN
from gradaudit.report import jsonout, text
from gradaudit.torchapi.storages import storage_key

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
    # standing for the CPU, the meta native kernel's batch mean and inverse std (C floats each in eval)
    # take the CPU kernel's empty shape: the same figures (they held 2 * 4800 channels * 4 = 38400
    # bytes more, all unneeded, before the emulation gave them the CPU's shape)
    assert _figures(meta_cpu) == _figures(cpu) and meta_cpu.saved_bytes == cuda.saved_bytes
    assert meta_cpu.reclaimable_bytes == cuda.reclaimable_bytes


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
    assert storage_key(kept) == storage_key(channels_last)
    assert kept.is_contiguous(memory_format=torch.channels_last)
    assert storage_key(copied) != storage_key(transposed) and copied.is_contiguous()


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


def test_what_is_not_emulated_is_noted():
    # the cuDNN batch norm inside F.instance_norm (C++) is not emulated; CUDA's fused dropout is
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, affine=True), nn.Dropout(0.1)).train()
    x = torch.randn(2, 3, 8, 8, device="meta")
    notes = gradaudit.audit(model, x, target="cuda").notes
    assert any("F.instance_norm" in n for n in notes) and not any("dropout" in n for n in notes)
    assert not any("target cuda" in n for n in gradaudit.audit(model, x).notes)


# -- dropout: CUDA runs the fused native_dropout in training, which saves a bool mask ---------------


def test_dropout_keeps_a_bool_mask_on_cuda():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.Linear(32, 4)).train()
    x = torch.randn(8, 16, device="meta")
    cuda, cpu = gradaudit.audit(model, x, target="cuda"), gradaudit.audit(model, x)
    (mask,) = [t for t in cuda.tensors if t.node == "NativeDropoutBackward0"]
    (cpu_mask,) = [t for t in cpu.tensors if t.node == "MulBackward0" and t.attr == "other"]
    # the 8 x 32 mask: 256 elements, one byte each as bool on CUDA, four as the CPU's float32 mask
    assert (mask.attr, mask.dtype, mask.shape, mask.view_nbytes) == ("result1", "bool", (8, 32), 256)
    # the backward is grad * mask * 1/(1-p): needed, and one bit per element holds it (GA403)
    assert (mask.verdict, mask.rule, mask.bitpackable) == (NEEDED, "GA403", True)
    (finding,) = [f for f in cuda.findings if f.code == "GA403"]
    assert finding.bytes == 256 - 256 // 8  # the bool mask's 256 bytes, less 32 bytes of bits
    assert cpu_mask.view_nbytes == 256 * 4 and cpu.saved_bytes - cuda.saved_bytes == 256 * 3
    # GA402 (a float mask holding two values) is the CPU's: CUDA's mask is already bool
    assert "GA402" in {f.code for f in cpu.findings} and "GA402" not in {f.code for f in cuda.findings}
    # what stays as on the meta device: eval mode, p = 0, in place, and the feature dropouts
    for module in (model.eval(), nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.0)).to("meta").train(),
                   nn.Sequential(nn.Linear(16, 32), nn.Dropout1d(0.1)).to("meta").train()):
        assert "NativeDropoutBackward0" not in {n.name for n in gradaudit.audit(module, x, target="cuda").nodes}
    with CudaKernelChoices():
        y = torch.randn(8, 16, device="meta", requires_grad=True)
        assert type(torch.dropout(y, 0.5, True).grad_fn).__name__ == "NativeDropoutBackward0"
        assert type(F.dropout(y * 1, 0.5, training=True, inplace=True).grad_fn).__name__ != "NativeDropoutBackward0"


def test_native_dropout_is_declared_and_trim_keeps_its_mask_as_bits():
    """NativeDropoutBackward0 (what CUDA's dropout builds; CPU runs the op too): its bool mask is read,
    so the audit calls it needed (proven), and bit-packable (GA403): trim keeps it as bits; the
    gradients stay bit-identical."""

    class FusedDropout(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.native_dropout(self.lin(x), 0.5, True)[0]

    torch.manual_seed(0)
    model, x = FusedDropout(), torch.randn(4, 8)
    (mask,) = [t for t in gradaudit.audit(model, x, verify=True).tensors if t.node == "NativeDropoutBackward0"]
    assert (mask.verdict, mask.proven, mask.bitpackable) == (NEEDED, True, True)

    def gradient(trimmed):
        model.zero_grad()
        torch.manual_seed(1)
        if trimmed:
            with gradaudit.trim(model) as handle:
                model(x).square().sum().backward()
            assert handle.stats["bitpacked"] == 1
        else:
            model(x).square().sum().backward()
        return model.lin.weight.grad.clone()

    assert torch.equal(gradient(False), gradient(True))


# -- attention: CUDA's choice among flash, memory-efficient, cuDNN and math ----------------------

# the rules of torch 2.14 whatever torch is installed (tests/test_target_releases.py: what other releases change)
H100, A100 = Gpu("H100", (9, 0), 92400, torch=(2, 14)), Gpu("A100", (8, 0), 92400, torch=(2, 14))
B, H, L, D = 2, 4, 24, 64


@pytest.fixture(autouse=True)
def _an_h100_with_cudnn_9_24(monkeypatch):
    """The audits below stand for the GPU the defaults assume with torch 2.14.1+cu130 (its cuDNN
    9.24, its rules), whatever torch and cuDNN are installed, and torch's cuDNN preference left on."""
    monkeypatch.setattr(cuda_choices, "assumed_gpu", lambda: H100)
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)


def test_the_assumed_gpu_is_an_h100_with_the_installed_cudnn(monkeypatch):
    monkeypatch.undo()
    gpu = cuda_choices.assumed_gpu()
    assert (gpu.name, gpu.capability, gpu.torch) == ("H100", (9, 0), cuda_choices.installed_release())
    # a CPU-only build has no cuDNN: the one its release's default CUDA wheel bundles
    assert gpu.cudnn == (torch.backends.cudnn.version() or cuda_choices.BUNDLED_CUDNN[gpu.torch])


def _qkv(d=D, dtype=torch.bfloat16, heads=H, kv_heads=H, keys=L):
    return (torch.randn(B, heads, L, d, device="meta", dtype=dtype, requires_grad=True),
            torch.randn(B, kv_heads, keys, d, device="meta", dtype=dtype, requires_grad=True),
            torch.randn(B, kv_heads, keys, d, device="meta", dtype=dtype, requires_grad=True))


def _mask(*shape, dtype=torch.bool, requires_grad=False):
    return torch.zeros(*shape, device="meta", dtype=dtype).requires_grad_(requires_grad)


CHOICES = {
    # sdp_utils.cpp on an H100 (sm90) with cuDNN 9.24: cuDNN first (it is newer than 9.15), then
    # flash, memory-efficient, math
    "bf16": (lambda: SdpaCall(*_qkv()), H100, "cudnn"),
    "bf16 on an A100 (cuDNN not preferred)": (lambda: SdpaCall(*_qkv()), A100, "flash"),
    "fp16 causal": (lambda: SdpaCall(*_qkv(dtype=torch.float16), is_causal=True), H100, "cudnn"),
    "fp32: only memory-efficient takes it": (lambda: SdpaCall(*_qkv(dtype=torch.float32)), H100, "efficient"),
    "fp64: no fused kernel": (lambda: SdpaCall(*_qkv(dtype=torch.float64)), H100, "math"),
    "4-D bool mask": (lambda: SdpaCall(*_qkv(), _mask(B, 1, L, L)), H100, "cudnn"),
    "mask and dropout 0.1 (cuDNN: multiples of 1/16; flash: no mask)": (
        lambda: SdpaCall(*_qkv(), _mask(B, 1, L, L), 0.1), H100, "efficient"),
    "dropout 1/8": (lambda: SdpaCall(*_qkv(), dropout_p=0.125), H100, "cudnn"),
    "dropout 0.1": (lambda: SdpaCall(*_qkv(), dropout_p=0.1), H100, "flash"),
    "3-D mask (cuDNN: 2-D or 4-D)": (lambda: SdpaCall(*_qkv(), _mask(B, L, L)), H100, "efficient"),
    "mask that requires grad": (lambda: SdpaCall(*_qkv(), _mask(L, L, dtype=torch.bfloat16, requires_grad=True)),
                                H100, "efficient"),
    "head dim 12: flash pads it to 16": (lambda: SdpaCall(*_qkv(d=12)), H100, "flash"),
    "head dim 12 and a mask": (lambda: SdpaCall(*_qkv(d=12), _mask(L, L)), H100, "math"),
    "fp32 head dim 9": (lambda: SdpaCall(*_qkv(d=9, dtype=torch.float32)), H100, "math"),
    "head dim 160 (cuDNN: 128)": (lambda: SdpaCall(*_qkv(d=160)), H100, "flash"),
    "head dim 288 (flash: 256)": (lambda: SdpaCall(*_qkv(d=288)), H100, "efficient"),
    "grouped key/value heads": (lambda: SdpaCall(*_qkv(kv_heads=2), enable_gqa=True), H100, "cudnn"),
    "causal, more keys than queries, A100": (lambda: SdpaCall(*_qkv(keys=32), is_causal=True), A100, "efficient"),
    "a transposed head dim (stride != 1)": (
        lambda: SdpaCall(*(t.transpose(-1, -2) for t in _qkv(d=L))), H100, "math"),
    "key/value length 1 (cuDNN)": (lambda: SdpaCall(*_qkv(keys=1)), H100, "flash"),
}


@pytest.mark.parametrize("case", list(CHOICES))
def test_attention_takes_the_backend_cuda_would(case):
    call, gpu, kernel = CHOICES[case]
    chosen = cuda_choices.choose(call(), gpu)
    assert chosen.kernel == kernel, chosen
    # every fused backend ahead of it in the priority order says why it passed
    ahead = cuda_choices.priority(gpu)[:cuda_choices.priority(gpu).index(kernel)]
    assert [name for name, _ in chosen.passed_over] == [name for name in ahead if name in cuda_choices.FUSED]
    assert all(why for _, why in chosen.passed_over)


def test_settings_that_change_the_choice_are_followed(monkeypatch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    call = SdpaCall(*_qkv())
    assert cuda_choices.choose(call, H100).kernel == "cudnn"
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        assert cuda_choices.choose(call, H100).kernel == "flash"
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        assert cuda_choices.choose(call, H100).kernel == "efficient"
    with sdpa_kernel(SDPBackend.MATH):
        assert cuda_choices.choose(call, H100).kernel == "math"
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION], set_priority=True):
        assert cuda_choices.choose(call, H100).kernel == "efficient"
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        assert cuda_choices.choose(call, H100).kernel == "flash"
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    torch.use_deterministic_algorithms(True)
    try:
        assert cuda_choices.choose(call, H100).kernel == "flash"  # cuDNN attention is not deterministic
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert cuda_choices.choose(call, H100).kernel == "flash"
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    # no kernel at all: a GPU raises, and so does the audit
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError, match="flash: an attn_mask"):
        cuda_choices.choose(SdpaCall(*_qkv(), _mask(L, L)), H100)
    x = torch.randn(B, H, L, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(GradauditError, match="flash: an attn_mask"):
        gradaudit.audit(_Attention(_mask(L, L)), x, target="cuda")


@pytest.mark.parametrize("case, node", [
    ("bf16", "ScaledDotProductCudnnAttentionBackward0"),
    ("dropout 0.1", "ScaledDotProductFlashAttentionBackward0"),
    ("fp32: only memory-efficient takes it", "ScaledDotProductEfficientAttentionBackward0"),
    ("fp64: no fused kernel", "SafeSoftmaxBackward0"),
])
def test_the_chosen_kernel_builds_its_node(case, node):
    call = CHOICES[case][0]()
    with CudaKernelChoices(H100):
        out = F.scaled_dot_product_attention(call.query, call.key, call.value, attn_mask=call.attn_mask,
                                             dropout_p=call.dropout_p, is_causal=call.is_causal)
    seen, stack = set(), [out.grad_fn]
    while stack:
        n = stack.pop()
        if n is not None and n not in seen:
            seen.add(n)
            stack.extend(f for f, _ in n.next_functions)
    assert node in {n.name() for n in seen} and out.shape == call.query.shape and out.dtype == call.query.dtype


def _saves(report, node):
    return {t.attr: t for t in report.tensors if t.node == node}


class _Attention(nn.Module):
    def __init__(self, mask=None, p=0.0, head_slice=None):
        super().__init__()
        self.mask, self.p, self.head_slice = mask, p, head_slice

    def forward(self, x):
        q, k, v = x * 1, x * 2, x * 3
        if self.head_slice is not None:
            q, k, v = (t[..., self.head_slice:] for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=self.p)


def test_flash_pads_a_head_dim_to_a_multiple_of_8():
    # attention.cpp pads query, key and value with zeros to head dim 16 before the flash kernel and
    # slices the output back: the kernel saves the padded copies
    x = torch.randn(B, H, L, 12, device="meta", dtype=torch.bfloat16, requires_grad=True)
    report = gradaudit.audit(_Attention(), x, target="cuda")
    saves = _saves(report, "ScaledDotProductFlashAttentionBackward0")
    padded = B * H * L * 16 * 2  # 2 * 4 * 24 * 16 bf16 = 6144 bytes each
    assert {(a, t.shape, t.view_nbytes) for a, t in saves.items() if a in ("query", "key", "value", "output")} == {
        (a, (B, H, L, 16), padded) for a in ("query", "key", "value", "output")}
    assert saves["logsumexp"].view_nbytes == B * H * L * 4  # float32 per (batch, head, query): 768
    (call,) = {n.attention for n in report.nodes if n.attention is not None}
    assert (call.kernel, call.device, call.passed_over[0][0]) == ("flash", "cuda", "cudnn")


def test_efficient_copies_a_mask_whose_rows_are_not_aligned():
    # preprocess_mask: a float mask whose key dimension (20) is not a multiple of 8 is copied into a
    # buffer padded to 24 keys, which the node keeps (as a B x H x L x S broadcast view of it)
    x = torch.randn(B, H, L, 16, device="meta", dtype=torch.float32, requires_grad=True)
    keys = torch.randn(B, H, 20, 16, device="meta", requires_grad=True)

    class Cross(nn.Module):
        def forward(self, q):
            mask = torch.zeros(B, 1, L, 20, device="meta")
            return F.scaled_dot_product_attention(q, keys * 1, keys * 2, attn_mask=mask)

    report = gradaudit.audit(Cross(), x, target="cuda")
    bias = _saves(report, "ScaledDotProductEfficientAttentionBackward0")["attn_bias"]
    assert bias.shape == (B, H, L, 20) and bias.stride == (L * 24, 0, 24, 1)
    assert report.storages[bias.storage_id].nbytes == B * 1 * L * 24 * 4  # 4608 bytes
    # the logsumexp is padded to a multiple of 32 queries: 2 * 4 * 32 floats = 1024 bytes
    assert _saves(report, "ScaledDotProductEfficientAttentionBackward0")["log_sumexp"].view_nbytes == B * H * 32 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask, causal, gqa, scale", [
    (None, False, False, None), ("bool", False, False, None), ("float", False, False, -0.3),
    (None, True, False, None), (None, False, True, 0.5), (None, True, True, None)])
def test_math_with_dropout_is_the_composite_with_cudas_dropout(dtype, mask, causal, gqa, scale, monkeypatch):
    """With dropout, CUDA's math kernel is ATen's composite whose at::dropout is native_dropout: the
    emulation runs it in Python. With the meta device's dropout in its place, it must build the very
    graph torch's composite builds (node by node, the same saves), so only the dropout node differs."""
    def graph(out):
        found, stack, seen = [], [out.grad_fn], set()
        while stack:
            n = stack.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            saved = [(a, tuple(getattr(n, a).shape), getattr(n, a).dtype) for a in sorted(dir(n))
                     if a.startswith("_saved_") and isinstance(getattr(n, a), torch.Tensor)]
            found.append((n.name(), saved))
            stack.extend(f for f, _ in n.next_functions)
        return found

    q, k, v = _qkv(d=8, dtype=dtype, kv_heads=2 if gqa else H)
    attn_mask = {None: None, "bool": _mask(L, L), "float": _mask(B, 1, L, L, dtype=dtype)}[mask]
    call = SdpaCall(q, k, v, attn_mask, 0.25, causal, scale, gqa)
    composite = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.25, is_causal=causal,
                                               scale=scale, enable_gqa=gqa)
    fused = graph(cuda_choices.run(call, "math"))
    monkeypatch.setattr(cuda_choices, "native_dropout", lambda x, p: torch.dropout(x, p, True))
    assert graph(cuda_choices.run(call, "math")) == graph(composite)
    differs = [(a, b) for a, b in zip(fused, graph(composite)) if a != b]
    (((cuda_node, cuda_saves), (meta_node, meta_saves)),) = differs
    assert (cuda_node, meta_node) == ("NativeDropoutBackward0", "MulBackward0")
    assert [s[2] for s in cuda_saves] == [torch.bool] and [s[2] for s in meta_saves] == [torch.float32]


# -- Hugging Face models on meta, bf16, target cuda -----------------------------------------------

SEQ = 24  # differs from every head dim below, so an L x L save is recognised by its last two dims


def _hf_on_meta(transformers, config):
    from conftest import TINY_HF

    with torch.device("meta"):
        model = getattr(transformers, TINY_HF[config.model_type][1])(config)
    return model.to(torch.bfloat16).train()


def _ids():
    return {"input_ids": torch.zeros(2, SEQ, dtype=torch.long, device="meta")}


def _probabilities(report):
    """Float saves whose last two dims are SEQ x SEQ: attention probabilities, dropped or not (the
    value matmul keeps them as B*H x L x L)."""
    return [t for t in report.tensors if t.held and len(t.shape) >= 3 and t.shape[-2:] == (SEQ, SEQ)
            and t.dtype in ("float32", "bfloat16", "float16")]


def _attention_nodes(report):
    return [n for n in report.nodes if n.name.startswith("ScaledDotProduct")]


@pytest.mark.parametrize("dropout, kernel, node", [(0.1, "flash", "ScaledDotProductFlashAttentionBackward0"),
                                                   (0.125, "cudnn", "ScaledDotProductCudnnAttentionBackward0")])
def test_bert_in_bf16_holds_no_probabilities_on_cuda(dropout, kernel, node, transformers, tiny_hf_config):
    # BERT's SDPA call: no mask (no padding), attention dropout in training, head dim 32 / 2 = 16.
    # cuDNN takes dropout only in multiples of 1/16: 0.1 goes to flash, 0.125 to cuDNN
    config = tiny_hf_config("bert", attn_implementation="sdpa", attention_probs_dropout_prob=dropout)
    model = _hf_on_meta(transformers, config)
    cuda, cpu = gradaudit.audit(model, _ids(), target="cuda"), gradaudit.audit(model, _ids())
    nodes = _attention_nodes(cuda)
    assert [n.name for n in nodes] == [node] * 2
    assert {(n.attention.kernel, n.attention.device, n.attention.dropout_p) for n in nodes} == {
        (kernel, "cuda", dropout)}
    assert not _probabilities(cuda)
    saves = [t for t in cuda.tensors if t.node == node]
    # per layer: query, key, value and output, 2 x 2 heads x 24 x 16 bf16 = 3072 bytes each, and a
    # float32 logsumexp per (batch, head, query): 2 * 2 * 24 * 4 = 384 bytes
    assert sorted(t.view_nbytes for t in saves if t.attr in ("query", "key", "value", "output")) == [3072] * 8
    assert sorted(t.view_nbytes for t in saves if "logsumexp" in t.attr) == [384] * 2
    # the CPU's choice is its math kernel (it takes no dropout on CPU): the probabilities in float32
    # (its math upcasts bf16), 2 * 2 * 24 * 24 * 4 = 9216 bytes, its float dropout mask and the dropped
    # probabilities the value matmul keeps, per layer
    assert {t.view_nbytes for t in _probabilities(cpu)} == {9216} and len(_probabilities(cpu)) == 6
    # dropout: the embeddings', and after the attention output and the feed-forward of both layers:
    # five masks of 2 x 24 x 32, one byte per element on CUDA: 1536 bytes each
    masks = [t for t in cuda.tensors if t.node == "NativeDropoutBackward0"]
    assert [(t.dtype, t.view_nbytes) for t in masks] == [("bool", 2 * SEQ * 32)] * 5
    assert "GA402" not in {f.code for f in cuda.findings} and "GA801" not in {f.code for f in cuda.findings}
    # each a byte per element for one bit (GA403): as bits 1536 / 8 = 192 bytes, 1344 freed per mask
    assert sorted(f.bytes for f in cuda.findings if f.code == "GA403") == [1536 - 192] * 5
    assert any("took the kernels" in n and "H100" in n for n in cuda.notes)


def test_llama_in_bf16_takes_cudnn_on_cuda(transformers, tiny_hf_config):
    # Llama's SDPA call: causal flag, no mask, 4 query heads sharing 2 key/value heads (enable_gqa),
    # head dim 32 / 4 = 8, no attention dropout: cuDNN takes it on an H100
    model = _hf_on_meta(transformers, tiny_hf_config("llama", attn_implementation="sdpa"))
    cuda = gradaudit.audit(model, _ids(), target="cuda")
    nodes = _attention_nodes(cuda)
    assert [n.name for n in nodes] == ["ScaledDotProductCudnnAttentionBackward0"] * 2
    assert {(n.attention.kernel, n.attention.causal) for n in nodes} == {("cudnn", True)}
    assert not _probabilities(cuda)
    saves = [t for t in cuda.tensors if t.node == "ScaledDotProductCudnnAttentionBackward0"]
    # per layer: query and output 2 x 4 x 24 x 8 bf16 = 3072 bytes, key and value (2 heads) 1536
    # bytes, logsumexp 2 * 4 * 24 * 1 float32 = 768 bytes
    assert sorted((t.attr, t.view_nbytes) for t in saves if t.attr in ("query", "key", "value", "output",
                                                                        "logsumexp")) == sorted(
        [("query", 3072), ("output", 3072), ("key", 1536), ("value", 1536), ("logsumexp", 768)] * 2)
    # standing for the CPU, the meta run takes the CPU's flash kernel: no probabilities either
    assert not _probabilities(gradaudit.audit(model, _ids()))


def _register_padded_attention(transformers, mask):
    """An attention function that hands SDPA a padding mask (``mask``) the model would build from an
    attention_mask: on meta, Hugging Face's own mask helpers read values (.item())."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def padded(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("gradaudit_test_padded_sdpa", padded)
    return "gradaudit_test_padded_sdpa"


def test_bert_with_a_mask_the_fused_kernels_refuse_holds_probabilities(transformers, tiny_hf_config):
    # hidden 48, 4 heads: head dim 12. Without a mask flash takes it (padded to 16). With a padding
    # mask: flash takes no mask, the memory-efficient kernel needs head dims that are multiples of 8
    # in bf16, cuDNN too (and dropout 0.1 is no multiple of 1/16): the math kernel runs
    mask = torch.ones(2, 1, SEQ, SEQ, dtype=torch.bool, device="meta")
    masked = tiny_hf_config("bert", hidden_size=48, num_attention_heads=4,
                            attn_implementation=_register_padded_attention(transformers, mask))
    report = gradaudit.audit(_hf_on_meta(transformers, masked), _ids(), target="cuda")
    assert not _attention_nodes(report)
    calls = {n.attention for n in report.nodes if n.attention is not None}
    assert {(c.kernel, c.masked) for c in calls} == {("math", True)}
    (call, *_) = calls
    assert [name for name, _ in call.passed_over] == ["cudnn", "flash", "efficient"]
    # per layer: the probabilities (float32: math upcasts bf16) 2 x 4 x 24 x 24 x 4 = 18432 bytes,
    # CUDA's bool dropout mask of them 4608 bytes, the dropped probabilities the value matmul keeps
    # 18432 bytes
    held = sorted((t.node, t.dtype, t.view_nbytes) for t in _probabilities(report))
    assert held == sorted([("SafeSoftmaxBackward0", "float32", 18432), ("BmmBackward0", "float32", 18432)] * 2)
    masks = [t for t in report.tensors if t.node == "NativeDropoutBackward0" and t.shape[-2:] == (SEQ, SEQ)]
    assert [(t.dtype, t.view_nbytes) for t in masks] == [("bool", 4608)] * 2
    # GA801 explains it per layer (no fused CUDA kernel takes these arguments, with or without
    # dropout) and promises no bytes
    findings = [f for f in report.findings if f.code == "GA801"]
    assert len(findings) == 2
    for finding in findings:
        assert "no fused cuda kernel takes these arguments" in finding.message
        assert "flash: an attn_mask" in finding.message and "efficient: head dims not multiples of 8" in finding.message
        assert finding.severity == "info" and finding.bytes == 0 and "can_use_flash_attention" in finding.fix

    unmasked = tiny_hf_config("bert", hidden_size=48, num_attention_heads=4, attn_implementation="sdpa")
    fused = gradaudit.audit(_hf_on_meta(transformers, unmasked), _ids(), target="cuda")
    assert [n.name for n in _attention_nodes(fused)] == ["ScaledDotProductFlashAttentionBackward0"] * 2
    assert not _probabilities(fused)


def test_ga801_names_the_cuda_kernel_dropout_rules_out():
    # query, key and value start 4 elements into their storage (not a multiple of 8 for bf16: the
    # memory-efficient kernel refuses them), a mask rules out flash, and cuDNN, the one fused kernel
    # left, takes dropout only in multiples of 1/16: with dropout 0.1 the math kernel runs
    x = torch.randn(B, H, L, 20, device="meta", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.zeros(L, L, device="meta", dtype=torch.bfloat16)
    report = gradaudit.audit(_Attention(mask, 0.1, head_slice=4), x, target="cuda")
    (finding,) = [f for f in report.findings if f.code == "GA801"]
    assert "dropout_p=0.1 rules out the CUDA cudnn kernel (dropout 0.1 is not a multiple of 1/16)" \
        in finding.message and "1/16" in finding.fix and finding.severity == "waste"
    # measured, the forward without dropout (cuDNN) against this one (math):
    # math keeps the scaled query and key in float32 for the first matmul (8 x 24 x 16 x 4 = 12288
    # bytes each), the probabilities (2 x 4 x 24 x 24 float32 = 18432), CUDA's bool dropout mask
    # (4608), the value in float32 (12288) and the dropped probabilities (18432) for the second
    # matmul, and three 8-byte scalars: 78360 bytes.
    # cuDNN keeps query, key and value (views into 2 x 4 x 24 x 20 bf16 storages, 7680 bytes each),
    # logsumexp (2 x 4 x 24 float32 = 768), the output (2 x 4 x 24 x 16 bf16 = 6144), seed and offset
    # (16) and the three scalars (24): 29992 bytes (the mask is the module's own tensor: not counted)
    without = gradaudit.audit(_Attention(mask, 0.0, head_slice=4), x, target="cuda")
    assert [n.name for n in _attention_nodes(without)] == ["ScaledDotProductCudnnAttentionBackward0"]
    assert (report.saved_bytes, without.saved_bytes) == (78360, 29992)
    assert finding.bytes == 78360 - 29992
    assert not [f for f in gradaudit.audit(_Attention(mask, 0.125, head_slice=4), x, target="cuda").findings
                if f.code == "GA801"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_resnets_in_the_five_scenarios_give_the_cpu_figures_as_cudnn_nodes(arch):
    # the bar: on meta with target="cuda" every batch norm is cuDNN's, every held save has a
    # verdict, and held, reclaimable and bit-packing figures equal a real CPU audit's in each
    # selective-differentiation scenario (cuDNN's eval statistics and reserve space are empty)
    torchvision = pytest.importorskip("torchvision")
    from gradaudit.scenarios import SCENARIOS, apply_scenario

    for scenario in SCENARIOS:
        torch.manual_seed(0)
        cpu, x = getattr(torchvision.models, arch)(num_classes=10), torch.randn(2, 3, 64, 64)
        apply_scenario(cpu, scenario, x)
        with torch.device("meta"):
            meta = getattr(torchvision.models, arch)(num_classes=10)
        x_meta = torch.randn(2, 3, 64, 64, device="meta")
        apply_scenario(meta, scenario, x_meta)
        on_cpu, as_cuda = gradaudit.audit(cpu, x), gradaudit.audit(meta, x_meta, target="cuda")
        assert {n.name for n in as_cuda.nodes if "BatchNorm" in n.name} == {"CudnnBatchNormBackward0"}, scenario
        assert not [t for t in as_cuda.held_tensors if t.verdict == "unknown"], scenario
        figures = ("saved_bytes", "reclaimable_bytes", "reclaimable_with_bitpacking_bytes")
        assert [getattr(as_cuda, f) for f in figures] == [getattr(on_cpu, f) for f in figures], scenario


def test_trim_acts_on_cudnn_batch_norm_nodes_as_the_audit_says():
    # trim decides from the same op knowledge: on meta under the CUDA emulation (cuDNN batch norm),
    # a trimmed forward holds exactly what the audit's figures leave: saved - reclaimable with bit-packing
    torchvision = pytest.importorskip("torchvision")
    from gradaudit.measure import held_bytes_after_forward
    from gradaudit.meta import standing_for
    from gradaudit.scenarios import apply_scenario

    with torch.device("meta"):
        model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 64, 64, device="meta")
    apply_scenario(model, "input-only-bn-eval", x)
    report = gradaudit.audit(model, x, target="cuda")
    assert report.reclaimable_with_bitpacking_bytes > 0.9 * report.saved_bytes
    with standing_for("cuda"):
        plain = held_bytes_after_forward(model, x)
        with gradaudit.trim(model) as handle:
            trimmed = held_bytes_after_forward(model, x)
    assert plain == report.saved_bytes
    assert trimmed == report.saved_bytes - report.reclaimable_with_bitpacking_bytes
    assert handle.stats["dropped"] > 0
