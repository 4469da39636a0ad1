"""The rule catalogue on fixture models (expectations written next to the code) and real models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradaudit
from gradaudit.rules.registry import all_rules
from tests.fixtures.rule_models import (FIXTURES, CustomFunctionWaste, DropoutMLP, EagerAttention, LanguageModelLoss,
                                        InputGradMLP, LastTokenHead)
from tests.rule_harness import actual, audit_fixture, expected, expected_details


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda f: f.__name__)
def test_fixture_findings_match_expect_comments(fixture):
    report = audit_fixture(fixture)
    assert expected(fixture), "a fixture without expectations tests nothing"
    assert actual(fixture, report) == expected(fixture)


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda f: f.__name__)
def test_fixture_findings_carry_the_bytes_and_message_written_beside_them(fixture):
    report = audit_fixture(fixture)
    for (line, code), (nbytes, fragment) in expected_details(fixture).items():
        found = [f for f in report.findings if f.code == code and f.source and f.source.endswith(f":{line}")]
        assert len(found) == 1, (line, code)
        if nbytes is not None:
            assert found[0].bytes == nbytes, (line, code, found[0].bytes)
        if fragment is not None:
            assert fragment in found[0].message, (line, code, found[0].message)


def test_expectations_with_details_exist():
    assert sum(len(expected_details(f)) for f in FIXTURES) >= 10


def test_every_rule_has_a_fixture():
    covered = {code for fixture in FIXTURES for _, code in expected(fixture)}
    assert covered == {r.code for r in all_rules()}


def test_findings_carry_a_pasteable_fix():
    for fixture in FIXTURES:
        for finding in audit_fixture(fixture).findings:
            compile(finding.fix_code, finding.code, "exec")  # a snippet that parses
            assert finding.fix and finding.fix_code


@pytest.mark.parametrize("fixture, code, module, expected", [
    # the float mask 8*64*4 = 2048 bytes becomes 8*64/8 = 64 bytes of bits: 2048 - 64 = 1984
    (DropoutMLP, "GA402", None, 8 * 64 * 4 - 8 * 64 // 8),
    # h is 2*32*64*4 = 16384 bytes; the saved h[:, -1] covers 2*64*4 = 512: 16384 - 512 = 15872
    (LastTokenHead, "GA601", None, 2 * 32 * 64 * 4 - 2 * 64 * 4),
    # probabilities 2*2*12*12*4 = 2304 bytes, saved by softmax (result) and the value matmul (a view);
    # SDPA keeps a logsumexp of 2*2*12*4 = 192 bytes: 2304 - 192 = 2112
    (EagerAttention, "GA801", None, 2 * 2 * 12 * 12 * 4 - 2 * 2 * 12 * 4),
    # GELU keeps its input, body's 8x32 float32 output: 8*32*4 = 1024 bytes, in module "act"
    (InputGradMLP, "GA501", "act", 8 * 32 * 4),
    # float32 log-probabilities of 2*8 positions over 20,000 classes: 2*8*20000*4 = 1,280,000 bytes
    (LanguageModelLoss, "GA702", None, 2 * 8 * 20000 * 4),
], ids=["dropout-mask", "view-keeps-base", "attention", "input-gradient-per-module", "loss-log-probabilities"])
def test_finding_bytes(fixture, code, module, expected):
    finding, = [f for f in audit_fixture(fixture).findings if f.code == code]
    assert finding.bytes == expected
    if module is not None:
        assert finding.module == module


def test_static_mode_does_not_guess_about_unknown_ops():
    report = audit_fixture(CustomFunctionWaste, verify=False)
    assert not [f for f in report.findings if f.code == "GA000"]
    assert any(u["node"] == "_SavesTooMuchBackward" for u in report.unexplained)


# -- real models -------------------------------------------------------------------------------

def codes(report):
    return {f.code for f in report.findings}


@pytest.fixture
def small_bert(transformers, tiny_hf_config):
    """``small_bert(cls_name)``: the tiny BERT with vocab 64 and 32 positions, eager attention, in
    train mode, and 2 x 32 token ids."""
    def build(cls_name="BertForSequenceClassification"):
        config = tiny_hf_config("bert", vocab_size=64, max_position_embeddings=32)
        model = getattr(transformers, cls_name)._from_config(config, attn_implementation="eager")
        return model.train(), {"input_ids": torch.randint(0, 64, (2, 32))}
    return build


@pytest.mark.slow
def test_resnet18_input_only_bn_eval(torchvision):
    model = torchvision.models.resnet18().eval().requires_grad_(False)
    report = gradaudit.audit(model, torch.randn(2, 3, 64, 64, requires_grad=True))
    assert {"GA101", "GA201", "GA301", "GA401"} <= codes(report)
    # every conv but the stem (its input is the caller's) saves an unneeded input: 20 - 1 = 19
    assert sum(f.code == "GA101" for f in report.findings) == 19


def test_resnet18_weight_norm_stem_ga102(torchvision):
    model = torchvision.models.resnet18()
    model.conv1 = torch.nn.utils.parametrizations.weight_norm(model.conv1)
    report = gradaudit.audit(model, torch.randn(2, 3, 32, 32))
    finding, = [f for f in report.findings if f.code == "GA102"]
    assert finding.module == "conv1"
    assert finding.bytes == 64 * 3 * 7 * 7 * 4  # the normalised 64x3x7x7 float32 weight: 37632


@pytest.mark.slow
def test_resnet18_only_fc_trains_with_input_grad_ga501(torchvision):
    model = torchvision.models.resnet18().eval()
    report = gradaudit.audit(model, torch.randn(2, 3, 32, 32, requires_grad=True), trainable=["fc.*"])
    per_module = {f.module: f.bytes for f in report.findings if f.code == "GA501"}
    assert "bn1" in per_module and all(b > 0 for b in per_module.values())
    # without the input's requires_grad, nothing below fc is recorded at all
    plain = gradaudit.audit(model, torch.randn(2, 3, 32, 32), trainable=["fc.*"])
    assert plain.saved_bytes == 0 or "GA501" not in codes(plain)


@pytest.mark.slow
def test_resnet18_autocast_ga701(torchvision):
    class Autocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torchvision.models.resnet18()

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.net(x)

    report = gradaudit.audit(Autocast(), torch.randn(2, 3, 32, 32), trainable=["net.conv1.*", "net.fc.*"])
    flagged = {f.module for f in report.findings if f.code == "GA701"}
    assert "net.layer1.0.conv1" in flagged and "net.fc" not in flagged


@pytest.mark.slow
def test_bert_eager_attention_dropout_and_pooler_view(small_bert):
    model, inputs = small_bert()
    report = gradaudit.audit(model, inputs)
    assert {"GA402", "GA601", "GA801"} <= codes(report)
    attention = [f for f in report.findings if f.code == "GA801"]
    assert len(attention) == 2  # one per layer
    assert any(f.module == "bert.pooler.dense" for f in report.findings if f.code == "GA601")


def test_resnet_checkpoint_hygiene_ga901_ga902(torchvision):
    net = torchvision.models.resnet18()

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            n = self.net
            h = n.maxpool(n.relu(n.bn1(n.conv1(x))))  # frozen stem: h needs no grad
            h = torch.utils.checkpoint.checkpoint(n.layer1, h, use_reentrant=True)
            h = n.layer2(h)
            h = torch.utils.checkpoint.checkpoint(n.layer3, h, use_reentrant=False)
            return n.fc(torch.flatten(n.avgpool(n.layer4(h)), 1))

    with pytest.warns(UserWarning):  # torch's own warning about the reentrant block
        report = gradaudit.audit(Checkpointed().train(), torch.randn(2, 3, 32, 32), frozen=["net.conv1.*", "net.bn1.*"])
    assert {f.module for f in report.findings if f.code == "GA901"} >= {"net.layer1.0.conv1", "net.layer1.0.bn1"}
    assert not [f for f in report.findings if f.code == "GA901" and not f.module.startswith("net.layer1")]
    ga902 = {f.module for f in report.findings if f.code == "GA902"}
    assert "net.layer3.0.bn1" in ga902 and not [m for m in ga902 if not m.startswith("net.layer3")]


@pytest.mark.slow
def test_bert_verify_finds_no_rule_bugs(small_bert):
    model, inputs = small_bert("BertModel")
    report = gradaudit.audit(model, inputs, verify=True)
    assert not report.disagreements


def test_a_finding_that_frees_nothing_is_information_not_waste():
    # Every layer trains: the ReLU's result is also the next conv's saved input, which the conv's
    # weight gradient needs in full. Bit-packing the ReLU's copy frees nothing, so the finding
    # stays visible but as "info" and does not fail assert_no_waste.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    images = torch.randn(2, 3, 12, 12)
    report = gradaudit.audit(model, images)
    relu = [f for f in report.findings if f.code == "GA401"]
    assert len(relu) == 1 and relu[0].severity == "info"
    assert relu[0].bytes == 0 and relu[0].bytes_together == 0
    assert "nothing would be freed" in relu[0].message
    assert relu[0] not in report.waste_findings
    assert report.reclaimable_with_bitpacking_bytes == 0
    gradaudit.assert_no_waste(model, images)


def test_a_finding_needed_for_a_combined_fix_stays_waste():
    # ReLU -> max-pool -> frozen conv: the ReLU's result is held by the ReLU (sign only) and by the
    # max-pool (not needed). Neither fix alone frees it; both together do, so both stay "waste".
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3))
    model[3].requires_grad_(False)
    report = gradaudit.audit(model, torch.randn(2, 3, 12, 12))
    by_code = {f.code: f for f in report.findings}
    assert by_code["GA301"].severity == "waste" and by_code["GA401"].severity == "waste"
    assert by_code["GA301"].bytes == 0 and by_code["GA401"].bytes == 0
    # the ReLU result is 2*4*10*10 floats = 3200 bytes; bit-packed it keeps ceil(800/8) = 100
    assert by_code["GA301"].bytes_together + by_code["GA401"].bytes_together == 3200 - 100


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_sdpa_with_attention_dropout_names_the_cause_not_sdpa(family, tiny_hf_config, transformers):
    """Hugging Face's default attention is SDPA; in training its attention dropout sends the CPU
    call to the math kernel, which keeps the L x L probabilities. GA801 must say that, not advise
    SDPA, and its bytes are what a forward without attention dropout gives back (measured)."""
    from gradaudit.measure import held_bytes_after_forward

    dropout = {"bert": "attention_probs_dropout_prob", "gpt2": "attn_pdrop"}[family]
    model_class = {"bert": transformers.BertModel, "gpt2": transformers.GPT2LMHeadModel}[family]

    def build(p):
        torch.manual_seed(0)
        return model_class._from_config(tiny_hf_config(family, **{dropout: p}), attn_implementation="sdpa").train()

    ids = {"input_ids": torch.randint(0, 100, (2, 16))}
    report = gradaudit.audit(build(0.1), ids)
    (finding,) = [f for f in report.findings if f.code == "GA801"]
    assert "dropout_p=0.1" in finding.message and "math kernel" in finding.message
    assert "scaled_dot_product_attention" not in finding.fix  # never advise what is already done
    # independent measurement: held bytes with attention dropout minus held bytes without it
    assert finding.bytes == held_bytes_after_forward(build(0.1), ids) - held_bytes_after_forward(build(0.0), ids) > 0
    assert not [f for f in gradaudit.audit(build(0.0), ids).findings if f.code == "GA801"]
    assert not [f for f in gradaudit.audit(build(0.1).eval(), ids).findings if f.code == "GA801"]


def test_a_loss_over_a_large_vocabulary_names_the_cast_and_a_small_one_is_not_flagged():
    report = audit_fixture(LanguageModelLoss)
    finding, = [f for f in report.findings if f.code == "GA702"]
    assert "16 positions over 20,000 classes" in finding.message and "from logits cast to float32" in finding.message
    assert finding.rewrite and finding.severity == "waste"
    # 16,384 classes or fewer: the rule stays silent (a classifier's head is not a vocabulary)
    head = nn.Linear(16, 1000)
    small = gradaudit.audit(nn.Sequential(head, nn.LogSoftmax(-1)), torch.randn(4, 16))
    assert not [f for f in small.findings if f.code == "GA702"]
