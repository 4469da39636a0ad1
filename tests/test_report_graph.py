"""Graph reporter: colours by verdict, free leaves, escaping, collapse by module, SVG via dot."""

import re
import shutil

import pytest

from gradaudit.records import GraphNode, Report, SavedTensor, Storage
from gradaudit.report import graph

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed")


def _node_line(dot: str, name: str) -> str:
    return next(line for line in dot.splitlines() if line.strip().startswith(f"{name} ["))


def test_golden(report, golden):
    golden.assert_golden("report.dot", graph.to_dot(report, collapse=False))


def test_tensor_colours_follow_verdicts(report):
    dot = graph.to_dot(report, collapse=False)
    for t in report.tensors:
        line = _node_line(dot, f"t{t.index}")
        fill = re.search(r'fillcolor="([^"]+)"', line).group(1)
        if t.storage_kind in ("parameter", "buffer", "input"):
            assert fill == graph.STYLES["free"][0] and "free (" in line
        elif t.verdict == "not-needed":
            assert fill == graph.STYLES["waste"][0]
        elif t.verdict == "sign-only" or t.bitpackable:
            assert fill == graph.STYLES["bitpack"][0]
        elif t.verdict == "needed":
            assert fill == graph.STYLES["needed"][0]
    conv_input = next(t for t in report.tensors if t.module == "block.conv" and t.attr == "input")
    assert conv_input.verdict == "not-needed"
    assert "GA101" in _node_line(dot, f"t{conv_input.index}")
    # the stem's input needs no gradient and is the caller's tensor: drawn as free, not as waste
    leaves = [n for n in report.nodes if n.variable]
    assert leaves and all("(leaf)" in _node_line(dot, f"n{n.id}") for n in leaves)


def test_edges_follow_next_functions(report):
    dot = graph.to_dot(report, collapse=False)
    edges = set(re.findall(r"^\s*n(\d+) -> n(\d+);", dot, re.M))
    expected = {(str(i), str(n.id)) for n in report.nodes for i in n.next_ids if i is not None}
    assert edges == expected


def test_quote_escapes_user_text():
    assert graph.quote('a"b\\N<script>') == '"a\\"b\\\\N<script>"'
    assert graph.quote("two\nlines") == '"two\\nlines"'


def _synthetic(layers: int, per_layer: int) -> Report:
    """A transformer-shaped graph without running anything: a chain of ops through each layer."""
    nodes, tensors, storages = [], [], []
    for layer in range(layers):
        for k in range(per_layer):
            i = len(nodes)
            module = f"model.layers.{layer}.{'mlp' if k % 2 else 'self_attn'}"
            nodes.append(GraphNode(i, "MulBackward0", module, [i + 1] if i + 1 < layers * per_layer else [],
                                   [True], saved=[i]))
            storages.append(Storage(i, 4096, "activation", module, [i]))
            tensors.append(SavedTensor(i, i, "MulBackward0", "self", (1024,), "float32", "meta", 1024, 4, i,
                                       "activation", module, "Mul", None, verdict="needed", source_index=i))
    return Report("Synthetic", "TORCH", "meta", True, False, tensors, storages, nodes, [], [], 4096 * len(nodes),
                  0, 0, 0, 0, 1, 0)


def test_large_graph_collapses_to_layers():
    big = _synthetic(layers=80, per_layer=6)  # 480 nodes > AUTO_COLLAPSE_NODES
    # depth 3 gives 80 boxes (model.layers.N), depth 4 gives 160 > MAX_GROUPS
    assert graph.collapse_depth(big) == 3
    dot = graph.to_dot(big)
    boxes = re.findall(r'^\s*g\d+ \[label="([^"\\]+)', dot, re.M)
    assert boxes == [f"model.layers.{i}" for i in range(80)]  # natural order: 9 before 10
    assert not re.search(r"^\s*n\d+ \[", dot, re.M)  # no finding, so nothing stays expanded
    assert len(re.findall(r"^\s*g\d+ -> g\d+;", dot, re.M)) == 79  # one edge between neighbours


def test_collapsed_graph_expands_waste(report):
    dot = graph.to_dot(report, collapse=1)
    top = max(report.findings, key=lambda f: max(f.bytes, f.bytes_together))
    for i in top.tensors:  # the biggest finding's node and saves stay visible
        t = report.tensors[i]
        assert re.search(rf"^\s*n{t.node_id} \[", dot, re.M)
        assert re.search(rf"^\s*t{t.index} \[", dot, re.M)
    assert "box3d" in dot


def test_focus_draws_one_module(report):
    dot = graph.to_dot(report, focus="block")
    ids = {int(i) for i in re.findall(r"^\s*n(\d+) \[", dot, re.M)}
    assert ids == {n.id for n in report.nodes if graph.node_module(n).startswith("block")}


@needs_dot
def test_svg_escapes_markup(hostile_report):
    svg = graph.to_svg(hostile_report, collapse=False)
    assert svg.lstrip().startswith("<?xml") or "<svg" in svg
    assert "<script>" not in svg
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in svg


def test_missing_dot_raises(report, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(graph.GraphvizMissing, match="apt-get install graphviz"):
        graph.to_svg(report)
    assert graph.to_dot(report)  # DOT needs no Graphviz


@pytest.mark.slow
@needs_dot
def test_80_layer_llama_on_meta_stays_readable(transformers, tiny_hf_config):
    torch = pytest.importorskip("torch")
    import gradaudit

    config = tiny_hf_config("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=80, vocab_size=128)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.requires_grad_(False)
    model.model.layers[40].requires_grad_(True)
    report = gradaudit.audit(model, torch.zeros((1, 16), dtype=torch.long, device="meta"))
    assert len(report.nodes) > 1000  # layers 40..79 each add dozens of autograd nodes
    dot = graph.to_dot(report)
    boxes = re.findall(r'^\s*g\d+ \[label="([^"\\]+)', dot, re.M)
    assert {f"model.layers.{i}" for i in range(40, 80)} <= set(boxes)
    assert len(boxes) < 60
    assert "<svg" in graph.to_svg(report)


def _sequential_report(layers: int = 10):
    torch = pytest.importorskip("torch")
    import gradaudit

    torch.manual_seed(0)
    stack = []
    for _ in range(layers // 2):
        stack += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
    return gradaudit.audit(torch.nn.Sequential(*stack), torch.randn(4, 16))


def test_module_chain_stacks_vertically_in_dot():
    report = _sequential_report()
    dot = graph.to_dot(report, collapse=False)
    # the op entering module "2" ranks that module's parameters and saved-tensor notes below it
    relu = next(n for n in report.nodes if n.module == "1")
    addmm = next(n for n in report.nodes if n.module == "2" and not n.variable)
    leaves = [n for n in report.nodes if n.variable and graph.node_module(n) == "2"]
    assert leaves
    for leaf in leaves:
        assert f"n{relu.id} -> n{leaf.id} [style=invis];" in dot
    for index in addmm.saved:
        assert f"n{relu.id} -> t{index} [style=invis];" in dot


@needs_dot
def test_10_layer_sequential_svg_is_taller_than_wide():
    svg = graph.to_svg(_sequential_report(), collapse=False)
    width, height = (float(v) for v in re.search(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"', svg).groups())
    assert height > 1.2 * width, (width, height)  # was 3348 x 932 pt: a diagonal staircase
