"""GA0xx: saves of any op that backward does not read: the catch-all the proof finds (GA000), saves
only an unwanted gradient reads (GA001), saves read only for their shape (GA002), and saves a compiled
region keeps that the proof finds unread (GA003)."""

from __future__ import annotations

from ..records import HELD_KINDS, NOT_NEEDED, SIGN_ONLY, GraphNode, SavedTensor
from .registry import Flag, RuleContext, claims_rule, rule
from .shared import TRIM_SNIPPET, shape_text
from ..torchapi.compiler import COMPILED_NODE


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


@rule("GA003", "compiled-region-keeps-unread-save",
      fix="Compile the parts that train and run the frozen ones eagerly under gradaudit.trim, or let the "
          "compiler recompute (an activation_memory_budget below 1.0 in torch's functorch config)",
      fix_safe=False,
      fix_code="""
        import torch
        import gradaudit
        # the frozen layers run eagerly, where trim drops what their backward skips; what trains is compiled
        model[0] = torch.compile(model[0])
        with gradaudit.trim(model):
            model(x).sum().backward()
        # or keep the whole model compiled and let the partitioner recompute instead of keeping:
        # torch._functorch.config.activation_memory_budget = 0.5, before compiling
      """)
def compiled_region_keeps_unread_save(ctx: RuleContext):
    """A torch.compile'd region keeps a tensor its backward never reads (or reads only as a sign).

    What it flags:
        Saves of a compiled region (one ``CompiledFunctionBackward`` node) that its backward graph
        takes only for their shape (``convolution_backward`` asking for no weight gradient takes
        the input, eval-mode ``native_batch_norm_backward`` with a frozen weight the input and the
        batch statistics, max-pooling's backward its input) or only as a sign (``threshold_backward``
        at 0, a comparison with 0), read off the graph as the op knowledge reads eager nodes; and,
        with verify=True, saves the proof shows unread or read as one bit per element, by calling
        the region's compiled backward with their values replaced. Grouped by the module the
        compiled graph attributes them to (the module whose op's gradient takes them).
    Why it costs memory:
        AOTAutograd's partitioner keeps every tensor the backward graph takes as an argument, and
        a backward op takes all of its inputs even when only some of its gradients are wanted:
        ``convolution_backward`` takes the convolution's input when its weight is frozen and
        only the input's gradient is wanted (pytorch#133566), ``native_batch_norm_backward``
        takes the input in eval mode. The compiled step holds them until backward.
    Example:
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1))
        model[1].requires_grad_(False)   # frozen: its input's gradient is wanted, its weight's is not
        compiled = torch.compile(model, backend="aot_eager")
        report = gradaudit.audit(compiled, torch.randn(2, 3, 16, 16), verify=True)
    Fix:
        Compile the parts that train and let the frozen ones run eagerly under
        ``gradaudit.trim(model)``, which drops (or bit-packs) these saves op by op; or keep the
        model compiled and set ``torch._functorch.config.activation_memory_budget`` below 1.0
        before compiling, so that the partitioner recomputes in backward what it would keep.
    Fix safety:
        Not bit-identical to the compiled step: eager kernels for the frozen part, or recomputed
        ops, may round differently from the kernels the compiler fused.
    Known limits:
        Without verify=True, only the backward ops named above are judged; a save any other op
        takes is "needed" (a decomposed op reads what it takes) or "unknown" where the graph is not
        read. The proof covers one set of values and the region as compiled for these shapes.
    """
    by_module: dict[str, list] = {}
    for t in ctx.held():
        # proven, or read off the region's backward graph (analysis: explained_by GA003)
        if (t.node == COMPILED_NODE and (t.proven or t.explained_by == "GA003") and t.storage_kind in HELD_KINDS
                and t.index not in ctx.covered
                and (t.verdict == NOT_NEEDED or (t.verdict == SIGN_ONLY and t.bitpackable))):
            by_module.setdefault(t.module, []).append(t)
    for module, hits in by_module.items():
        unread = [t for t in hits if t.verdict == NOT_NEEDED]
        signs = [t for t in hits if t.verdict != NOT_NEEDED]
        parts = ([f"{_count(unread)} its backward never reads"] if unread else []) + \
                ([f"{_count(signs)} its backward reads only the sign of"] if signs else [])
        yield Flag(ctx.nodes[hits[0].node_id], hits,
                   f"{module or 'model'} ({hits[0].module_class}): the compiled region keeps {' and '.join(parts)} "
                   f"({'proven' if all(t.proven for t in hits) else 'its backward graph says so'})",
                   module=module, module_class=hits[0].module_class, source=hits[0].source)


def _count(hits: list) -> str:
    if len(hits) == 1:
        return f"a {hits[0].dtype} tensor of {shape_text(hits[0])}"
    return f"{len(hits)} tensors"
