"""JSON reporter: the versioned document, golden, every finding pointing at its documentation."""

import dataclasses
import json

from gradaudit.report import jsonout
from gradaudit.rules.registry import get_rule


def test_golden(report, golden):
    golden.assert_golden("report.json", jsonout.render(report))


def test_document_is_the_report(report):
    document = json.loads(jsonout.render(report))
    assert document["schema_version"] == 1
    assert document == json.loads(json.dumps(report.to_dict()))
    assert document["summary"]["saved_bytes"] == report.saved_bytes
    assert len(document["tensors"]) == len(report.tensors)


def test_every_finding_names_its_rule_and_docs(report):
    findings = json.loads(jsonout.render(report))["findings"]
    assert findings
    for f in findings:
        rule = get_rule(f["code"])
        assert f["name"] == rule.name
        assert f["docs"] == f"gradaudit explain {f['code']}"


def test_non_finite_scalars_stay_strict_json(report):
    node = dataclasses.replace(report.nodes[0], scalars={"max": float("inf"), "min": float("-inf")})
    odd = dataclasses.replace(report, nodes=[node] + report.nodes[1:])
    document = json.loads(jsonout.render(odd))  # would raise on a bare Infinity token
    assert document["nodes"][0]["scalars"] == {"max": "inf", "min": "-inf"}


def test_compact(report):
    assert "\n" not in jsonout.render(report, indent=None).rstrip("\n")
