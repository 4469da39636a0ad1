"""The autograd graph drawn with Graphviz, each saved tensor coloured by what backward needs.

Colours: not-needed saves red, saves where 1 bit per element would do amber, needed ones neutral,
parameters/buffers/inputs (alive anyway, so free) blue. Large graphs are collapsed into one box per
module while the nodes behind the biggest findings stay expanded, so an 80-layer transformer draws
as ~45 boxes instead of thousands of nodes.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import defaultdict
from typing import Iterable, Optional, Union

from ..errors import GradauditError, RenderError
from ..records import (FREE_KINDS, NOT_NEEDED, SIGN_ONLY, UNKNOWN, GraphNode, Manager, Report, SavedTensor,
                       Severity)
from .units import human_bytes
from .views import module_bitpacking_totals, ranked_findings

# Above this many autograd nodes the graph is collapsed by module unless the caller says otherwise.
AUTO_COLLAPSE_NODES = 250
# Collapse at the deepest module level that still gives at most this many boxes.
MAX_GROUPS = 100
# Nodes behind findings drawn individually inside a collapsed graph (biggest findings first).
MAX_EXPANDED_NODES = 40

INSTALL_HINT = "install Graphviz: apt-get install graphviz (Debian/Ubuntu) or brew install graphviz (macOS)"

STYLES = {
    # name: (fill, border, legend text)
    "waste": ("#f9d3d0", "#c0392b", "not needed by backward (waste)"),
    "bitpack": ("#fde8c4", "#c77c0e", "only 1 bit per element needed"),
    "needed": ("#ffffff", "#7a7a7a", "needed by backward"),
    "unknown": ("#f2f2f2", "#9a9a9a", "no verdict"),
    "free": ("#e3edf9", "#4a78b0", "parameter / input: free (alive anyway)"),
}


class GraphvizMissing(GradauditError, RuntimeError):
    """The Graphviz ``dot`` program is not on PATH, so no SVG can be drawn (DOT still works)."""


def quote(text: str) -> str:
    """A DOT double-quoted string; backslashes doubled so user text never becomes an escape like \\N."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(**attrs: Optional[str]) -> str:
    return "[" + ", ".join(f"{k}={quote(v)}" for k, v in attrs.items() if v is not None) + "]"


def tensor_style(t: SavedTensor) -> str:
    if t.storage_kind in FREE_KINDS:
        return "free"
    if t.verdict == NOT_NEEDED:
        return "waste"
    if t.verdict == SIGN_ONLY or t.bitpackable:
        return "bitpack"
    if t.verdict == UNKNOWN:
        return "unknown"
    return "needed"


def node_module(node: GraphNode) -> str:
    """Module a node belongs to; AccumulateGrad nodes go with the parameter they accumulate into."""
    if node.variable is not None and node.variable.parameter is not None:
        return node.variable.parameter.rpartition(".")[0]
    return node.module


def _ancestors(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def natural_key(path: str) -> tuple:
    """Sort ``layers.10`` after ``layers.9``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split(".")) if path else ()


def _truncate(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) if path else ""


def collapse_depth(report: Report) -> int:
    """Deepest module level at which the graph has at most MAX_GROUPS boxes (at least 1)."""
    paths = {node_module(n) for n in report.nodes}
    deepest = max((len(p.split(".")) for p in paths if p), default=1)
    best = 1
    for depth in range(1, deepest + 1):
        if len({_truncate(p, depth) for p in paths}) <= MAX_GROUPS:
            best = depth
    return best


class _Writer:
    def __init__(self, report: Report) -> None:
        self.report = report
        self.lines: list[str] = []
        self.classes = {m.path: m.module_class for m in report.modules}

    def emit(self, line: str, depth: int = 1) -> None:
        self.lines.append("  " * depth + line)

    def op_node(self, node: GraphNode, depth: int) -> None:
        if node.variable:
            kind, name = node.variable.kind, node.variable.name
            label = f"{name}\n{kind} (leaf)"
            self.emit(f"n{node.id} " + _attrs(label=label, shape="ellipse", style="filled",
                                               fillcolor=STYLES["free"][0], color=STYLES["free"][1],
                                               tooltip=f"{node.name}: gradient of {node.variable}"), depth)
            return
        label = node.name + (f"\n{node.module}" if node.module else "")
        self.emit(f"n{node.id} " + _attrs(label=label, tooltip=f"{node.name} in {node.module or '(root)'}"), depth)
        for index in node.saved:
            self.tensor_node(self.report.tensors[index], depth)

    def tensor_node(self, t: SavedTensor, depth: int) -> None:
        style = tensor_style(t)
        fill, border, _ = STYLES[style]
        shape = "x".join(map(str, t.shape)) or "scalar"
        size = human_bytes(t.view_nbytes)
        label = f"{t.attr}\n{shape} {t.dtype}\n{size}"
        if style == "free":
            label += f"\nfree ({t.storage_kind})"
        elif t.managed_by != Manager.AUTOGRAD:
            label += f"\n{t.managed_by}: not held"
        elif t.rule:
            label += f"\n{t.rule}"
        line_style = "filled,dashed" if t.managed_by != Manager.AUTOGRAD or style == "unknown" else "filled"
        self.emit(f"t{t.index} " + _attrs(label=label, shape="note", style=line_style, fillcolor=fill,
                                          color=border, fontsize="9",
                                          tooltip=f"{t.verdict}: {t.reason}" if t.reason else t.verdict), depth)
        self.emit(f"t{t.index} -> n{t.node_id} " + _attrs(style="dashed", arrowhead="none", color=border), depth)

    def legend(self) -> None:
        self.emit("subgraph cluster_legend {")
        self.emit("label=\"saved tensors\"; fontsize=10; color=\"#cccccc\";", 2)
        for name, (fill, border, text) in STYLES.items():
            self.emit(f"legend_{name} " + _attrs(label=text, shape="note", style="filled", fillcolor=fill,
                                                 color=border, fontsize="9"), 2)
        self.emit("}")


def _header(report: Report) -> list[str]:
    return [
        f"digraph {quote('gradaudit')} {{",
        "  graph [rankdir=TB, fontname=\"Helvetica\", fontsize=11, nodesep=0.2, ranksep=0.3, "
        f"label={quote(f'{report.model}: autograd graph (arrows follow the forward)')}, labelloc=t];",
        "  node [shape=box, style=\"rounded\", fontname=\"Helvetica\", fontsize=10, height=0.3];",
        "  edge [color=\"#555555\", arrowsize=0.6];",
    ]


def _cluster_tree(paths: Iterable[str]) -> dict[str, list[str]]:
    """Children of each module path among ``paths`` and their ancestors ("" is the root)."""
    children: dict[str, set[str]] = defaultdict(set)
    for path in paths:
        chain = [""] + _ancestors(path)
        for parent, child in zip(chain, chain[1:]):
            children[parent].add(child)
    return {k: sorted(v) for k, v in children.items()}


def _full(report: Report, writer: _Writer, nodes: list[GraphNode]) -> None:
    ids = {n.id for n in nodes}
    edges = [(nxt, node.id) for node in nodes
             for nxt in dict.fromkeys(i for i in node.next_ids if i is not None and i in ids)]
    by_module: dict[str, list[GraphNode]] = defaultdict(list)
    for node in nodes:
        by_module[node_module(node)].append(node)
    children = _cluster_tree(by_module)
    counter = iter(range(1 << 30))

    def emit_module(path: str, depth: int) -> None:
        for child in children.get(path, []):
            # a module without submodules called twice (one ReLU reused in a block) draws one box per
            # call, so the box does not span everything between the calls
            calls = [by_module.get(child, [])] if children.get(child) else _calls(by_module[child], edges)
            for members in calls:
                writer.emit(f"subgraph cluster_{next(counter)} {{", depth)
                label = child + (f" ({writer.classes[child]})" if writer.classes.get(child) else "")
                writer.emit(f"label={quote(label)}; fontsize=9; style=\"rounded\"; color=\"#bbbbbb\";", depth + 1)
                for node in members:
                    writer.op_node(node, depth + 1)
                emit_module(child, depth + 1)
                writer.emit("}", depth)

    for node in by_module.get("", []):
        writer.op_node(node, 1)
    emit_module("", 1)
    for a, b in edges:
        writer.emit(f"n{a} -> n{b};")
    _stack_clusters(writer, nodes, edges)


def _calls(members: list[GraphNode], edges: list[tuple[int, int]]) -> list[list[GraphNode]]:
    """A module's nodes split into the parts joined by edges among them (one part per call)."""
    parent = {n.id: n.id for n in members}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in edges:
        if a in parent and b in parent:
            parent[root(a)] = root(b)
    parts: dict[int, list[GraphNode]] = {}
    for node in members:
        parts.setdefault(root(node.id), []).append(node)
    return list(parts.values())


def _stack_clusters(writer: _Writer, nodes: list[GraphNode], edges: list[tuple[int, int]]) -> None:
    """Invisible edges that rank each module's cluster below the op feeding it.

    A module's parameters and saved-tensor notes have no incoming edge, so dot ranks them just above
    the op they feed, i.e. level with the previous module's ops; two clusters sharing ranks cannot
    overlap, so dot puts them side by side and a chain of modules becomes a diagonal staircase. An
    invisible edge from the op that enters a module to each of these sources puts the cluster below
    that op, and the chain stacks top to bottom. No such edge closes a cycle: a source is skipped
    when what it feeds is upstream of the op.
    """
    module_of = {n.id: node_module(n) for n in nodes}
    preds: dict[int, list[int]] = defaultdict(list)
    succs: dict[int, list[int]] = defaultdict(list)
    for a, b in edges:
        preds[b].append(a)
        succs[a].append(b)
    # ancestors of each node as a bitmask over a topological order (Kahn's algorithm)
    bit = {n.id: 1 << k for k, n in enumerate(nodes)}
    waiting = {n.id: len(preds[n.id]) for n in nodes}
    ready = [n.id for n in nodes if not waiting[n.id]]
    upstream: dict[int, int] = {}
    while ready:
        i = ready.pop()
        upstream[i] = 0
        for p in preds[i]:
            upstream[i] |= upstream[p] | bit[p]
        for j in succs[i]:
            waiting[j] -= 1
            if not waiting[j]:
                ready.append(j)
    # sources of each module: (DOT name, the node it feeds, or the nodes for a leaf)
    sources: dict[str, list[tuple[str, list[int]]]] = defaultdict(list)
    for node in nodes:
        if not preds[node.id]:
            sources[module_of[node.id]].append((f"n{node.id}", succs[node.id]))
        if not node.variable:
            sources[module_of[node.id]].extend((f"t{i}", [node.id]) for i in node.saved)
    invisible: dict[tuple[int, str], None] = {}
    for a, b in edges:
        if module_of[a] == module_of[b] or a not in upstream:
            continue
        below = upstream[a] | bit[a]
        for name, fed in sources.get(module_of[b], []):
            if name != f"n{a}" and not any(below & bit[f] for f in fed):
                invisible[(a, name)] = None
    for a, name in invisible:
        writer.emit(f"n{a} -> {name} [style=invis];")


def _expanded_nodes(report: Report) -> set[int]:
    """Nodes behind the biggest findings, at most MAX_EXPANDED_NODES, whole findings at a time."""
    chosen: set[int] = set()
    for finding in ranked_findings(report):
        if finding.severity != Severity.WASTE:
            continue
        ids = {report.tensors[i].node_id for i in finding.tensors if report.tensors[i].node_id >= 0}
        if len(chosen | ids) > MAX_EXPANDED_NODES:
            break
        chosen |= ids
    return chosen


def _collapsed(report: Report, writer: _Writer, depth: int) -> None:
    expanded = _expanded_nodes(report)
    group_of: dict[int, str] = {}
    members: dict[str, list[GraphNode]] = defaultdict(list)
    for node in report.nodes:
        group = _truncate(node_module(node), depth)
        members[group].append(node)
        group_of[node.id] = group
    totals = {m.path: m for m in report.modules}
    packing = module_bitpacking_totals(report)
    order = sorted(members, key=natural_key)
    group_ids = {group: f"g{i}" for i, group in enumerate(order)}

    def rep(node_id: int) -> str:
        return f"n{node_id}" if node_id in expanded else group_ids[group_of[node_id]]

    for group in order:
        nodes = members[group]
        collapsed = [n for n in nodes if n.id not in expanded]
        inner = [n for n in nodes if n.id in expanded]
        saves = sum(len(n.saved) for n in collapsed)
        total = totals.get(group)
        # the root group holds only the ops run at the root itself, not its children's boxes
        held = (total.own_bytes if group == "" else total.total_bytes) if total else 0
        reclaimable = (total.own_reclaimable_bytes if group == "" else total.total_reclaimable_bytes) if total else 0
        packed = packing.get(group, 0) if group else 0
        title = group or "(root)"
        if writer.classes.get(group):
            title += f"\n{writer.classes[group]}"
        label = f"{title}\n{len(collapsed)} ops, {saves} saves\nheld {human_bytes(held)}"
        style = "needed"
        if reclaimable:
            label += f"\nreclaimable {human_bytes(reclaimable)}"
            style = "waste"
        elif packed:
            label += f"\n1-bit packing frees {human_bytes(packed)}"
            style = "bitpack"
        if all(n.variable for n in collapsed):
            style = "free"
        fill, border, _ = STYLES[style]
        box = _attrs(label=label, shape="box3d", style="filled", fillcolor=fill, color=border,
                     tooltip=f"{title.splitlines()[0]}: {len(collapsed)} autograd nodes collapsed")
        if inner:
            writer.emit(f"subgraph cluster_{group_ids[group]} {{")
            writer.emit(f"label={quote(group or '(root)')}; fontsize=9; style=\"rounded\"; color=\"#c0392b\";", 2)
            if collapsed:
                writer.emit(f"{group_ids[group]} {box}", 2)
            for node in inner:
                writer.op_node(node, 2)
            writer.emit("}")
        elif collapsed:
            writer.emit(f"{group_ids[group]} {box}")

    edges: dict[tuple[str, str], int] = {}
    for node in report.nodes:
        for nxt in node.next_ids:
            if nxt is None:
                continue
            a, b = rep(nxt), rep(node.id)
            if a != b:
                edges[(a, b)] = edges.get((a, b), 0) + 1
    for (a, b) in edges:
        writer.emit(f"{a} -> {b};")


def _inside(path: str, module: str) -> bool:
    return module == "" or path == module or path.startswith(module + ".")


def waste_groups(report: Report) -> list[str]:
    """Boxes of the collapsed graph that hold reclaimable bytes, most first."""
    depth = collapse_depth(report)
    packing = module_bitpacking_totals(report)
    groups = {_truncate(node_module(n), depth) for n in report.nodes}
    return sorted((g for g in groups if g and packing.get(g, 0) > 0), key=lambda g: (-packing[g], natural_key(g)))


def to_dot(report: Report, *, collapse: Union[None, bool, int] = None, focus: Optional[str] = None) -> str:
    """DOT source of the annotated autograd graph.

    ``collapse``: None collapses by module when the graph has more than AUTO_COLLAPSE_NODES nodes;
    True always collapses (depth chosen automatically), False never, an int collapses at that
    module depth (1: ``model``, 3: ``model.layers.7``).
    ``focus``: draw only the nodes of this module (and its children), uncollapsed.
    """
    writer = _Writer(report)
    writer.lines.extend(_header(report))
    if collapse is None:
        collapse = len(report.nodes) > AUTO_COLLAPSE_NODES
    if focus is not None:
        _full(report, writer, [n for n in report.nodes if _inside(node_module(n), focus)])
    elif collapse is False:
        _full(report, writer, report.nodes)
    else:
        depth = collapse_depth(report) if collapse is True else max(int(collapse), 1)
        _collapsed(report, writer, depth)
    writer.legend()
    writer.lines.append("}")
    return "\n".join(writer.lines) + "\n"


def dot_program() -> str:
    path = shutil.which("dot")
    if path is None:
        raise GraphvizMissing(f"the Graphviz `dot` program is not on PATH; {INSTALL_HINT}")
    return path


def dot_to_svg(source: str, *, timeout: float = 120.0) -> str:
    result = subprocess.run([dot_program(), "-Tsvg"], input=source.encode(), capture_output=True,
                            timeout=timeout, check=False)
    if result.returncode != 0:
        raise RenderError(f"dot failed: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout.decode()


def to_svg(report: Report, *, collapse: Union[None, bool, int] = None, focus: Optional[str] = None,
           timeout: float = 120.0) -> str:
    """SVG of ``to_dot(report, ...)``; raises GraphvizMissing when ``dot`` is absent."""
    return dot_to_svg(to_dot(report, collapse=collapse, focus=focus), timeout=timeout)
