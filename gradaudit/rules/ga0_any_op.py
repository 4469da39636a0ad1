"""GA0xx: saves of any op that backward does not read: the catch-all the proof finds (GA000), saves
only an unwanted gradient reads (GA001), and saves read only for their shape (GA002)."""

from __future__ import annotations

from ..records import HELD_KINDS, NOT_NEEDED, SIGN_ONLY, GraphNode, SavedTensor
from .registry import Flag, RuleContext, claims_rule, rule
from .shared import TRIM_SNIPPET, shape_text


@rule("GA000", "unexplained-unneeded-save", catch_all=True,
      fix="Stop saving it, or declare what backward reads (gradaudit.declare_function) so gradaudit.trim drops it",
      fix_code="""
        import gradaudit
        from gradaudit import Read
        # MyFunction saves (x, y); its backward reads only y, and only when x needs a gradient
        gradaudit.declare_function(MyFunction, edges=("x", "y"), saves=[
            Read(by=(), reads=gradaudit.Reads.NOTHING, rule="GA000"),   # x: never read
            Read(by=("x",), rule="GA000"),                               # y: read by x's gradient
        ])
        with gradaudit.trim(model):      # now drops what the declaration says is unread
            model(x).sum().backward()
      """)
def unexplained_unneeded_save(ctx: RuleContext):
    """The proof shows backward never reads this save (or only its sign), and no rule explains why.

    What it flags:
        With verify=True: held saves (activations) proven not needed, or proven to be read only
        as one bit per element, that no other finding covers, grouped by node, with the node
        type - gaps in gradaudit's op knowledge (custom autograd Functions, ops it does not know).
    Why it costs memory:
        Autograd holds the tensor until backward, which never reads it (or reads one bit of each
        element).
    Example:
        class Exp(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                y = x.exp()
                ctx.save_for_backward(x, y)   # saves x and y ...
                return y

            @staticmethod
            def backward(ctx, grad):
                x, y = ctx.saved_tensors
                return grad * y               # ... but reads only y
        class Net(nn.Linear):
            def forward(self, x):
                return Exp.apply(super().forward(x))
        report = gradaudit.audit(Net(8, 8), torch.randn(4, 8), verify=True)
    Fix:
        Stop saving it (custom Functions). Or describe the op with ``gradaudit.declare_function``
        (``gradaudit.declare`` for any node type): the static audit then knows it, and
        ``gradaudit.trim`` drops (or bit-packs) what the declaration says backward does not read.
        ``trim`` acts on declarations only, never on one audit's proof.
    Fix safety:
        Gradients are bit-identical for the inputs and freezing pattern audited; the proof covers
        one set of values, so check a declaration with verify=True on the shapes and freezing
        patterns you use (a proof that refutes it is listed in ``Report.disagreements``).
    Known limits:
        Only runs with verify=True (static mode has no evidence for unknown ops).
    """
    by_node: dict[int, list] = {}
    for t in ctx.held():
        unread = t.verdict == NOT_NEEDED
        if (t.proven and (unread or (t.verdict == SIGN_ONLY and t.bitpackable)) and t.index not in ctx.covered
                and t.storage_kind in HELD_KINDS):
            by_node.setdefault(t.node_id, []).append(t)
    for node_id, hits in by_node.items():
        node = ctx.nodes[node_id]
        unread = [t.attr for t in hits if t.verdict == NOT_NEEDED]
        signs = [t.attr for t in hits if t.verdict != NOT_NEEDED]
        parts = ([f"never reads {', '.join(unread)}"] if unread else []) + \
                ([f"reads only the sign of {', '.join(signs)}"] if signs else [])
        yield Flag(node, hits, f"{node.module or 'model'}: {node.name} saves {', '.join(t.attr for t in hits)} "
                               f"but backward {' and '.join(parts)} (proven; no rule explains it)")


@claims_rule("GA001", "saved-for-unwanted-gradient", NOT_NEEDED,
      fix="Drop the save while the gradient that reads it is not wanted (gradaudit.trim)",
      fix_code=TRIM_SNIPPET)
def saved_for_unwanted_gradient(node: GraphNode, hits: list[SavedTensor]) -> str:
    """An op keeps a tensor that only the gradient of an input nobody differentiates would read.

    What it flags:
        Saves of ops without a rule of their own (tensor ** tensor, attention's value and output
        when only the value trains, randomized leaky ReLU's input in training) that the op
        knowledge shows unread for the inputs that need a gradient.
    Why it costs memory:
        Ops whose gradients share one formula save everything any gradient could read; autograd
        keeps the tensor until backward although no wanted gradient reads it.
    Example:
        class Power(nn.Module):
            def forward(self, base, exponent):
                return torch.pow(base.sigmoid() + 0.5, exponent)
        base = torch.randn(4, 8, requires_grad=True)
        exponent = torch.full((4, 8), 2.0)   # frozen: the result is kept for its gradient anyway
        report = gradaudit.audit(Power(), (base, exponent))
    Fix:
        ``gradaudit.trim(model)`` drops such saves as the forward proceeds.
    Fix safety:
        Gradients are bit-identical: the dropped tensor is never read.
    Known limits:
        The op's output is often also the next op's saved input; bytes say what is freed.
    """
    return (f"{node.module or 'model'}: {node.name} saves {', '.join(t.attr for t in hits)} that no wanted "
            f"gradient reads")


@claims_rule("GA002", "saved-for-shape-only", NOT_NEEDED,
      fix="Keep only the shape of a save backward reads for its shape (gradaudit.trim)",
      fix_code=TRIM_SNIPPET)
def saved_for_shape_only(node: GraphNode, hits: list[SavedTensor]) -> str:
    """An op keeps a whole tensor although backward reads only its shape.

    What it flags:
        ``torch.gather``'s source and ``nll_loss``'s log-probabilities (cross-entropy's input after
        log_softmax): backward reads their sizes, never their values.
    Why it costs memory:
        Autograd saves the tensor itself because the backward formula names it; the formula only
        asks it for its sizes.
    Example:
        class Loss(nn.Module):
            def forward(self, logits, target):
                return F.nll_loss(F.log_softmax(logits, -1), target)   # the log-probabilities are kept twice
        logits = torch.randn(4, 10, requires_grad=True)
        report = gradaudit.audit(Loss(), (logits, torch.randint(0, 10, (4,))))
    Fix:
        ``gradaudit.trim(model)`` replaces the save by a placeholder of its shape.
    Fix safety:
        Gradients are bit-identical: the values are never read.
    Known limits:
        The tensor is often also saved by the op that made it (log_softmax keeps its result):
        then nothing is freed and the finding is information.
    """
    return (f"{node.module or 'model'}: {node.name} saves its whole {shape_text(hits[0])} {hits[0].attr}; backward "
            f"reads only its shape")
