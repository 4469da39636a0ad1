"""The meta device: same graph, same bytes, no memory and no compute."""

import resource

import pytest
import torch
from torch import nn

import gradaudit


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(2))
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 16, 3, padding=1))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.body(self.stem(x))
        return self.head(h.mean((2, 3)))


def _fingerprint(report):
    return [(t.node, t.attr, t.shape, t.dtype, t.storage_id, t.storage_kind, t.module, t.verdict, t.managed_by)
            for t in report.tensors]


def _both(build, inputs_of, **audit_kwargs):
    torch.manual_seed(0)
    cpu_model = build()
    cpu = gradaudit.audit(cpu_model, inputs_of("cpu"), **audit_kwargs)
    with torch.device("meta"):
        meta_model = build()
    meta = gradaudit.audit(meta_model, inputs_of("meta"), **audit_kwargs)
    return cpu, meta


@pytest.mark.parametrize("trainable", [None, ["body.3.*", "head.*"]])
def test_cnn_on_meta_matches_cpu(trainable):
    cpu, meta = _both(lambda: SmallCNN().train(), lambda device: torch.randn(2, 3, 16, 16, device=device),
                      trainable=trainable)
    assert meta.device == "meta" and {t.device for t in meta.held_tensors} == {"meta"}
    assert cpu.saved_bytes > 0
    assert (meta.saved_bytes, meta.reclaimable_bytes, meta.reclaimable_with_bitpacking_bytes) == (
        cpu.saved_bytes, cpu.reclaimable_bytes, cpu.reclaimable_with_bitpacking_bytes)
    assert _fingerprint(meta) == _fingerprint(cpu)
    assert [(f.code, f.module, f.bytes) for f in meta.findings] == [(f.code, f.module, f.bytes) for f in cpu.findings]


def test_cnn_in_eval_on_meta_matches_cpu_batch_norm_statistics_included():
    # In eval mode the CPU batch-norm kernel returns save_mean/save_invstd (result1/result2) empty,
    # the meta kernel (like CUDA's native one) 8 floats each: standing for the CPU, the emulation gives
    # them the CPU's shape, (0,). Before, the meta audit held 2 BatchNorm2d(8) * 2 statistics * 8
    # channels * 4 bytes = 128 bytes more than the CPU's, and a compiled region's graph too.
    cpu, meta = _both(lambda: SmallCNN().eval(), lambda device: torch.randn(2, 3, 16, 16, device=device))
    stats = [t for t in meta.tensors if t.node == "NativeBatchNormBackward0" and t.attr in ("result1", "result2")]
    assert len(stats) == 4 and all(tuple(t.shape) == (0,) for t in stats)
    assert (meta.saved_bytes, meta.reclaimable_bytes) == (cpu.saved_bytes, cpu.reclaimable_bytes)
    assert _fingerprint(meta) == _fingerprint(cpu)
    assert not any("bytes more would be freed" in n for n in meta.notes)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_llama_on_meta_matches_cpu(attention, transformers, tiny_hf_config):
    # "sdpa": scaled_dot_product_attention would pick a fused kernel on CPU but the math fallback
    # on meta; gradaudit.meta.CpuKernelChoices makes the meta run take the CPU's kernel
    config = tiny_hf_config("llama", attn_implementation=attention)

    def inputs_of(device):
        return {"input_ids": torch.arange(32, device="cpu").reshape(2, 16).to(device)}

    cpu, meta = _both(lambda: transformers.LlamaForCausalLM(config), inputs_of, trainable=["model.layers.1.*"])
    assert cpu.saved_bytes > 0
    assert (meta.saved_bytes, meta.reclaimable_bytes) == (cpu.saved_bytes, cpu.reclaimable_bytes)
    assert _fingerprint(meta) == _fingerprint(cpu)
    if attention == "sdpa":  # the fused kernel holds no L x L probabilities
        assert "ScaledDotProductFlashAttentionForCpuBackward0" in {t.node for t in meta.held_tensors}


def test_meta_sdpa_with_a_mask_takes_the_cpu_kernel():
    # A float mask and no causal flag: CPU picks flash for this case too; both devices must save
    # the same tensors (4 heads, seq 16, head dim 8)
    def run(device):
        q = torch.randn(2, 4, 16, 8, device=device, requires_grad=True)
        mask = torch.zeros(2, 1, 16, 16, device=device)
        model = _Attention(mask)
        return gradaudit.audit(model, q)

    cpu, meta = run("cpu"), run("meta")
    assert _fingerprint(meta) == _fingerprint(cpu)
    assert meta.saved_bytes == cpu.saved_bytes


class _Attention(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, q):
        return torch.nn.functional.scaled_dot_product_attention(q, q * 2, q * 3, attn_mask=self.mask)


def test_a_huge_model_on_meta_allocates_nothing():
    # 8 blocks of Linear(16384, 16384): 8 * 16384**2 * 4 bytes = 8 GiB of weights, and at batch
    # 4096 each saved activation is 4096*16384*4 = 256 MiB. Any real allocation would show in RSS.
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(16384, 16384), nn.BatchNorm1d(16384), nn.GELU())
                                for _ in range(8)]).train()
    x = torch.randn(4096, 16384, device="meta")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    report = gradaudit.audit(model, x)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 256
    # per block: addmm saves mat1 (the block input; block 0's is the caller's input), BN saves its
    # input (the addmm output) and 2 per-channel stats, GELU its input (the BN output):
    # 7 inputs of later blocks + 8 addmm outputs + 8 BN outputs = 23 * 256 MiB, + 8 * 2 * 16384 * 4 stats
    # (the block input of block k+1 is block k's GELU output, distinct from the tensors above)
    assert report.saved_bytes == 23 * 4096 * 16384 * 4 + 8 * 2 * 16384 * 4
    assert report.device == "meta"


# -- autocast: meta tensors carry no Autocast dispatch key; gradaudit.meta.AutocastOnMeta emulates it


class _Autocast(nn.Module):
    """Runs the wrapped module under torch.autocast(device_type, dtype)."""

    def __init__(self, inner, device_type="cpu", dtype=torch.bfloat16):
        super().__init__()
        self.inner, self.device_type, self.dtype = inner, device_type, dtype

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.inner(*args, **kwargs)


def _dtypes(report):
    return [(t.node, t.attr, t.dtype, t.shape) for t in report.tensors]


def _frozen_middle_mlp():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))
    mlp[2].requires_grad_(False)
    return _Autocast(mlp)


def test_autocast_mlp_on_meta_matches_cpu():
    cpu, meta = _both(_frozen_middle_mlp, lambda device: torch.randn(32, 64, device=device))
    # all in bf16 (2 bytes): first addmm's mat1 (the input cast) 32*64*2 = 4096, ReLU result
    # 32*128*2 = 8192, the frozen weight's bf16 copy saved by the middle addmm 128*128*2 = 32768
    # (GA701), GELU input 8192, last addmm's mat1 8192 and its weight copy 128*10*2 = 2560: 64000
    assert cpu.saved_bytes == meta.saved_bytes == 64000
    assert _dtypes(meta) == _dtypes(cpu)
    assert {t.dtype for t in meta.tensors} == {"bfloat16"}
    assert [(f.code, f.module, f.bytes) for f in meta.findings] == [(f.code, f.module, f.bytes) for f in cpu.findings]
    assert "GA701" in {f.code for f in meta.findings}
    assert not meta.notes


class _AutocastCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1, padding_mode="reflect")
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.c2(torch.relu(self.bn(self.c1(x))))  # BN takes bf16 (not in a list)
            h = torch.cat([h, h * 2], 1)[:, :16]  # cat: promote
            return self.head(h.mean((2, 3))).softmax(-1)


def test_autocast_cnn_on_meta_matches_cpu():
    cpu, meta = _both(lambda: _AutocastCNN().train(), lambda device: torch.randn(2, 3, 16, 16, device=device))
    assert cpu.saved_bytes == meta.saved_bytes > 0
    assert _dtypes(meta) == _dtypes(cpu)
    assert "bfloat16" in {t.dtype for t in meta.tensors}
    assert [f.code for f in meta.findings] == [f.code for f in cpu.findings]


class _AutocastComposites(nn.Module):
    """Functions autocast reaches only inside: einsum, tensordot and multi_dot reach bmm / mm;
    nn.MultiheadAttention's forward is Python calling linear, bmm and softmax."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16))
        self.v = nn.Parameter(torch.randn(16, 8))
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.mha.requires_grad_(False)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.einsum("bsd,de->bse", x, self.w)
            h = h + torch.tensordot(x, self.w, dims=1).to(h.dtype)
            g = torch.linalg.multi_dot([x.flatten(0, 1), self.w, self.v]).view(2, 5, 8)
            return self.mha(g, h[..., :8], h[..., 8:])[0]


def test_autocast_composites_on_meta_match_cpu():
    cpu, meta = _both(_AutocastComposites, lambda device: torch.randn(2, 5, 8, device=device, requires_grad=True))
    assert cpu.saved_bytes == meta.saved_bytes > 0
    assert _dtypes(meta) == _dtypes(cpu)
    assert ("BmmBackward0", "self", "bfloat16", (4, 5, 5)) in _dtypes(meta)  # inside the attention
    assert [f.code for f in meta.findings] == [f.code for f in cpu.findings]
    assert not meta.notes


def test_autocast_inside_an_lstm_is_noted_on_meta():
    # CPU autocast casts inside aten::lstm (mkldnn_rnn_layer), out of reach of a Python-level mode
    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(4, 4, batch_first=True)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.lstm(x)[0]

    with torch.device("meta"):
        model = Recurrent()
    report = gradaudit.audit(model, torch.randn(2, 3, 4, device="meta"))
    assert any(n.startswith("autocast (cpu) on meta: lstm") for n in report.notes)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "bert"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_autocast_hf_on_meta_matches_cpu(family, attention, transformers, tiny_hf_config):
    from conftest import TINY_HF

    model_class = getattr(transformers, TINY_HF[family][1])
    config = tiny_hf_config(family, attn_implementation=attention)
    layer = {"llama": "inner.model.layers.1.*", "bert": "inner.encoder.layer.1.*"}[family]

    def inputs_of(device):
        return {"input_ids": torch.arange(32).reshape(2, 16).to(device)}

    cpu, meta = _both(lambda: _Autocast(model_class(config)), inputs_of, trainable=[layer])
    assert (meta.saved_bytes, meta.reclaimable_bytes) == (cpu.saved_bytes, cpu.reclaimable_bytes)
    assert _dtypes(meta) == _dtypes(cpu)
    assert [(f.code, f.bytes) for f in meta.findings] == [(f.code, f.bytes) for f in cpu.findings]
    assert "GA701" in {f.code for f in meta.findings}


def test_autocast_cuda_on_meta_casts_as_cuda():
    # a forward written for CUDA; without CUDA torch.autocast("cuda") turns itself off, so the
    # context is set directly. CUDA casts linear to fp16 and runs layer_norm and softmax in fp32.
    x = torch.randn(4, 8, device="meta", requires_grad=True)
    with torch.device("meta"):
        lin, norm = nn.Linear(8, 8), nn.LayerNorm(8)
    from gradaudit.meta import AutocastOnMeta

    previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.float16)
    try:
        with AutocastOnMeta("cpu"):
            h = lin(x)
            n = norm(h)
            s = torch.nn.functional.softmax(h, -1)  # passes dtype=None on: float32 accumulation
            nrm = torch.norm(h)
            cpu_style = torch.mm(h, h.t())
    finally:
        torch.set_autocast_enabled("cuda", previous[0])
        torch.set_autocast_dtype("cuda", previous[1])
    assert (h.dtype, n.dtype, s.dtype, nrm.dtype, cpu_style.dtype) == (
        torch.float16, torch.float32, torch.float32, torch.float32, torch.float16)
    assert h.grad_fn.next_functions[0][0].name() == "ToCopyBackward0"  # the bias cast


def test_autocast_on_an_unemulated_device_is_noted():
    class XpuAutocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            with torch.autocast("xpu", dtype=torch.bfloat16):
                return self.lin(x)

    with torch.device("meta"):
        model = XpuAutocast()
    report = gradaudit.audit(model, torch.randn(2, 4, device="meta"))
    assert any("torch.autocast('xpu')" in n and "cannot emulate" in n for n in report.notes)


_F = torch.nn.functional
# CPU autocast per op: lower precision, float32, promote, and ops it leaves alone
_AUTOCAST_CALLS = {
    "linear": lambda t: _F.linear(t(4, 8), t(6, 8), t(6)),
    "conv2d": lambda t: _F.conv2d(t(1, 2, 8, 8), t(3, 2, 3, 3)),
    "conv_transpose1d": lambda t: _F.conv_transpose1d(t(1, 2, 8), t(2, 3, 3)),
    "matmul @": lambda t: t(3, 4) @ t(4, 5),
    "Tensor.mm": lambda t: t(3, 4).mm(t(4, 5)),
    "baddbmm": lambda t: torch.baddbmm(t(2, 3, 5), t(2, 3, 4), t(2, 4, 5)),
    "vecdot": lambda t: torch.linalg.vecdot(t(3, 4), t(3, 4)),
    "sdpa": lambda t: _F.scaled_dot_product_attention(t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8)),
    "einsum": lambda t: torch.einsum("bij,bjk->bik", t(2, 3, 4), t(2, 4, 5)),
    "einsum one operand": lambda t: torch.einsum("ii->i", t(3, 3)),
    "float64 linear": lambda t: _F.linear(t(3, 4, dtype=torch.float64), t(5, 4, dtype=torch.float64)),
    "cat promotes": lambda t: torch.cat([t(2, 2, dtype=torch.bfloat16), t(2, 2)]),
    "cat low": lambda t: torch.cat([t(2, 2, dtype=torch.bfloat16), t(2, 2, dtype=torch.bfloat16)]),
    "mse_loss fp32": lambda t: _F.mse_loss(t(3, 4, dtype=torch.bfloat16), t(3, 4, dtype=torch.bfloat16)),
    "cross_entropy fp32": lambda t: _F.cross_entropy(t(3, 4, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.long,
                                                                                   device=t(1).device)),
    "reflect pad fp32": lambda t: _F.pad(t(1, 2, 5, 5, dtype=torch.bfloat16), (1, 1, 1, 1), mode="reflect"),
    "constant pad": lambda t: _F.pad(t(1, 2, 5, 5, dtype=torch.bfloat16), (1, 1, 1, 1)),
    "max_pool3d fp32": lambda t: _F.max_pool3d(t(1, 1, 4, 4, 4, dtype=torch.bfloat16), 2),
    "layer_norm untouched": lambda t: _F.layer_norm(t(3, 4, dtype=torch.bfloat16), (4,)),
    "softmax untouched": lambda t: _F.softmax(t(3, 4, dtype=torch.bfloat16), -1),
}


@pytest.mark.parametrize("name", list(_AUTOCAST_CALLS))
def test_autocast_on_meta_gives_each_op_the_cpu_dtype(name):
    from gradaudit.meta import AutocastOnMeta, CpuKernelChoices

    def tensor_on(device):
        return lambda *shape, dtype=torch.float32: torch.randn(*shape, dtype=dtype, device=device).requires_grad_()

    call = _AUTOCAST_CALLS[name]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu = call(tensor_on("cpu"))
        with CpuKernelChoices(), AutocastOnMeta():  # as audit() enters them on meta
            meta = call(tensor_on("meta"))
    assert meta.device.type == "meta" and meta.dtype == cpu.dtype
    assert meta.grad_fn.name() == cpu.grad_fn.name()


def test_float32_grouped_mm_on_meta_has_the_cpu_kernels_layout():
    # the meta kernel accepts bfloat16 only; the CPU kernel (and CUDA's fallback) take float32 and
    # pad each output row to 16 bytes: a 10 x 6 float32 output has row stride 8 (9*8 + 6 = 78 floats)
    from gradaudit.meta import DeviceKernelsOnMeta

    offs = torch.tensor([2, 5, 8, 10], dtype=torch.int32)
    cases = [(torch.randn(10, 16), torch.randn(4, 6, 16).transpose(-2, -1), offs),  # padded rows
             (torch.randn(10, 16), torch.randn(4, 16, 8), offs),
             (torch.randn(4, 10, 16), torch.randn(4, 6, 16).transpose(-2, -1), None)]
    for x, w, o in cases:
        on_cpu = torch._grouped_mm(x, w, offs=o)
        with DeviceKernelsOnMeta():
            on_meta = torch._grouped_mm(x.to("meta"), w.to("meta"), offs=None if o is None else o.to("meta"))
        assert (on_meta.shape, on_meta.stride(), on_meta.dtype) == (on_cpu.shape, on_cpu.stride(), on_cpu.dtype)
        assert on_meta.untyped_storage().nbytes() == on_cpu.untyped_storage().nbytes()
    assert on_cpu.stride() == (80, 8, 1)


_LOSSES = {
    "mse_loss": lambda a, b: nn.functional.mse_loss(a, b),
    "smooth_l1_loss": lambda a, b: nn.functional.smooth_l1_loss(a, b, reduction="sum"),
    "binary_cross_entropy": lambda a, b: nn.functional.binary_cross_entropy(a.sigmoid(), b.sigmoid()),
    "soft_margin_loss": lambda a, b: nn.functional.soft_margin_loss(a, b),
    "huber_loss": lambda a, b: nn.functional.huber_loss(a, b),  # a 4-byte scalar on the CPU too
    "mse_loss (none)": lambda a, b: nn.functional.mse_loss(a, b, reduction="none"),
}


@pytest.mark.parametrize("name", list(_LOSSES))
def test_a_cpu_loss_on_meta_holds_the_buffer_its_cpu_kernel_reduces(name):
    # the CPU's mse_loss (and three more) returns its mean as a 0-dim view of the elementwise buffer:
    # a (8, 16, 64) float32 input's loss holds 8*16*64*4 = 32768 bytes as long as the loss lives
    from gradaudit.meta import DeviceKernelsOnMeta

    a, b = torch.randn(8, 16, 64, requires_grad=True), torch.randn(8, 16, 64)
    on_cpu = _LOSSES[name](a, b)
    with DeviceKernelsOnMeta("cpu"):
        on_meta = _LOSSES[name](a.to("meta"), b.to("meta"))
    assert on_meta.shape == on_cpu.shape
    assert on_meta.untyped_storage().nbytes() == on_cpu.untyped_storage().nbytes()
    expected = 4 if name == "huber_loss" else 32768
    assert on_cpu.untyped_storage().nbytes() == expected
    with DeviceKernelsOnMeta("cuda"):  # no GPU answer measured: the meta kernel's, unchanged
        assert _LOSSES[name](a.to("meta"), b.to("meta")).untyped_storage().nbytes() in (4, 32768)


def test_a_step_with_a_mean_squared_error_fits_on_meta_as_on_the_cpu():
    # the loss is alive through the step's backward and optimizer step: its buffer with it
    def build(device):
        torch.manual_seed(0)
        with torch.device(device):
            return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))

    x, y = torch.randn(256, 64), torch.randn(256, 64)
    targets = {"cpu": y, "meta": y.to("meta")}  # made before the step, as a data loader's batch
    loss = lambda output: nn.functional.mse_loss(output, targets[output.device.type])  # noqa: E731
    on_cpu = gradaudit.fit(build("cpu"), x, memory="1GiB", loss=loss)
    on_meta = gradaudit.fit(build("meta"), x.to("meta"), memory="1GiB", loss=loss)
    assert on_meta.peak_bytes == on_cpu.peak_bytes and on_meta.breakdown == on_cpu.breakdown


@pytest.mark.parametrize("operand", ["input", "weight", "neither"])
def test_a_convolution_on_meta_returns_the_layout_the_cpu_kernel_returns(operand):
    # oneDNN (and cuDNN) answer a channels-last input or weight with a channels-last output; the meta
    # kernel with a contiguous one, which changes what later views and matrix products do
    from gradaudit.meta import DeviceKernelsOnMeta

    x, w = torch.randn(2, 8, 6, 6), torch.randn(4, 8, 3, 3)
    if operand == "input":
        x = x.contiguous(memory_format=torch.channels_last)
    if operand == "weight":
        w = w.contiguous(memory_format=torch.channels_last)
    on_cpu = nn.functional.conv2d(x, w, padding=1)
    with DeviceKernelsOnMeta():
        on_meta = nn.functional.conv2d(x.to("meta"), w.to("meta"), padding=1)
    assert (on_meta.shape, on_meta.stride()) == (on_cpu.shape, on_cpu.stride())
    assert on_cpu.is_contiguous(memory_format=torch.channels_last) == (operand != "neither")


def test_segformer_on_meta_is_audited_as_on_the_cpu():
    """SegFormer's depthwise convolution takes a transposed sequence viewed as an image (channels-last
    strides); its output, flattened and transposed back, is contiguous on the CPU and on a GPU, so the
    Linear after it is one AddmmBackward0 (seen on an H100, torch 2.11): on meta too."""
    transformers = pytest.importorskip("transformers")

    def build(device):
        torch.manual_seed(0)
        config = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                              num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=3)
        with torch.device(device):
            return transformers.SegformerForSemanticSegmentation(config).train()

    batch = {"pixel_values": torch.randn(2, 3, 64, 64), "labels": torch.randint(0, 3, (2, 64, 64))}

    def saves(report):
        return sorted((t.node, t.attr, tuple(t.shape), t.held) for t in report.tensors)

    on_cpu = gradaudit.audit(build("cpu"), batch)
    on_meta = gradaudit.audit(build("meta"), batch)
    assert on_meta.saved_bytes == on_cpu.saved_bytes and saves(on_meta) == saves(on_cpu)
    assert sum(t.node == "AddmmBackward0" for t in on_meta.tensors) > sum(t.node == "MmBackward0" for t in on_meta.tensors)


@pytest.mark.parametrize("parameters", ["same", "float32"], ids=["parameters-same", "parameters-float32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm", ["layer", "batch-train", "batch-eval", "group", "layer-no-affine"])
def test_normalisation_statistics_on_meta_have_the_cpu_kernels_dtype(norm, dtype, parameters):
    """On the CPU, a reduced-precision layer, batch or group norm saves its mean and rstd in the input's
    dtype, or in float32 beside float32 parameters; meta's kernels say float32 (layer, batch) or the
    input's (group) whatever the parameters."""
    def build():
        torch.manual_seed(0)
        module = {"layer": lambda: nn.LayerNorm(16), "layer-no-affine": lambda: nn.LayerNorm(16, elementwise_affine=False),
                  "batch-train": lambda: nn.BatchNorm1d(16), "batch-eval": lambda: nn.BatchNorm1d(16).eval(),
                  "group": lambda: nn.GroupNorm(4, 16)}[norm]()
        model = nn.Sequential(nn.Linear(16, 16), module, nn.Linear(16, 16)).to(dtype)
        if parameters == "float32":
            model[1].float()
        return model

    x = torch.randn(8, 16, dtype=dtype)
    on_cpu = gradaudit.audit(build(), x)
    on_meta = gradaudit.audit(build().to("meta"), x.to("meta"))

    def saves(report):
        # (eval-mode batch norm's statistics are empty on the CPU, and on meta standing for it:
        # test_cnn_in_eval_on_meta_matches_cpu_batch_norm_statistics_included; their dtype is compared too)
        return [(t.node, t.attr, t.dtype, t.shape, report.storages[t.storage_id].nbytes if t.storage_id >= 0 else None)
                for t in report.tensors]

    assert saves(on_meta) == saves(on_cpu)
    assert on_meta.saved_bytes == on_cpu.saved_bytes


def test_the_storage_tracker_riding_on_the_emulation_sees_what_it_sees_as_a_mode_of_its_own():
    # tracking.Lifetimes entered right above the meta emulation's KnownValues is told of each op by it
    # (one dispatch mode fewer); pushed as a mode of its own (the observer slot taken) it calls each op
    # itself: the samples, the storages, their sizes, births, deaths and makers must be the same
    from gradaudit.meta import standing_for
    from gradaudit.tracking import Lifetimes

    with torch.device("meta"):
        torch.manual_seed(0)
        model = SmallCNN()
        x = torch.randn(4, 3, 16, 16, requires_grad=True)

    def lives(ride: bool):
        model.zero_grad(set_to_none=True)  # each step's gradients made, not accumulated
        x.grad = None
        with standing_for("cpu") as emulation:
            if not ride:
                emulation.values.observer = lambda func, args, out: None  # taken: Lifetimes pushes itself
            lifetimes = Lifetimes([])
            with lifetimes:
                assert (lifetimes._host is emulation.values) == ride
                model(x).sum().backward()
            emulation.values.observer = None
        return lifetimes.samples, [(life.nbytes, life.born, life.died, life.op) for life in lifetimes.lives]

    riding, pushed = lives(True), lives(False)
    assert riding == pushed
    assert riding[0] > 50 and len(riding[1]) > 20  # a step's ops and storages, not an empty run


def test_a_ctc_loss_with_tensor_lengths_on_meta_runs_the_cpu_kernel():
    """F.ctc_loss with lengths as tensors (as transformers gives them): the CPU copies them to lists and
    runs the kernel that takes lists (CtcLossBackward0; the mean divided by float lengths), where meta ran
    _ctc_loss.Tensor (CtcLossBackward1, which also saves both lengths: 40 bytes more here)."""
    class Ctc(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 10)

        def forward(self, x, targets, mask):
            steps = self.proj(x).log_softmax(-1).view(4, 2, 10)
            return nn.functional.ctc_loss(steps, targets, mask.sum(-1), (targets > 0).sum(-1))

    inputs = (torch.randn(8, 16), torch.tensor([[1, 2], [3, 4]]), torch.ones(2, 4, dtype=torch.long))
    cpu, meta = _both(Ctc, lambda device: inputs)
    assert {t.node for t in meta.tensors if t.node.startswith("Ctc")} == {"CtcLossBackward0"}
    assert meta.saved_bytes == cpu.saved_bytes and _fingerprint(meta) == _fingerprint(cpu)
    assert not [n for n in meta.notes if "nobody knows" in n]  # the lengths' values were known
