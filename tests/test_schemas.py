"""The JSON documents are what their schemas (generated from ``gradaudit.schemas``) say: real reports,
plans and fits validate, every object's fields are declared (the schemas admit no other), and the
schemas in docs/schemas/ are the code's (``python docs/generate.py --check`` covers the files)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gradaudit
from gradaudit.schemas import DOCUMENTS, json_schema

ROOT = Path(__file__).resolve().parents[1]


def _valid(document: dict, kind: str) -> None:
    # through json first: the file users read, with enums as strings and tuples as lists
    jsonschema.validate(json.loads(json.dumps(document)), json_schema(kind))


class Attention(nn.Module):
    """A block that calls scaled_dot_product_attention (its node carries ``attention``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 4, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def _conv_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Dropout(0.1), nn.Linear(8 * 3 * 3, 4))
    model[0].requires_grad_(False)
    model[1].eval()
    return model


def _stack(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4)])


def test_reports_validate_findings_proofs_attention_and_a_rank():
    conv = gradaudit.audit(_conv_model(), torch.randn(2, 3, 8, 8, requires_grad=True), verify=True).to_dict()
    assert conv["findings"] and conv["verified"]
    _valid(conv, "report")
    attention = gradaudit.audit(Attention(), torch.randn(2, 4, 16)).to_dict()
    assert any(node["attention"] for node in attention["nodes"])
    _valid(attention, "report")
    with gradaudit.fake_world(2, rank=1):
        ranked = gradaudit.audit(_stack(8), torch.randn(4, 8)).to_dict()
    assert ranked["world"]["size"] == 2 and ranked["world"]["rank"] == 1
    _valid(ranked, "report")


def test_plans_validate_by_flops_and_by_time_with_trim():
    x = torch.randn(8, 64)
    _valid(gradaudit.plan(_stack(), x, budget=7000).to_dict(), "plan")
    timed = gradaudit.plan(_stack(), x, budget=7000, cost="time", measure_peak=False).to_dict()
    assert timed["extra_seconds"] is not None and "extra_seconds" in timed["frontier"][0]
    _valid(timed, "plan")
    _valid(gradaudit.plan(_stack(), x, budget=7000, trim=True, measure_peak=False).to_dict(), "plan")


def test_fits_validate_fitting_and_not():
    # a fit with a remedy validates in tests/test_fit.py (test_a_step_that_does_not_fit_gets_...)
    x = torch.randn(64, 64)
    fitting = gradaudit.fit(_stack(), x, memory="1GiB").to_dict()
    assert fitting["fits"] and fitting["remedy"] is None
    _valid(fitting, "fit")
    # 4 x (64 x 64 + 64) float32 parameters, their gradients and AdamW's two states: 266,240 B before
    # any activation: no remedy fits 200,000 B, and levers are named
    short = gradaudit.fit(_stack(), x, memory=200_000).to_dict()
    assert not short["fits"] and short["remedy"] is None and short["levers"]
    _valid(short, "fit")


def test_a_field_the_schema_does_not_declare_fails_validation():
    document = gradaudit.fit(_stack(8), torch.randn(4, 8), memory="1GiB").to_dict()
    _valid(document, "fit")
    with pytest.raises(jsonschema.ValidationError, match="undeclared"):
        _valid({**document, "undeclared": 1}, "fit")
    nested = json.loads(json.dumps(document))
    nested["levers"] = [{"name": "x", "saves_bytes": 1, "assumes": "", "how": "", "undeclared": 0}]
    with pytest.raises(jsonschema.ValidationError, match="undeclared"):
        _valid(nested, "fit")


def test_every_declared_field_has_a_description_and_the_schema_files_are_the_codes():
    def walk(fields, where):
        for name, spec in fields.items():
            assert spec.description.strip(), f"{where}{name} has no description"
            if spec.fields:
                walk(spec.fields, f"{where}{name}.")

    for kind, fields in DOCUMENTS.items():
        walk(fields, f"{kind}: ")
        on_disk = json.loads((ROOT / "docs" / "schemas" / f"{kind}.schema.json").read_text(encoding="utf-8"))
        assert on_disk == json_schema(kind), f"docs/schemas/{kind}.schema.json is stale: run python docs/generate.py"
    with pytest.raises(ValueError, match="unknown document 'plans'"):
        json_schema("plans")
