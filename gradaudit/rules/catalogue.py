"""The rule catalogue. Codes: GA + 3 digits; the hundreds digit names the family.

0xx catch-all, shape-only and unwanted-gradient saves   1xx convolution      2xx normalisation   3xx pooling
4xx compressible saves          5xx leaf gradients   6xx views/storage   7xx dtype casts
8xx attention                   9xx checkpointing hygiene
"""

from __future__ import annotations

from typing import Optional

from ..records import HELD_KINDS, NEEDED, NOT_NEEDED, SIGN_ONLY, GraphNode, Manager, Severity, StorageKind
from ..knowledge import weight_slot
from .registry import Flag, RuleContext, rule


# the fix of every rule whose waste gradaudit.trim drops as the forward proceeds
TRIM_SNIPPET = """
    import gradaudit
    with gradaudit.trim(model):        # keeps only what backward needs
        model(x).sum().backward()
"""
LOW_PRECISION = ("float16", "bfloat16")


def _shape(t) -> str:
    return "x".join(map(str, t.shape))


@rule("GA101", "conv-input-saved-for-frozen-weight",
      fix="Drop the saved input while the weight is frozen (gradaudit.trim)",
      fix_code="""
        import gradaudit
        with gradaudit.trim(model):        # keeps only what backward needs
            loss = model(x).sum()
            loss.backward()
      """)
def conv_input_saved_for_frozen_weight(ctx: RuleContext):
    """Convolution keeps its input for backward although its weight needs no gradient.

    What it flags:
        Conv1d/2d/3d and ConvTranspose1d/2d/3d (module or functional form) whose weight does not
        require grad while the input still needs a gradient (something trainable sits upstream, or
        the input itself is differentiated).
    Why it costs memory:
        PyTorch derives all convolution gradients from one multi-output formula, so it saves the
        input whenever any gradient is required. The input is read only by the weight gradient
        (pytorch/pytorch#133566).
    Example:
        model = torchvision.models.resnet18(num_classes=10)
        model.requires_grad_(False); model.layer1.requires_grad_(True)   # fine-tune an early layer only
        # every frozen conv in layer2 to layer4 saves its input for a weight gradient nobody asked for
        report = gradaudit.audit(model, torch.randn(1, 3, 64, 64))
    Fix:
        Run the step under ``gradaudit.trim(model)``: the saved input is replaced by an empty
        placeholder as the forward proceeds. Or give the layer a custom autograd.Function that
        saves only the weight.
    Fix safety:
        Gradients are bit-identical: the dropped tensor is never read.
    Known limits:
        If the same storage is also saved by a node that needs it (the previous ReLU's result),
        dropping it alone frees nothing; the finding's ``bytes`` says so and ``bytes_together``
        counts it once every fix (bit-packing included) is applied.
    """
    for node, hits in ctx.claims("GA101", NOT_NEEDED):
        shape = "x".join(map(str, hits[0].shape))
        yield Flag(node, hits, f"{node.module or 'model'} ({hits[0].module_class}) saves its {shape} "
                               f"input for a weight gradient nobody asked for")


@rule("GA102", "conv-weight-saved-for-frozen-input",
      fix="Drop the saved weight while the input needs no gradient (gradaudit.trim)",
      fix_code=TRIM_SNIPPET)
def conv_weight_saved_for_frozen_input(ctx: RuleContext):
    """Convolution (or normalisation, PReLU) keeps a computed weight although its input needs no gradient.

    What it flags:
        Convolutions, batch/layer/group norm and PReLU whose input needs no gradient (typically the
        first layer) and whose saved weight is not a parameter: a weight computed in the forward (weight normalisation,
        merged LoRA adapters, a dtype cast). A plain parameter costs nothing and is not flagged.
    Why it costs memory:
        The weight is read only by the input gradient; a computed weight lives only because
        autograd saved it.
    Example:
        conv = torch.nn.utils.parametrizations.weight_norm(nn.Conv2d(3, 8, 3))
        images = torch.randn(2, 3, 16, 16)   # needs no gradient: the normalised weight is held for nothing
        report = gradaudit.audit(conv, images)
    Fix:
        ``gradaudit.trim(model)``, or compute the weight once outside the step if it is frozen.
    Fix safety:
        Gradients are bit-identical: the dropped tensor is never read.
    Known limits:
        Only the weight's own storage is counted; it is freed only if nothing else holds it.
    """
    for node, hits in ctx.claims("GA102", NOT_NEEDED):
        yield Flag(node, hits, f"{node.module or 'model'} saves a computed weight "
                               f"({'x'.join(map(str, hits[0].shape))}) that only the input gradient "
                               f"reads, and the input needs no gradient")


@rule("GA201", "batchnorm-eval-saves-input",
      fix="Drop batch norm's saved input in eval mode with frozen affine (gradaudit.trim)",
      fix_code="""
        import gradaudit
        model.eval()                      # batch norm uses running statistics
        with gradaudit.trim(model):
            model(x).sum().backward()
      """)
def batchnorm_eval_saves_input(ctx: RuleContext):
    """Batch norm in eval mode keeps its input although its weight needs no gradient.

    What it flags:
        BatchNorm1d/2d/3d (and F.batch_norm) running with training=False whose weight needs no
        gradient (frozen or affine=False): the saved input, running mean and the (empty) batch
        statistics, for the native kernel and for cuDNN's (CUDA; ``target="cuda"`` on meta), whose
        eval-mode backward is the same call.
    Why it costs memory:
        In eval mode the input gradient is grad * weight / sqrt(running_var + eps): it never
        reads the input. PyTorch's single multi-output formula saves it anyway.
    Example:
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 10, 1))
        model.eval(); model.requires_grad_(False)
        x = torch.randn(2, 3, 16, 16, requires_grad=True)   # adversarial attack: only x.grad is wanted
        report = gradaudit.audit(model, x)
    Fix:
        ``gradaudit.trim(model)``; or fold the frozen batch norm into the preceding convolution.
    Fix safety:
        Gradients are bit-identical: the dropped tensors are never read.
    Known limits:
        In train mode the input is needed (batch statistics) and nothing is flagged. The input is
        often also the previous convolution's output kept by another node; bytes say so.
    """
    for node, hits in ctx.claims("GA201", NOT_NEEDED):
        if any(t.attr == "input" for t in hits):
            yield Flag(node, hits, f"{node.module or 'model'} (batch norm, eval mode) saves its input "
                                   f"although the weight needs no gradient")


@rule("GA202", "norm-saves-input-for-bias-only",
      fix="Drop what normalisation saves for the input and weight gradients when only its bias trains (gradaudit.trim)",
      fix_code="""
        import gradaudit
        with gradaudit.trim(model):        # BitFit-style bias-only tuning keeps no norm inputs
            model(x).sum().backward()
      """)
def norm_saves_input_for_bias_only(ctx: RuleContext):
    """Normalisation keeps its input and statistics although only its bias needs a gradient.

    What it flags:
        Batch norm in training mode, layer norm and group norm whose input and weight need no
        gradient while the bias does: the saved input, mean and inverse standard deviation (and
        layer norm's saved bias, which no formula reads). In bias-only tuning (BitFit) that is the
        first norm whose input needs no gradient, e.g. right after a frozen embedding; later norms
        get inputs that need a gradient (upstream biases train) and must keep them.
    Why it costs memory:
        The bias gradient is the sum of the incoming gradient: it reads nothing saved. PyTorch's
        multi-output formula saves the input whenever any gradient is wanted.
    Example:
        model = nn.Sequential(nn.Embedding(100, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith("bias"))   # bias-only tuning (BitFit)
        ids = torch.randint(0, 100, (4, 8))
        report = gradaudit.audit(model, ids)   # the LayerNorm keeps its input, mean and 1/std anyway
    Fix:
        ``gradaudit.trim(model)`` drops those saves as the forward proceeds.
    Fix safety:
        Gradients are bit-identical: the dropped tensors are never read.
    Known limits:
        The input is often also kept by another node (the previous linear layer's saved output,
        when that layer's weight trains); bytes say so. cuDNN's training-mode batch norm (CUDA,
        ``target="cuda"``) is not flagged: its backward computes every gradient in one call from
        every save, and no proof on a GPU has shown what it leaves unread.
    """
    for node, hits in ctx.claims("GA202", NOT_NEEDED):
        if any(t.numel for t in hits):
            yield Flag(node, hits, f"{node.module or 'model'} ({hits[0].module_class}) saves "
                                   f"{', '.join(t.attr for t in hits)} that only the input and weight "
                                   f"gradients read, and neither is wanted")


@rule("GA301", "maxpool-saves-input",
      fix="Keep only max-pooling's indices (gradaudit.trim)",
      fix_code=TRIM_SNIPPET)
def maxpool_saves_input(ctx: RuleContext):
    """Max-pooling keeps its whole input although backward reads only the indices.

    What it flags:
        MaxPool1d/2d/3d, AdaptiveMaxPool2d and F.max_pool*d: the saved input (``self``) of the
        with-indices kernel.
    Why it costs memory:
        The backward scatters the gradient to the saved argmax indices; it reads the input only
        for its shape.
    Example:
        model = nn.Sequential(nn.Conv2d(3, 8, 7), nn.ReLU(), nn.MaxPool2d(3, 2))   # torchvision stems
        report = gradaudit.audit(model, torch.randn(2, 3, 32, 32))
    Fix:
        ``gradaudit.trim(model)`` replaces the saved input by a zero-stride placeholder.
    Fix safety:
        Gradients are bit-identical: the values are never read.
    Known limits:
        After a ReLU the input is the ReLU's result, which the ReLU also saves: dropping it frees
        memory only together with bit-packing the ReLU's result (see ``bytes_together``).
    """
    for node, hits in ctx.claims("GA301", NOT_NEEDED):
        yield Flag(node, hits, f"{node.module or 'model'} saves its whole "
                               f"{'x'.join(map(str, hits[0].shape))} input; backward reads only the indices")


@rule("GA302", "avgpool-saves-input",
      fix="Keep nothing of average pooling's input (gradaudit.trim)",
      fix_code=TRIM_SNIPPET)
def avgpool_saves_input(ctx: RuleContext):
    """Average pooling keeps its whole input although backward reads only its shape.

    What it flags:
        AvgPool2d, AdaptiveAvgPool2d and their functional forms: the saved input (``self``).
    Why it costs memory:
        The backward spreads each output gradient evenly over its window; the window sizes follow
        from the input's shape, never from its values.
    Example:
        # (AdaptiveAvgPool2d(1) would run as a mean, which keeps nothing)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10))
        report = gradaudit.audit(model, torch.randn(2, 3, 16, 16))
    Fix:
        ``gradaudit.trim(model)`` replaces the saved input by a placeholder of its shape.
    Fix safety:
        Gradients are bit-identical: the values are never read.
    Known limits:
        ``AdaptiveAvgPool2d(1)`` (global pooling) runs as a mean, which keeps nothing: not flagged.
        After a ReLU the input is the ReLU's result, which the ReLU also saves: dropping it frees
        memory only together with bit-packing the ReLU's result (see ``bytes_together``).
    """
    for node, hits in ctx.claims("GA302", NOT_NEEDED):
        yield Flag(node, hits, f"{node.module or 'model'} saves its whole "
                               f"{'x'.join(map(str, hits[0].shape))} input; backward reads only its shape")


@rule("GA401", "sign-only-save-kept-as-float",
      fix="Keep a 1-bit sign mask instead of the float tensor (gradaudit.trim(bitpack=True))",
      fix_code="""
        import gradaudit
        with gradaudit.trim(model, bitpack=True):
            model(x).sum().backward()
      """)
def sign_only_save_kept_as_float(ctx: RuleContext):
    """An activation keeps a float tensor although backward reads only its sign.

    What it flags:
        ReLU results, LeakyReLU inputs and threshold(x, 0, v) inputs saved for backward.
    Why it costs memory:
        The gradient is grad * (t > 0) (or a slope where t <= 0): one bit per element would do,
        a float32 tensor takes 32.
    Example:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
        report = gradaudit.audit(model, torch.randn(8, 16))
    Fix:
        ``gradaudit.trim(model, bitpack=True)`` stores the sign pattern packed 8 per byte.
    Fix safety:
        Gradients are bit-identical: the backward reads only the sign.
    Known limits:
        Often the same tensor is the next layer's saved input; memory is freed only if that
        save can be dropped too (frozen next layer) - otherwise ``bytes`` is 0.
    """
    for node, hits in ctx.claims("GA401", SIGN_ONLY):
        yield Flag(node, hits, f"{node.module or 'model'} keeps a "
                               f"{hits[0].dtype} tensor of {'x'.join(map(str, hits[0].shape))} "
                               f"where backward reads only its sign")


@rule("GA402", "dropout-mask-saved-as-float",
      fix="Keep dropout's mask as bits (gradaudit.trim(bitpack=True)): gradients stay bit-identical",
      fix_code="""
        import gradaudit
        with gradaudit.trim(model, bitpack=True):   # the 0 / 1/(1-p) mask kept as 1 bit per element
            model(x).sum().backward()
      """)
def dropout_mask_saved_as_float(ctx: RuleContext):
    """Dropout keeps its keep-mask as a float tensor although it holds only two values.

    What it flags:
        nn.Dropout/Dropout1d/2d/3d running in training mode where PyTorch implements dropout as
        ``input * mask`` (on CPU, and wherever the fused native_dropout is not used): the
        MulBackward0 node saves ``other``, a float mask holding only 0 and 1/(1-p).
    Why it costs memory:
        The mask has the input's size and dtype (32 bits per element in float32); its information
        is one bit per element.
    Example:
        model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.Linear(32, 10)).train()
        report = gradaudit.audit(model, torch.randn(8, 16))   # on CPU dropout runs as input * mask
    Fix:
        Bit-pack the saved mask (``gradaudit.trim(model, bitpack=True)``, the snippet). Or, in your
        own code, a dropout that saves a bool mask: ``keep = torch.rand_like(x) >= p`` then
        ``torch.where(keep, x / (1 - p), 0.0)`` (``torch.where`` saves only its bool condition).
    Fix safety:
        Bit-packing is bit-identical. The ``torch.where`` rewrite draws its random numbers
        differently and rounds ``x / (1 - p)`` once instead of ``x * mask``: not bit-identical.
    Known limits:
        Recognised by module class (Dropout*) and the node (MulBackward0 ``other``); with
        verify=True the two-valuedness is checked on the actual mask.
    """
    for node, masks in ctx.claims("GA402", NEEDED, bitpackable=True):
        for mask in masks:
            yield Flag(node, [mask], f"{node.module or 'model'} ({mask.module_class}) keeps a {mask.dtype} "
                                     f"dropout mask of {_shape(mask)} that holds only two values")


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


@rule("GA601", "saved-view-keeps-large-base",
      fix="Save a compact copy of the slice instead of a view of the whole tensor",
      fix_code="""
        last = hidden[:, -1].clone()   # the copy owns its memory; the full `hidden` can be freed
        logits = head(last)
      """)
def saved_view_keeps_large_base(ctx: RuleContext):
    """A saved view keeps a much larger base storage alive.

    What it flags:
        A held saved tensor that is a view covering at most half of its storage (at least 4 KiB
        more), where no other held save covers more of it: e.g. ``x[:, -1]`` fed to a trainable
        Linear keeps all of ``x``.
    Why it costs memory:
        Autograd saves the view, and a view keeps its whole base storage alive until backward.
    Example:
        class LastToken(nn.Module):
            def __init__(self):
                super().__init__()
                self.encoder, self.head = nn.Linear(16, 64), nn.Linear(64, 4)

            def forward(self, x):
                h = self.encoder(x)            # B x L x H
                return self.head(h[:, -1])     # head saves h[:, -1], keeping all B x L x H
        report = gradaudit.audit(LastToken(), torch.randn(2, 32, 16))
    Fix:
        ``.clone()`` (or ``.contiguous()`` for non-contiguous slices) the slice before the op.
    Fix safety:
        Gradients are bit-identical: the values are the same, only their memory differs.
    Known limits:
        The bytes assume nothing outside autograd's saves (your own references) keeps the base.
    """
    seen: set[int] = set()  # storages judged already (the judgement is the storage's, not the save's)
    for t in ctx.held():
        if t.storage_id < 0 or t.storage_id in seen or t.storage_kind != StorageKind.ACTIVATION:
            continue
        seen.add(t.storage_id)
        storage = ctx.storages[t.storage_id]
        if storage.nbytes < 4096:  # nothing to keep alive beyond the views
            continue
        refs = ctx.storage_refs(t.storage_id)
        views = {(r.storage_offset, r.shape, r.stride): r.view_nbytes for r in refs}
        covered = sum(views.values())
        if covered * 2 > storage.nbytes or storage.nbytes - covered < 4096:
            continue
        yield Flag(ctx.nodes[t.node_id], refs, f"{t.module or 'model'} saves a {_shape(t)} view "
                                                f"({covered} bytes) that keeps a {storage.nbytes}-byte "
                                                f"storage alive", bytes=storage.nbytes - covered)


@rule("GA701", "frozen-weight-cast-copy-saved",
      fix="Cast the frozen weights once instead of on every step (autocast casts them per call)",
      fix_code="""
        frozen.to(torch.bfloat16)       # frozen parameters stored in the autocast dtype:
        with torch.autocast("cuda", dtype=torch.bfloat16):   # no per-step cast copy to save
            loss = model(x).sum()
      """)
def frozen_weight_cast_copy_saved(ctx: RuleContext):
    """A dtype-cast copy of a frozen weight is saved for backward (autocast).

    What it flags:
        Linear/convolution nodes whose saved weight is a 16-bit activation (a copy autocast made
        this step) in a module whose ``weight`` parameter is frozen.
    Why it costs memory:
        Autocast casts float32 parameters to 16 bits on every call; the input gradient reads the
        weight, so autograd keeps the copy until backward: one extra copy of every frozen weight
        per micro-batch in flight.
    Example:
        model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
        model[1].requires_grad_(False)
        with torch.autocast("cpu", dtype=torch.bfloat16):          # or "cuda"
            report = gradaudit.audit(model, torch.randn(4, 16))   # model[1] saves a bf16 copy of its weight
    Fix:
        Store frozen parameters in the compute dtype (``frozen.to(torch.bfloat16)``) so autocast
        does not cast them; or keep them in float32 and accept the copy.
    Fix safety:
        Gradients are bit-identical when the stored bf16 weights equal autocast's cast (rounding
        the same float32 values once).
    Known limits:
        Recognised by module (``<module>.weight`` frozen) and node type; weights used outside
        their module are not seen.
    """
    slots: dict[str, Optional[str]] = {}  # node type -> weight_slot(), asked once per type
    for node in ctx.nodes:
        if not node.created_here:
            continue
        slot = slots[node.name] if node.name in slots else slots.setdefault(node.name, weight_slot(node.name))
        if slot is None:
            continue
        weight = ctx.saved(node).get(slot)
        if (weight is None or weight.managed_by != Manager.AUTOGRAD or weight.storage_kind != StorageKind.ACTIVATION
                or weight.dtype not in LOW_PRECISION or weight.verdict == NOT_NEEDED):
            continue
        name = f"{weight.module}.weight" if weight.module else "weight"
        if ctx.parameter_names.get(name) is False:
            yield Flag(node, [weight], f"{weight.module or 'model'} saves a {weight.dtype} copy of its frozen "
                                       f"weight ({_shape(weight)}) made by a dtype cast this step",
                       bytes=sum(ctx.freed_by_storage([weight.index]).values()))


ATTENTION_DROPOUT_SNIPPET = """
    # Hugging Face (BERT-style, Llama-style configs):
    config.attention_probs_dropout_prob = 0.0     # or config.attention_dropout = 0.0
    # your own module: F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
"""
ATTENTION_DIAGNOSIS_SNIPPET = """
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
    params = SDPAParams(q, k, v, mask, dropout_p, is_causal, enable_gqa)
    can_use_flash_attention(params, debug=True)       # warns with the reason it cannot
"""
# torch has no public "why not" for the CPU kernel: its constraints (sdp_utils_cpp.cpp), in words
CPU_ATTENTION_SNIPPET = """
    # the CPU flash kernel takes: 4-D query, key and value of one floating dtype and one head dim,
    # no dropout, an attn_mask that is 2-D or 4-D (broadcast over batch and heads) and needs no grad
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
"""


def _passed_over(call, kernel: str = "") -> str:
    """Why the fused kernels were passed over ("flash: ...; efficient: ..."), or why ``kernel`` was,
    as the kernel choice said ("" where it said nothing)."""
    if kernel:
        return next((why for name, why in call.passed_over if name == kernel), "")
    return "; ".join(f"{name}: {why}" for name, why in call.passed_over)


@rule("GA801", "eager-attention-saves-probabilities",
      fix="Use scaled_dot_product_attention: it keeps no B x H x L x L matrix for backward",
      fix_code="""
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p if self.training else 0.0)
        # Hugging Face: AutoModel.from_config(config, attn_implementation="sdpa")
      """, fix_safe=False)
def eager_attention_saves_probabilities(ctx: RuleContext):  # noqa: C901 (two causes, one rule)
    """Eager attention keeps the full B x H x L x L attention-probability matrix for backward.

    What it flags:
        A 4-D softmax result (batch, heads, queries, keys) saved for backward, together with the
        other saves of the same size in the same module (dropout mask, dropped probabilities
        saved by the value matmul). Also when ``scaled_dot_product_attention`` itself ran its
        unfused math kernel: then the finding names why (on CPU, attention dropout: the fused
        CPU kernel takes none) and the fix that works there, never "use SDPA".
    Why it costs memory:
        These matrices grow with the square of the sequence length. Fused attention
        (``scaled_dot_product_attention``) saves only the output and one logsumexp value per
        query, and recomputes the probabilities in backward.
    Example:
        class Attention(nn.Module):
            def forward(self, q, k, v):
                attn = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).softmax(-1)
                return attn @ v
        q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
        report = gradaudit.audit(Attention(), (q, k, v))
    Fix:
        Call ``F.scaled_dot_product_attention``; in Hugging Face build the model with
        ``attn_implementation="sdpa"``. Where SDPA already runs but falls back to its math kernel
        because of attention dropout on CPU: train with attention dropout 0 there (Hugging Face:
        ``attention_probs_dropout_prob=0.0`` / ``attention_dropout=0.0``); CUDA's fused kernels
        apply dropout themselves (cuDNN's only in multiples of 1/16: where it is the one fused
        kernel the arguments leave, such a probability keeps it).
    Fix safety:
        Not bit-identical: fused kernels sum in a different order (differences at rounding level);
        dropping attention dropout changes training.
    Known limits:
        ``bytes`` assumes every probability-sized save of the module goes away and adds back one
        float32 logsumexp per (batch, head, query).
    """
    dropout_calls = []
    for node in ctx.nodes_named("SoftmaxBackward0", "SafeSoftmaxBackward0"):
        result = ctx.saved(node).get("result")
        if result is None or len(result.shape) != 4 or result.managed_by != Manager.AUTOGRAD \
                or result.storage_kind not in HELD_KINDS:
            continue
        batch, heads, queries, keys = result.shape
        call = node.attention
        logsumexp = batch * heads * queries * 4
        matrix = f"{batch}x{heads}x{queries}x{keys} attention probabilities"
        if call is None:  # attention written out by hand
            same_size = [t for t in ctx.held() if t.module == result.module and t.numel == result.numel
                         and t.storage_kind in HELD_KINDS and t.node_id >= 0]
            freed = sum(ctx.freed_by_storage(t.index for t in same_size).values())
            yield Flag(node, same_size, f"{result.module or 'model'} keeps {matrix} ({len(same_size)} saves of "
                                        f"that size)", bytes=max(0, freed - logsumexp))
            continue
        if not call.math_fallback:
            continue
        inside = [t for t in ctx.held() if ctx.nodes[t.node_id].attention == call and t.storage_kind in HELD_KINDS]
        if not inside:
            continue  # the call's saves are checkpointed or offloaded: it holds nothing here
        if call.dropout_p and call.kernel_without_dropout != "math":
            dropout_calls.append((node, call, inside, matrix))
        else:
            # no fused kernel takes these arguments: what it would keep instead is not measured,
            # so this explains and promises no bytes
            why = _passed_over(call) or "mask, dtype or head size"
            on_cuda = call.device == "cuda"
            yield Flag(node, inside,
                       f"{result.module or 'model'}: scaled_dot_product_attention ran its math kernel (no fused "
                       f"{call.device} kernel takes these arguments: {why}), which keeps {matrix}",
                       fix=("Pass arguments a fused kernel takes (torch.backends.cuda.can_use_flash_attention "
                            "and can_use_efficient_attention say why not, with debug=True)" if on_cuda else
                            "Pass arguments the CPU flash kernel takes (see the snippet)"),
                       fix_code=ATTENTION_DIAGNOSIS_SNIPPET if on_cuda else CPU_ATTENTION_SNIPPET,
                       severity=Severity.INFO, bytes=0)
    if dropout_calls:
        # one cause, one fix for the whole model: attention dropout sends every call to the math
        # kernel. The bytes are measured: the same forward with dropout_p=0 in every call
        node, call, _, matrix = dropout_calls[0]
        without = ctx.measured.get("held_without_attention_dropout")
        saved = sum(ctx.storages[s].nbytes for s in {t.storage_id for t in ctx.held() if t.storage_id >= 0}
                    if ctx.storages[s].kind in HELD_KINDS)
        modules = sorted({c[0].module for c in dropout_calls})
        calls = (f"{len(dropout_calls)} scaled_dot_product_attention call{'s' if len(dropout_calls) > 1 else ''} "
                 f"({', '.join(modules[:3])}{', ...' if len(modules) > 3 else ''})")
        fused = call.kernel_without_dropout
        if call.device == "cuda":
            # CUDA's fused kernels apply dropout themselves; one that refuses this probability
            # (cuDNN: multiples of 1/16) can leave the math kernel as the only one left
            why = _passed_over(call, fused) or "it does not take this dropout"
            message = (f"{calls} ran the math kernel because dropout_p={call.dropout_p:g} rules out the CUDA "
                       f"{fused} kernel ({why}), which takes these arguments without dropout, keeping {matrix} each")
            fix = f"Use an attention dropout the CUDA {fused} kernel takes, or none ({why})"
        else:
            message = (f"{calls} ran the math kernel because dropout_p={call.dropout_p:g} (the {call.device} "
                       f"{fused} kernel takes no dropout), keeping {matrix} each")
            fix = (f"Train without attention dropout on {call.device.upper()} (the fused kernel then runs); "
                   f"on CUDA the fused kernels apply dropout themselves")
        yield Flag(node, [t for c in dropout_calls for t in c[2]], message, fix=fix,
                   fix_code=ATTENTION_DROPOUT_SNIPPET, module=modules[0] if len(modules) == 1 else "",
                   bytes=max(0, saved - without) if without is not None else None)


@rule("GA901", "trainable-parameters-get-no-gradient", severity=Severity.WARNING,
      fix="Use non-reentrant checkpointing (or make an input of the checkpointed block require grad)",
      fix_code="""
        from torch.utils.checkpoint import checkpoint
        y = checkpoint(block, x, use_reentrant=False)   # parameters inside get their gradients
      """)
def trainable_parameters_get_no_gradient(ctx: RuleContext):
    """Parameters that require grad are not in the autograd graph: they will get no gradient.

    What it flags:
        Parameters with requires_grad=True that no output of the forward depends on through
        autograd. The usual cause is ``checkpoint(..., use_reentrant=True)`` around a block whose
        inputs need no grad: the block's output then does not require grad and the parameters
        inside silently get no gradient. Also: modules whose output is unused.
    Why it costs memory:
        It is a correctness hazard, not memory: those parameters' optimizer states cost memory
        for nothing and the layers do not train.
    Example:
        from torch.utils.checkpoint import checkpoint
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed, self.block, self.head = nn.Embedding(100, 16), nn.Linear(16, 16), nn.Linear(16, 4)

            def forward(self, ids):
                x = self.embed(ids).detach()                        # or a frozen embedding
                y = checkpoint(self.block, x, use_reentrant=True)   # block's weights get no .grad
                return self.head(y)
        report = gradaudit.audit(Net(), torch.randint(0, 100, (4, 8)))
    Fix:
        ``use_reentrant=False``; or freeze the parameters you do not mean to train.
    Fix safety:
        Changes training: those parameters start receiving gradients.
    Known limits:
        Parameters used only outside the audited forward (a loss module, tied weights used
        elsewhere) are reported too; ignore with ``ignore=["GA901"]`` when intended. A reentrant
        checkpoint whose inputs need a gradient builds its block's graph only in backward: every
        parameter of the modules that ran inside it (or that its function names) counts as reached,
        so one it never uses is not reported.
    """
    reached = {n.variable.parameter for n in ctx.nodes if n.variable is not None and n.variable.parameter}
    if not any(n.name == "AccumulateGrad" or n.saved for n in ctx.nodes):
        return
    # a reentrant checkpoint reached from the outputs gives its block's parameters their gradients
    # when backward recomputes the block (its inner graph does not exist before then)
    for region in ctx.checkpoints:
        if region.reentrant and region.node_id >= 0:
            reached.update(region.parameters)
    missing = sorted(name for name, trains in ctx.parameter_names.items() if trains and name not in reached)
    by_module: dict[str, list[str]] = {}
    for name in missing:
        by_module.setdefault(name.rpartition(".")[0], []).append(name)
    cut_off = [r for r in ctx.checkpoints if r.reentrant and r.node_id < 0]
    for module, names in by_module.items():
        message = (f"{module or 'model'}: {len(names)} trainable parameter(s) get no gradient "
                   f"from this forward ({', '.join(n.rpartition('.')[2] for n in names)})")
        cause = next((r for r in cut_off if set(names) & set(r.parameters)), None)
        if cause is not None:
            message += (f": it runs inside checkpoint(..., use_reentrant=True) around {cause.module or 'the model'} "
                        f"({cause.module_class}), whose inputs need no gradient, so the checkpoint's output "
                        f"does not require grad")
        yield Flag(None, [], message, module=module, module_class=ctx.module_classes.get(module, ""),
                   source=cause.source if cause is not None else None, bytes=0)


@rule("GA902", "batchnorm-train-in-checkpoint", severity=Severity.WARNING,
      fix="Keep batch norm outside the checkpointed region (its running statistics update again on recompute)",
      fix_code="""
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(block.conv, x, use_reentrant=False)   # recompute only the convolution
        h = block.bn(h)                                      # batch norm runs once per step
      """, fix_safe=False)
def batchnorm_train_in_checkpoint(ctx: RuleContext):
    """Batch norm in training mode runs inside a checkpointed block.

    What it flags:
        Batch norm nodes (native, cuDNN or MIOpen kernel) with training=True whose saves are managed
        by ``torch.utils.checkpoint``.
    Why it costs memory:
        Not memory but correctness: backward recomputes the block's forward, so the running
        mean/variance are updated twice per step (momentum applied twice).
    Example:
        from torch.utils.checkpoint import checkpoint
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.block = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())

            def forward(self, x):
                return checkpoint(self.block, x, use_reentrant=False)
        report = gradaudit.audit(Net().train(), torch.randn(2, 3, 12, 12))
    Fix:
        Checkpoint only the layers around batch norm, or put batch norm in eval mode.
    Fix safety:
        Changes the running statistics (they are updated once, as without checkpointing).
    Known limits:
        Reentrant checkpoints hide their inner nodes; only non-reentrant ones are seen.
    """
    for node in ctx.nodes_named("NativeBatchNormBackward0", "CudnnBatchNormBackward0",
                                "MiopenBatchNormBackward0"):
        if node.scalars.get("training") is not True:
            continue
        hits = [t for t in ctx.saved(node).values() if t.managed_by == Manager.CHECKPOINT]
        if hits:
            yield Flag(node, hits, f"{node.module or 'model'} (batch norm, training mode) runs inside a "
                                   f"checkpoint: its running statistics are updated again on recompute",
                       bytes=0)


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


@rule("GA001", "saved-for-unwanted-gradient",
      fix="Drop the save while the gradient that reads it is not wanted (gradaudit.trim)",
      fix_code=TRIM_SNIPPET)
def saved_for_unwanted_gradient(ctx: RuleContext):
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
    for node, hits in ctx.claims("GA001", NOT_NEEDED):
        yield Flag(node, hits, f"{node.module or 'model'}: {node.name} saves {', '.join(t.attr for t in hits)} "
                               f"that no wanted gradient reads")


@rule("GA002", "saved-for-shape-only",
      fix="Keep only the shape of a save backward reads for its shape (gradaudit.trim)",
      fix_code=TRIM_SNIPPET)
def saved_for_shape_only(ctx: RuleContext):
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
    for node, hits in ctx.claims("GA002", NOT_NEEDED):
        yield Flag(node, hits, f"{node.module or 'model'}: {node.name} saves its whole "
                               f"{'x'.join(map(str, hits[0].shape))} {hits[0].attr}; backward reads only its shape")
