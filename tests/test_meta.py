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


def test_cnn_in_eval_on_meta_differs_only_by_batch_norm_statistics():
    # A torch kernel difference, not gradaudit's: in eval mode the CPU batch-norm kernel returns
    # empty save_mean/save_invstd (result1/result2), the meta kernel (like CUDA's) returns C floats.
    cpu, meta = _both(lambda: SmallCNN().eval(), lambda device: torch.randn(2, 3, 16, 16, device=device))
    # 2 BatchNorm2d(8) * 2 statistics * 8 channels * 4 bytes = 128
    assert meta.saved_bytes - cpu.saved_bytes == 128
    # not needed in eval on both devices, but no finding reports them (GA201 flags the input only):
    # no figure counts them, a note on meta says how much they hold
    assert meta.reclaimable_bytes == cpu.reclaimable_bytes
    assert any(n.startswith("128 bytes more would be freed") for n in meta.notes)

    def without_stats(report):
        return [f[:2] + f[4:] if f[1] in ("result1", "result2") else f for f in _fingerprint(report)]

    assert without_stats(meta) == without_stats(cpu)


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
