"""JSON reporter: the versioned document, golden, every finding pointing at its documentation."""

import dataclasses
import json
from pathlib import Path

from gradaudit.report import annotations, jsonout
from gradaudit.rules.registry import get_rule

ROOT = Path(__file__).resolve().parents[1]


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
        # the rule's page in the source repository, which exists (docs/generate.py writes one per rule)
        assert f["docs_url"] == f"docs/rules/{f['code']}.md"
        assert (ROOT / f["docs_url"]).is_file(), f["docs_url"]


def test_a_served_site_gives_findings_an_address_there(report, monkeypatch):
    monkeypatch.setenv("GRADAUDIT_DOCS_URL", "https://docs.example.org/gradaudit/")
    finding = report.findings[0]
    assert finding.to_dict()["docs_url"] == f"https://docs.example.org/gradaudit/rules/{finding.code}/"
    sarif = annotations.sarif(report)
    rules = sarif["runs"][0]["tool"]["driver"]["rules"]
    assert {r["helpUri"] for r in rules} == {f"https://docs.example.org/gradaudit/rules/{r['id']}/" for r in rules}
    monkeypatch.delenv("GRADAUDIT_DOCS_URL")
    # a path in the repository is no absolute address: SARIF's helpUri is left out
    assert all("helpUri" not in r for r in annotations.sarif(report)["runs"][0]["tool"]["driver"]["rules"])


def test_non_finite_scalars_stay_strict_json(report):
    node = dataclasses.replace(report.nodes[0], scalars={"max": float("inf"), "min": float("-inf")})
    odd = dataclasses.replace(report, nodes=[node] + report.nodes[1:])
    document = json.loads(jsonout.render(odd))  # would raise on a bare Infinity token
    assert document["nodes"][0]["scalars"] == {"max": "inf", "min": "-inf"}


def test_compact(report):
    assert "\n" not in jsonout.render(report, indent=None).rstrip("\n")
