"""``target="cuda"`` under another torch release than the installed one: the GPU machine may run 2.11
while the laptop runs 2.15. Each release's kernel-choice rules, as ``gradaudit/cuda_choices.py``'s
docstring says where each was read, and the mismatches an H100 with torch 2.11.0+cu130 showed against
2.14's rules (shared/notes/gpu-facts.md), reproduced on meta with the 2.11 rules.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from click.testing import CliRunner

import gradaudit
from gradaudit import GradauditError, cuda_choices
from gradaudit.cli import cli
from gradaudit.cuda_choices import Gpu, SdpaCall
from test_target import SEQ, _attention_nodes, _hf_on_meta, _ids, _mask, _probabilities, _qkv, \
    _register_padded_attention

B, H, L, D = 2, 4, 24, 64


def _h100(release, cudnn=None):
    """An H100 under ``release``'s rules with the cuDNN its default CUDA wheel bundles (or ``cudnn``)."""
    return Gpu("H100", (9, 0), cudnn or cuda_choices.BUNDLED_CUDNN[release], torch=release)


@pytest.fixture(autouse=True)
def _cudnn_preferred(monkeypatch):
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)


# -- what each release's default CUDA wheel bundles ----------------------------------------------

def test_a_release_brings_the_cudnn_its_default_wheel_pins():
    # nvidia-cudnn-cu13 pinned in the METADATA of the PyPI wheels: 2.11.0 9.19.0.56, 2.12.0 and 2.13.0
    # 9.20.0.48, 2.14.1 9.24, 2.15.0 9.26.0.51 (read 2026-11-26)
    assert {f"2.{minor}": cuda_choices.target_gpu(torch_release=f"2.{minor}").cudnn for minor in range(11, 16)
            if (2, minor) != cuda_choices.default_gpu().torch} == {
        f"2.{minor}": number for (major, minor), number in cuda_choices.BUNDLED_CUDNN.items()
        if (major, minor) != cuda_choices.default_gpu().torch}
    assert cuda_choices.BUNDLED_CUDNN == {(2, 11): 91900, (2, 12): 92000, (2, 13): 92000, (2, 14): 92400,
                                         (2, 15): 92600}
    # the installed release keeps the installed torch's own cuDNN (where it has one)
    installed = cuda_choices.default_gpu()
    assert cuda_choices.target_gpu().cudnn == installed.cudnn
    assert installed.torch == cuda_choices.installed_release()


def test_target_values_are_read_as_people_write_them():
    assert cuda_choices.parse_release("2.11") == cuda_choices.parse_release("2.11.0+cu130") == (2, 11)
    assert cuda_choices.parse_cudnn("9.19") == cuda_choices.parse_cudnn("9.19.0") == cuda_choices.parse_cudnn(91900) \
        == 91900
    assert cuda_choices.parse_gpu("A100") == ("A100", (8, 0))
    assert cuda_choices.parse_gpu("nvidia h200") == ("H200", (9, 0))
    assert cuda_choices.parse_gpu("sm90")[1] == cuda_choices.parse_gpu("9.0")[1] == (9, 0)
    gpu = cuda_choices.target_gpu("A100", "2.11", "9.20")
    assert (gpu.name, gpu.capability, gpu.torch, gpu.cudnn) == ("A100", (8, 0), (2, 11), 92000)
    assert gpu.describe() == "an A100 (sm80) with cuDNN 9.20 under torch 2.11"


@pytest.mark.parametrize("call, message", [
    (lambda: cuda_choices.parse_release("2.9"), "knows the kernel choices of torch 2.11 to 2.15"),
    (lambda: cuda_choices.parse_release("latest"), "write it as 2.11"),
    (lambda: cuda_choices.parse_cudnn("8.9"), "cuDNN 9"),
    (lambda: cuda_choices.parse_cudnn("nine"), "write it as 9.19"),
    (lambda: cuda_choices.parse_gpu("Z80"), "name one of A100"),
])
def test_a_target_value_gradaudit_cannot_stand_for_is_refused(call, message):
    with pytest.raises(GradauditError, match=message):
        call()


def test_assume_gpu_holds_for_its_block_only():
    before = cuda_choices.assumed_gpu()
    with gradaudit.assume_gpu("A100", torch="2.11") as gpu:
        assert cuda_choices.assumed_gpu() == gpu and gpu.torch == (2, 11) and gpu.cudnn == 91900
    assert cuda_choices.assumed_gpu() == before


# -- the rules that differ, call by call ---------------------------------------------------------

@pytest.mark.parametrize("release, masked, kernel", [
    # cuDNN refuses a dropout that is not a multiple of 1/16 from 2.12 (check_cudnn_dropout); 2.11
    # takes 0.1. Without a mask flash is next, with one (flash takes none) memory-efficient
    ((2, 11), False, "cudnn"), ((2, 11), True, "cudnn"),
    ((2, 12), False, "flash"), ((2, 13), True, "efficient"),
    ((2, 14), False, "flash"), ((2, 14), True, "efficient"), ((2, 15), False, "flash"),
])
def test_cudnn_takes_any_dropout_on_2_11_and_multiples_of_a_sixteenth_after(release, masked, kernel):
    call = SdpaCall(*_qkv(), _mask(B, 1, L, L) if masked else None, 0.1)
    assert cuda_choices.choose(call, _h100(release)).kernel == kernel


@pytest.mark.parametrize("release, kernel", [((2, 11), "math"), ((2, 13), "math"), ((2, 14), "efficient"),
                                             ((2, 15), "efficient")])
def test_efficient_attention_takes_grouped_heads_from_2_14(release, kernel):
    # fp32: flash and cuDNN take half precision only, so memory-efficient or math
    call = SdpaCall(*_qkv(dtype=torch.float32, kv_heads=2), enable_gqa=True)
    chosen = cuda_choices.choose(call, _h100(release))
    assert chosen.kernel == kernel
    if kernel == "math":
        assert "grouped key/value heads (enable_gqa): it takes them from torch 2.14" in dict(chosen.passed_over)[
            "efficient"]
    # the same heads without grouping: memory-efficient on every release
    assert cuda_choices.choose(SdpaCall(*_qkv(dtype=torch.float32)), _h100(release)).kernel == "efficient"
    # in bf16 cuDNN takes grouped heads on every release (the 2.11 H100 ran a bf16 Llama on cuDNN)
    grouped = SdpaCall(*_qkv(kv_heads=2), enable_gqa=True)
    assert cuda_choices.choose(grouped, _h100(release)).kernel == "cudnn"


@pytest.mark.parametrize("release, cudnn, keys, causal, kernel", [
    # 2.15 on sm90 below cuDNN 9.26: non-causal with 64 mod 128 keys (192 = 128 + 64) is not cuDNN's
    ((2, 15), 92400, 192, False, "flash"),
    ((2, 15), 92600, 192, False, "cudnn"),  # fixed in cuDNN 9.26, which 2.15's wheel bundles
    ((2, 15), 92400, 256, False, "cudnn"),  # 256 = 0 mod 128
    ((2, 14), 92400, 192, False, "cudnn"),  # 2.14 has no such check
])
def test_2_15_passes_cudnn_over_for_64_mod_128_keys_below_cudnn_9_26(release, cudnn, keys, causal, kernel):
    call = SdpaCall(*_qkv(keys=keys), is_causal=causal)
    assert cuda_choices.choose(call, _h100(release, cudnn)).kernel == kernel


def test_the_rule_is_sm90s_and_not_causal_attention():
    a100 = Gpu("A100", (8, 0), 92400, torch=(2, 15))  # sm80 does not prefer cuDNN: flash first anyway
    assert cuda_choices.choose(SdpaCall(*_qkv(keys=192)), a100).kernel == "flash"
    causal = SdpaCall(*(t[:, :, :192] for t in _qkv(keys=192)), is_causal=True)
    assert causal.query.size(-2) == 24  # queries 24, keys 192: causal with more keys than queries
    assert cuda_choices.choose(causal, _h100((2, 15), 92400)).kernel == "cudnn"


# -- the mismatch classes the 2.11 H100 showed, reproduced end to end on meta ---------------------

@pytest.mark.parametrize("masked", [False, True], ids=["ids alone", "padded"])
def test_bert_in_bf16_with_dropout_takes_cudnn_under_2_11(masked, transformers, tiny_hf_config):
    """BERT-family encoders (and GPT-2) in bf16 with attention dropout 0.1 in training: the 2.11 H100 ran
    cuDNN attention, with a padding mask and without; 2.14's rules choose flash, or memory-efficient
    where there is a mask (flash takes none)."""
    attention = "sdpa"
    if masked:
        mask = torch.ones(2, 1, SEQ, SEQ, dtype=torch.bool, device="meta")
        attention = _register_padded_attention(transformers, mask)
    config = tiny_hf_config("bert", attn_implementation=attention, attention_probs_dropout_prob=0.1)
    model = _hf_on_meta(transformers, config)
    with gradaudit.assume_gpu("H100", torch="2.11"):
        old = gradaudit.audit(model, _ids(), target="cuda")
    with gradaudit.assume_gpu("H100", torch="2.14"):
        new = gradaudit.audit(model, _ids(), target="cuda")
    assert [n.name for n in _attention_nodes(old)] == ["ScaledDotProductCudnnAttentionBackward0"] * 2
    later = "ScaledDotProductEfficientAttentionBackward0" if masked else "ScaledDotProductFlashAttentionBackward0"
    assert [n.name for n in _attention_nodes(new)] == [later] * 2
    assert any("under torch 2.11" in note and "cudnn x2" in note for note in old.notes)
    # the fused kernels save query, key, value, output and the additive mask they were given (the
    # padded case: 2 x 1 x 24 x 24 bf16, 2304 bytes, as attn_bias; memory-efficient's broadcast over
    # the 2 heads), never the probabilities
    for report in (old, new):
        assert [t.attr for t in _probabilities(report)] == (["attn_bias"] * 2 if masked else [])
        assert {report.storages[t.storage_id].nbytes for t in _probabilities(report)} == ({2304} if masked else set())


def test_llama_in_fp32_with_grouped_heads_takes_math_under_2_11(transformers, tiny_hf_config):
    """fp32 decoders with grouped key/value heads and no mask (transformers passes enable_gqa=True):
    the 2.11 H100 ran the math kernel (BmmBackward0, SafeSoftmaxBackward0), which holds the
    probabilities; 2.14's memory-efficient kernel takes grouped heads."""
    from conftest import TINY_HF

    config = tiny_hf_config("llama", attn_implementation="sdpa")
    assert config.num_key_value_heads < config.num_attention_heads
    with torch.device("meta"):
        model = getattr(transformers, TINY_HF["llama"][1])(config).train()
    with gradaudit.assume_gpu("H100", torch="2.11"):
        old = gradaudit.audit(model, _ids(), target="cuda")
    with gradaudit.assume_gpu("H100", torch="2.14"):
        new = gradaudit.audit(model, _ids(), target="cuda")
    assert not _attention_nodes(old)
    assert {"SafeSoftmaxBackward0", "BmmBackward0"} <= {n.name for n in old.nodes}
    assert [n.name for n in _attention_nodes(new)] == ["ScaledDotProductEfficientAttentionBackward0"] * 2
    # the math kernel holds each layer's softmax output, 2 x 4 heads x 24 x 24 float32 = 18432 bytes
    probabilities = [t for t in _probabilities(old) if t.node == "SafeSoftmaxBackward0"]
    assert [t.view_nbytes for t in probabilities] == [2 * 4 * SEQ * SEQ * 4] * 2
    assert old.saved_bytes > new.saved_bytes


# -- the command line ------------------------------------------------------------------------------

MODEL = textwrap.dedent("""
    import torch
    from torch import nn
    import torch.nn.functional as F


    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)

        def forward(self, x):
            q = self.proj(x).view(2, 24, 4, 16).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


    def build():
        with torch.device("meta"):
            return Attention().to(torch.bfloat16), torch.randn(2, 24, 64, dtype=torch.bfloat16)
""")


@pytest.fixture
def runner(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "attention.py").write_text(MODEL)
    return CliRunner()


def _nodes(runner, *args):
    import json

    result = runner.invoke(cli, ["scan", "attention.py:build", "--device", "meta", "--target", "cuda", "--no-html",
                                 "--json", "-", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    return {n["name"] for n in document["nodes"]}, document["notes"]


def test_the_cli_says_which_torch_and_gpu_the_figures_are_for(runner):
    nodes, notes = _nodes(runner, "--target-torch", "2.11")
    assert "ScaledDotProductCudnnAttentionBackward0" in nodes
    assert any("an H100 (sm90) with cuDNN 9.19 under torch 2.11" in note for note in notes)
    nodes, notes = _nodes(runner, "--target-torch", "2.14", "--target-gpu", "A100", "--target-cudnn", "9.24")
    assert "ScaledDotProductFlashAttentionBackward0" in nodes
    assert any("an A100 (sm80) with cuDNN 9.24 under torch 2.14" in note for note in notes)


@pytest.mark.parametrize("args, message", [
    (["--target-torch", "2.11"], "--target-torch says which GPU --target cuda stands for: add --target cuda"),
    (["--target", "cuda", "--device", "meta", "--target-torch", "2.9"], "--target-torch: torch 2.9: gradaudit knows"),
    (["--target", "cuda", "--device", "meta", "--target-cudnn", "8.9"], "--target-cudnn: cuDNN version '8.9'"),
    (["--target", "cuda", "--device", "meta", "--target-gpu", "Z80"], "--target-gpu: GPU 'Z80'"),
])
def test_the_cli_refuses_a_target_it_cannot_stand_for_in_one_line(runner, args, message):
    result = runner.invoke(cli, ["scan", "attention.py:build", "--no-html", *args], catch_exceptions=False)
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.stderr
