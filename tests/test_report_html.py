"""HTML reporter: golden document, escaping of user data, self-contained, graph or install hint."""

import json
import re
import shutil

import pytest

from gradaudit.report import graph, html, views
from gradaudit.report.units import human_bytes


def _no_dot(monkeypatch):
    def missing():
        raise graph.GraphvizMissing("dot missing (test)")
    monkeypatch.setattr(graph, "dot_program", missing)


def _embedded(document: str):
    match = re.search(r'<script id="gradaudit-data" type="application/json">(.*?)</script>', document, re.S)
    return json.loads(match.group(1))


def test_golden_without_dot(report, golden, monkeypatch):
    # Graphviz's SVG differs between versions, so the golden document is the one drawn without dot
    _no_dot(monkeypatch)
    golden.assert_golden("report.html", html.render(report))


def test_missing_dot_still_renders_everything(report, monkeypatch):
    _no_dot(monkeypatch)
    document = html.render(report)
    assert "apt-get install graphviz" in document and "brew install graphviz" in document
    for anchor in ('id="summary"', 'id="memory"', 'id="findings"', 'id="timeline"', 'id="tensors"'):
        assert anchor in document
    assert "<svg" in document  # the timeline is still drawn


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed")
def test_graph_inlined(report):
    document = html.render(report)
    assert "<?xml" not in document and "<!DOCTYPE svg" not in document
    assert document.count('class="graph"') >= 1 and "apt-get install graphviz" not in document


def test_summary_cards_and_findings(report, monkeypatch):
    _no_dot(monkeypatch)
    document = html.render(report)
    for figure in (report.saved_bytes, report.reclaimable_bytes, report.reclaimable_with_bitpacking_bytes):
        assert f'<div class="value">{human_bytes(figure)}</div>' in document
    for code in {f.code for f in report.findings}:
        assert f"<code>{code}</code>" in document
    assert "Why:</b>" in document  # the rule's "Why it costs memory" section
    assert "gradaudit.trim(model)" in document  # a fix as code, with a copy button
    assert 'class="copy"' in document


def test_module_markup_is_escaped(hostile_report, golden, monkeypatch):
    _no_dot(monkeypatch)
    document = html.render(hostile_report, title=f"audit of {golden.MARKUP}")
    assert golden.MARKUP not in document
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in document
    # the embedded JSON gives the name back intact to the table script, which writes it as text
    modules = {row[1] for row in _embedded(document)["rows"]}
    assert f"{golden.MARKUP}.1" in modules


def test_script_json_cannot_close_the_script():
    text = html.script_json({"name": "</script><!-- & \u2028"})
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == {"name": "</script><!-- & \u2028"}


def test_self_contained(report):
    document = html.render(report)
    assert not re.search(r"<(link|img|iframe|object)\b", document)
    assert not re.search(r"\bsrc=", document)
    assert not re.search(r"(href|url\()\s*=?\s*[\"']?https?:", document)
    assert "Content-Security-Policy" in document and "default-src 'none'" in document


def test_every_saved_tensor_is_in_the_table(report):
    rows = _embedded(html.render(report))["rows"]
    assert [row[0] for row in rows] == [t.index for t in report.tensors]


def test_timeline_counts_each_storage_once(report):
    points = views.timeline(report)
    held = [t for t in report.held_tensors if t.storage_id >= 0]
    assert points[-1].saves == len(held)
    assert points[-1].held_bytes == report.saved_bytes  # 40960: see test_report_text
    assert points[-1].held_after_fixes_bytes == report.saved_bytes - report.reclaimable_with_bitpacking_bytes
    assert all(a.held_bytes <= b.held_bytes for a, b in zip(points, points[1:]))
    # pool.indices (int64) and pool's not-needed input arrive in one run of saves in "pool"
    assert [p.module for p in points][:3] == ["stem", "stem_relu", "pool"]


def test_module_picture(report):
    rows = html.module_rows(report)
    assert rows[0]["path"] == "(model)" and rows[0]["width"] == 100.0
    block = next(r for r in rows if r["path"] == "block")
    # block.conv input and block.bn input, 4096 each, are reclaimable: 8192 of 40960 = 20%
    assert block["reclaimable"] == 8192 and block["red"] == pytest.approx(20.0)
