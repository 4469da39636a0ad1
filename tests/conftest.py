"""Fixtures shared by the test files: the golden model's reports and small third-party models.

transformers and torchvision are optional (the suite also runs without them): only the fixtures
that need one import it, with pytest.importorskip, so a test asking for such a fixture is skipped
and every other test in its file still runs. torch is imported inside the fixtures too, so that
collecting tests that need none of this stays cheap.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GOLDEN_MODEL = Path(__file__).parent / "golden" / "model.py"


@pytest.fixture(autouse=True, scope="session")
def _meta_kernels_checked():
    """Every meta op the suite answers from ``gradaudit.kernel_cache`` runs its kernel too, and a
    remade output that differs from the kernel's fails the test that made it: the whole suite is the
    cache's cross-check."""
    from gradaudit import kernel_cache

    with kernel_cache.checking():
        yield


# -- the golden model (tests/golden/model.py) ----------------------------------------------------


@pytest.fixture(scope="session")
def golden():
    """tests/golden/model.py, loaded by path: build_report(), assert_golden(), MARKUP."""
    spec = importlib.util.spec_from_file_location("golden_model", GOLDEN_MODEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report(golden):
    """The golden model's normalised report (the one behind tests/golden/report.*)."""
    return golden.build_report()


@pytest.fixture(scope="module")
def hostile_report(golden):
    """The golden model's report with its head module named ``golden.MARKUP`` (a script tag)."""
    return golden.build_report(head_name=golden.MARKUP)


# -- Hugging Face transformers from tiny configs -------------------------------------------------

# family -> (config class, model class, config arguments): two layers, hidden size 32, vocab 100
TINY_HF = {
    "bert": ("BertConfig", "BertModel",
             dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  vocab_size=100, max_position_embeddings=64)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0,
                  eos_token_id=0)),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=64, vocab_size=100)),
}


def hf_checkpointing(model, on: bool = True, use_reentrant: bool = False) -> None:
    """Turn a Hugging Face model's own activation checkpointing on or off by the name the installed
    transformers recommends (5.x deprecates gradient_checkpointing_enable/disable, with a FutureWarning)."""
    if on:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()


@pytest.fixture(scope="session")
def transformers():
    """The transformers module; skips the test where it is not installed."""
    return pytest.importorskip("transformers")


@pytest.fixture
def tiny_hf_config(transformers):
    """``tiny_hf_config(family, **overrides)``: the TINY_HF config of "bert", "gpt2" or "llama"."""
    def build(family: str, **overrides):
        config_class, _, arguments = TINY_HF[family]
        return getattr(transformers, config_class)(**{**arguments, **overrides})
    return build


@pytest.fixture
def tiny_hf_model(transformers, tiny_hf_config):
    """``tiny_hf_model(family, **config_overrides)``: torch seeded with 0, then the family's model
    class (BertModel, GPT2LMHeadModel, LlamaForCausalLM) built from its tiny config."""
    def build(family: str, **overrides):
        import torch

        torch.manual_seed(0)
        return getattr(transformers, TINY_HF[family][1])(tiny_hf_config(family, **overrides))
    return build


# -- torchvision ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def torchvision():
    """The torchvision module; skips the test where it is not installed."""
    return pytest.importorskip("torchvision")


@pytest.fixture
def vision_model(torchvision):
    """``vision_model(name)``: torch seeded with 0, then torchvision.models.<name>(num_classes=10);
    "vit" is a 2-layer VisionTransformer for 64x64 images (hidden 64, patches of 16)."""
    def build(name: str):
        import torch

        torch.manual_seed(0)
        if name == "vit":
            return torchvision.models.VisionTransformer(image_size=64, patch_size=16, num_layers=2, num_heads=2,
                                                        hidden_dim=64, mlp_dim=128, num_classes=10)
        return getattr(torchvision.models, name)(num_classes=10)
    return build

