"""GA5xx: activations kept only for the gradient of a leaf that is not a parameter (the input)."""

from __future__ import annotations

from ..records import HELD_KINDS, GraphNode
from .registry import Flag, RuleContext, rule


def _reaches(nodes: list[GraphNode], wanted) -> list[bool]:
    """For every node: does it, or a node its gradient flows to (next_ids), satisfy wanted?"""
    result: list = [None] * len(nodes)
    expanded = [False] * len(nodes)
    for start in range(len(nodes)):
        stack = [start]
        while stack:  # iterative post-order: graphs of deep models overflow Python's recursion
            pos = stack[-1]
            if result[pos] is not None:
                stack.pop()
                continue
            children = [c for c in nodes[pos].next_ids if c is not None]
            todo = [c for c in children if result[c] is None]
            if todo and not expanded[pos]:
                expanded[pos] = True
                stack.extend(todo)
                continue
            result[pos] = bool(wanted(nodes[pos]) or any(result[c] for c in children))
            stack.pop()
    return result


@rule("GA501", "saved-only-for-input-gradient",
      fix="Stop asking for the input's gradient when only parameters train",
      fix_code="""
        x = x.detach()                        # or: x.requires_grad_(False)
        # Hugging Face: model.disable_input_require_grads()  (undoes enable_input_require_grads)
      """)
def saved_only_for_input_gradient(ctx: RuleContext):
    """Tensors are saved only to compute the gradient of a non-parameter leaf (usually the input).

    What it flags:
        Per module: saves held by nodes from which no path leads to a trainable parameter, only to
        an input (or another leaf tensor) that requires grad - while parameters do train.
        Typical causes: ``enable_input_require_grads()`` left on, an input created with
        requires_grad=True, frozen layers below the first trainable one.
    Why it costs memory:
        Each such node exists only because the leaf requires grad; without it autograd would not
        record the frozen part at all and keep none of its activations.
    Example:
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Linear(32, 4))
        model.requires_grad_(False); model[-1].requires_grad_(True)   # only the head trains
        images = torch.randn(8, 16).requires_grad_()
        report = gradaudit.audit(model, images)   # every frozen layer below the head keeps activations
    Fix:
        Detach the input (or call ``model.disable_input_require_grads()`` in Hugging Face) unless
        you need ``x.grad``.
    Fix safety:
        Parameter gradients are bit-identical; ``x.grad`` is no longer computed.
    Known limits:
        If you do need the input's gradient (adversarial training, saliency maps), ignore this
        rule (``ignore=["GA501"]``). Nodes recorded before the audited forward count as reaching
        parameters (they are not inspected).
    """
    if not any(ctx.parameter_names.values()):
        return
    nodes = ctx.nodes

    def other_leaf(n: GraphNode) -> bool:
        return n.name == "AccumulateGrad" and (n.variable is None or n.variable.parameter is None)

    # the usual case: no leaf but parameters requires grad (asked without a call per node)
    if not any(n.name == "AccumulateGrad" and (n.variable is None or n.variable.parameter is None) for n in nodes):
        return
    to_leaf = _reaches(nodes, other_leaf)
    if not any(to_leaf):
        return
    to_param = _reaches(nodes, lambda n: (n.variable is not None and n.variable.parameter is not None)
                        or not n.created_here)
    only_leaf = {n.id for n in nodes if to_leaf[n.id] and not to_param[n.id]}
    chosen = [t for t in ctx.held() if t.node_id in only_leaf and t.storage_kind in HELD_KINDS]
    if not chosen:
        return
    freed = ctx.freed_by_storage(t.index for t in chosen)
    by_module: dict[str, list] = {}
    for t in chosen:
        by_module.setdefault(ctx.storages[t.storage_id].module, []).append(t)
    for module, hits in sorted(by_module.items()):
        cost = sum(freed.get(sid, 0) for sid in {t.storage_id for t in hits})
        if cost == 0:
            continue
        yield Flag(None, hits, f"{module or 'model'} ({hits[0].module_class}) keeps {cost} bytes only for "
                               f"the gradient of a non-parameter leaf (the input?)", module=module, bytes=cost)
