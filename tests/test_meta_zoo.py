"""No memory, every model: the audit on meta equals the CPU audit of the same model and batch, to the byte.

Every architecture of ``hf_zoo`` (decoders, mixture of experts, encoders, encoder-decoders, vision,
audio), built from a small config in train mode with ``use_cache=False``, once with a padded batch
(token ids, an attention mask whose second row ends in padding, labels) and once with ids and labels
alone (half the parameters frozen, as a fine-tune freezes them); torchvision models beside them. The
meta model gets the batch as a collator makes it, on the CPU: its values decide what the model's mask
code does, and gradaudit keeps them beside the meta copies. No case may need an assumption.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gradaudit
from hf_zoo import ARCHS, BATCH, SEQ, batch, build_model

transformers = pytest.importorskip("transformers")


def _figures(report: gradaudit.Report) -> dict:
    """Everything a user reads off a report, by value (storages by size and kind, not by index)."""
    def storage(t):
        return (report.storages[t.storage_id].nbytes, str(report.storages[t.storage_id].kind)) if t.storage_id >= 0 else None

    return {
        "saved": report.saved_bytes,
        "reclaimable": report.reclaimable_bytes,
        "bitpacking": report.reclaimable_with_bitpacking_bytes,
        "tensors": [(t.node, t.attr, t.shape, t.dtype, storage(t), t.module, str(t.verdict), t.held)
                    for t in report.tensors],
        "modules": [(m.path, m.own_bytes, m.total_bytes, m.own_reclaimable_bytes) for m in report.modules],
        "findings": [(f.code, f.module, f.attrs, f.bytes, f.bytes_together) for f in report.findings],
    }


def _frozen_half(model: torch.nn.Module) -> list[str]:
    names = [n for n, _ in model.named_parameters()]
    return names[: len(names) // 2]


@pytest.mark.slow
@pytest.mark.parametrize("padded", [True, False], ids=["padded-mask", "ids-alone"])
@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: a.name)
def test_meta_audit_equals_the_cpu_audit(arch, padded):
    cpu_model = build_model(arch, transformers)
    meta_model = build_model(arch, transformers, device="meta")
    assert any(p.is_meta for p in meta_model.parameters())
    frozen = None if padded else _frozen_half(cpu_model)
    on_cpu = gradaudit.audit(cpu_model, batch(arch, padded), frozen=frozen)
    on_meta = gradaudit.audit(meta_model, batch(arch, padded), frozen=frozen)
    assert on_meta.device == "meta" and on_meta.saved_bytes > 0
    assert not [n for n in on_meta.notes if "nobody knows" in n], on_meta.notes  # no value was assumed
    assert _figures(on_meta) == _figures(on_cpu)


TORCHVISION = ["resnet18", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny", "regnet_x_400mf", "squeezenet1_0"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TORCHVISION)
def test_meta_audit_equals_the_cpu_audit_on_torchvision(name):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    cpu_model = getattr(torchvision.models, name)(num_classes=10).train()
    with gradaudit.meta_device():  # RegNet reads the sizes it computes (.tolist()) while it is built
        meta_model = getattr(torchvision.models, name)(num_classes=10).train()
    x = torch.randn(2, 3, 64, 64)
    frozen = [n for n, _ in cpu_model.named_parameters()][:-6]  # the head trains, as a fine-tune does
    on_cpu = gradaudit.audit(cpu_model, x, frozen=frozen)
    on_meta = gradaudit.audit(meta_model, x.to("meta"), frozen=frozen)
    assert _figures(on_meta) == _figures(on_cpu)


DECODERS = [a for a in ARCHS if a.family in ("decoder", "moe")]


@pytest.mark.slow
@pytest.mark.parametrize("arch", DECODERS, ids=lambda a: a.name)
def test_meta_plan_equals_the_cpu_plan_on_decoders(arch):
    cpu_model = build_model(arch, transformers)
    meta_model = build_model(arch, transformers, device="meta")
    unplanned = gradaudit.audit(cpu_model, batch(arch, True)).saved_bytes
    budget = unplanned // 2
    on_cpu = gradaudit.plan(cpu_model, batch(arch, True), budget, measure_peak=False)
    on_meta = gradaudit.plan(meta_model, batch(arch, True), budget, measure_peak=False)
    assert on_meta.frontier == on_cpu.frontier
    assert (on_meta.held_bytes, on_meta.checkpointed) == (on_cpu.held_bytes, on_cpu.checkpointed)
    assert on_meta.held_bytes <= budget


def test_cuda_target_keeps_probabilities_out_of_padded_decoders():
    # a padded batch on a CUDA target: attention takes a fused kernel that accepts a mask (memory-
    # efficient on an H100 for float32), which saves q, k, v, output, logsumexp and the B x 1 x L x L
    # mask, never the B x H x L x L probabilities the math kernel would keep
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "BertForMaskedLM"):
        arch = next(a for a in ARCHS if a.model == name)
        report = gradaudit.audit(build_model(arch, transformers, device="meta"), batch(arch, True), target="cuda")
        heads = 4
        # the efficient kernel's attn_bias is the mask broadcast over heads (stride 0), not H copies
        per_head = [t for t in report.tensors if tuple(t.shape) == (BATCH, heads, SEQ, SEQ)]
        assert all(t.stride[1] == 0 for t in per_head), name
        assert not [n for n in report.nodes if n.name in ("SoftmaxBackward0", "SafeSoftmaxBackward0")], name
        assert any("Efficient" in n.name or "Flash" in n.name or "Cudnn" in n.name for n in report.nodes), name
        assert not [n for n in report.notes if "nobody knows" in n]


FACTORY = '''
import torch
import transformers


def build():
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").train()
    model.requires_grad_(False)
    model.model.layers[-1].requires_grad_(True)  # the last layer trains
    ids = torch.arange(24).reshape(2, 12) % 96
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, -4:] = 0  # made inside the factory: on --device meta its values are kept
    return model, {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
'''


def test_scan_of_a_stock_decoder_on_meta_equals_the_cpu_scan(tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    from gradaudit.cli import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama_factory.py").write_text(FACTORY)
    documents = {}
    for device in ("cpu", "meta"):
        result = CliRunner().invoke(cli, ["scan", "llama_factory.py:build", "--device", device, "--no-html",
                                          "--json", f"{device}.json"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert "nobody knows" not in result.output
        documents[device] = json.loads((tmp_path / f"{device}.json").read_text())
    cpu, meta = documents["cpu"], documents["meta"]
    assert meta["summary"] == cpu["summary"]
    assert [(t["node"], t["attr"], t["shape"], t["nbytes"]) for t in meta["tensors"]] == \
           [(t["node"], t["attr"], t["shape"], t["nbytes"]) for t in cpu["tensors"]]
    # the padded row made the mask helpers build a 2 x 1 x 12 x 12 mask, which attention saves
    assert any(t["attr"] == "attn_mask" and t["shape"] == [BATCH, 1, SEQ, SEQ] for t in meta["tensors"])


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def test_packed_sequences_on_meta_equal_the_cpu(name):
    # two sequences packed in each row (position ids restart at 0, no attention mask): the model
    # finds the packing from the position ids' values and builds a block-diagonal mask, on meta too
    arch = next(a for a in ARCHS if a.model == name)
    positions = torch.cat([torch.arange(7), torch.arange(SEQ - 7)]).repeat(BATCH, 1)
    packed = {"input_ids": batch(arch, False)["input_ids"], "position_ids": positions,
              "labels": batch(arch, False)["labels"]}
    on_cpu = gradaudit.audit(build_model(arch, transformers), packed)
    on_meta = gradaudit.audit(build_model(arch, transformers, device="meta"), packed)
    assert not [n for n in on_meta.notes if "nobody knows" in n]
    assert _figures(on_meta) == _figures(on_cpu)
    # the packing made a mask, which attention saves (as the CPU run does)
    assert any(t.attr == "attn_mask" for t in on_meta.tensors)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GPT2LMHeadModel"])
def test_meta_plan_peaks_and_baselines_equal_the_cpu(name):
    # every measured step (the plan's, the unplanned one, each baseline's: every block, sqrt(n)
    # segments, whose recomputation in backward must take the same kernels as the forward) predicts
    # on meta the CPU's peak; a linear-probe freezing pattern, a padded batch
    arch = next(a for a in ARCHS if a.model == name)
    layers = "n_layer" if "n_layer" in arch.overrides else "num_hidden_layers"
    arch = dataclasses.replace(arch, overrides={**arch.overrides, layers: 4})  # sqrt(4): 2 segments
    plans = []
    for device in ("cpu", "meta"):
        model = build_model(arch, transformers, device=device)
        names = [n for n, _ in model.named_parameters()]
        trainable = [n for n in names if ".1." in n]  # only the second block trains
        plans.append(gradaudit.plan(model, batch(arch, True), "1GiB", trainable=trainable))
    on_cpu, on_meta = plans
    assert (on_meta.peak_bytes, on_meta.unplanned_peak_bytes) == (on_cpu.peak_bytes, on_cpu.unplanned_peak_bytes)
    assert [(b.name, b.held_bytes, b.peak_bytes) for b in on_meta.baselines] == \
           [(b.name, b.held_bytes, b.peak_bytes) for b in on_cpu.baselines]
    assert any("segments" in b.name for b in on_meta.baselines)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: a.name)
def test_every_architecture_audits_for_a_cuda_target(arch):
    # the CUDA emulation on meta takes every architecture of the zoo in its training configuration
    # (mixture of experts in float32 included: CUDA's grouped-mm fallback), with no value assumed
    report = gradaudit.audit(build_model(arch, transformers, device="meta"), batch(arch, True), target="cuda")
    assert report.target == "cuda" and report.saved_bytes > 0
    assert not [n for n in report.notes if "nobody knows" in n]
