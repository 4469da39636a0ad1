"""GA7xx: dtypes and copies: autocast's per-step copy of a frozen weight saved for backward; a loss holding
float32 log-probabilities over a large vocabulary; a compiled region's copy of a weight in another layout."""

from __future__ import annotations

from typing import Optional

from ..knowledge import weight_slot
from ..records import NOT_NEEDED, Manager, StorageKind
from .registry import Flag, RuleContext, rule
from .shared import shape_text
from ..tensors import contiguous_strides
from ..torchapi.compiler import COMPILED_NODE, original_path

LOW_PRECISION = ("float16", "bfloat16")


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
                                       f"weight ({shape_text(weight)}) made by a dtype cast this step",
                       bytes=sum(ctx.freed_by_storage([weight.index]).values()))


LARGE_VOCABULARY = 16384  # classes from which a loss's log-probabilities are worth not holding


@rule("GA702", "loss-log-probabilities-held-in-float32",
      fix="Compute the loss in chunks, or with a fused linear cross-entropy, so no B x L x V log-probabilities are held",
      fix_code="""
        # the loss over chunks of the sequence, each recomputed in backward: nothing of size V is held
        hidden = model.model(input_ids, attention_mask=mask).last_hidden_state[:, :-1]
        targets = labels[:, 1:]
        def chunk_loss(h, y):
            return F.cross_entropy(model.lm_head(h).float().flatten(0, 1), y.flatten(),
                                   ignore_index=-100, reduction="sum")
        loss = sum(checkpoint(chunk_loss, h, y, use_reentrant=False)
                   for h, y in zip(hidden.split(512, 1), targets.split(512, 1))) / (targets != -100).sum()
        # or a fused kernel: Liger Kernel's LigerFusedLinearCrossEntropyLoss, cut-cross-entropy
      """, fix_safe=False)
def loss_log_probabilities_held_in_float32(ctx: RuleContext):
    """A loss over a large vocabulary holds float32 log-probabilities of every position for backward.

    What it flags:
        A ``log_softmax`` (``cross_entropy``'s first half) whose float32 result over more than
        16,384 classes autograd keeps: in a language model's loss, batch x sequence x vocabulary
        floats. Where its input was a cast (``logits.float()``, as Hugging Face's losses do, or
        autocast), the message says so: the 16-bit logits were copied to float32 first.
    Why it costs memory:
        ``log_softmax``'s gradient reads its result, so the whole B x L x V float32 tensor stays until
        backward: 9.3 GiB for a batch of 4 x 4096 over Qwen2's 151,936 tokens, often the largest single
        allocation of a fine-tuning step. A loss computed over chunks of the sequence, each recomputed in
        backward, or a fused linear cross-entropy kernel, never holds it.
    Example:
        class OutputLayerAndLoss(nn.Module):     # a language model's last layer over 20,000 tokens
            def __init__(self):
                super().__init__()
                self.lm_head = nn.Linear(16, 20000)
            def forward(self, hidden, labels):
                return F.cross_entropy(self.lm_head(hidden).float().flatten(0, 1), labels.flatten())
        batch = (torch.randn(2, 8, 16), torch.randint(0, 20000, (2, 8)))
        report = gradaudit.audit(OutputLayerAndLoss(), batch)   # 2 x 8 x 20,000 floats: 1,280,000 B
    Fix:
        Compute the loss over chunks of the sequence under ``torch.utils.checkpoint`` (each chunk's
        logits and log-probabilities are made again in backward), or use a fused linear
        cross-entropy (Liger Kernel, cut-cross-entropy), which computes the gradient chunk by chunk.
        ``gradaudit.fit`` names the same change among its levers with the bytes at the step's peak.
    Fix safety:
        Not bit-identical: the chunks sum in another order (differences at rounding level); a chunked
        loss recomputes the output layer in backward (one more matrix product per chunk).
    Known limits:
        Only a loss computed inside the audited call is seen (a Hugging Face model given ``labels``,
        or a function that returns the loss); one computed by the caller afterwards is not. The bytes
        are the result's storage; the 16-bit logits the model returns are the caller's.
    """
    for node in ctx.nodes_named("LogSoftmaxBackward0"):
        result = ctx.saved(node).get("result")
        if (result is None or result.dtype != "float32" or not result.shape or result.shape[-1] <= LARGE_VOCABULARY
                or result.managed_by != Manager.AUTOGRAD or result.storage_kind != StorageKind.ACTIVATION):
            continue
        upcast = _cast_before(ctx, node)
        positions = result.numel // result.shape[-1]
        # the loss's other saves of the same storage (nll_loss keeps it too) go with it
        sharing = [t for t in ctx.held() if t.storage_id == result.storage_id and t.storage_id >= 0]
        yield Flag(node, sharing or [result],
                   f"{result.module or 'the model'}'s loss holds float32 log-probabilities of {positions:,} positions "
                   f"over {result.shape[-1]:,} classes ({shape_text(result)})"
                   + (", from logits cast to float32" if upcast else ""),
                   bytes=ctx.storages[result.storage_id].nbytes if result.storage_id >= 0 else 0)


# nodes that only reshape or copy what they are given: a cast before them is the loss input's
_SHAPE_ONLY = ("View", "UnsafeView", "Slice", "Clone", "Transpose", "Permute", "Select", "Expand", "AsStrided",
               "Reshape", "Squeeze", "Unsqueeze")


def _cast_before(ctx: RuleContext, node, depth: int = 6) -> bool:
    """Whether ``node``'s input came from a dtype cast (``ToCopyBackward0``), through reshapes only."""
    for _ in range(depth):
        inputs = [i for i in node.next_ids if i is not None]
        if len(inputs) != 1:
            return False
        node = ctx.nodes[inputs[0]]
        if node.name == "ToCopyBackward0":
            return True
        if not node.name.rstrip("0123456789").removesuffix("Backward").startswith(_SHAPE_ONLY):
            return False
    return False


@rule("GA703", "compiled-weight-layout-copy-saved",
      fix="Put the model and its inputs in the layout the compiled kernels use before compiling "
          "(channels_last), or turn the compiler's layout choice off",
      fix_safe=False,
      fix_code="""
        model = model.to(memory_format=torch.channels_last)    # the weights in the layout the kernels use
        x = x.to(memory_format=torch.channels_last)
        compiled = torch.compile(model)                          # no per-step copy of a weight to keep
        # or: torch._inductor.config.layout_optimization = False, before compiling
      """)
def compiled_weight_layout_copy_saved(ctx: RuleContext):
    """A torch.compile'd region keeps, for backward, a copy of a weight in another memory layout.

    What it flags:
        Saves of a compiled region that are copies of one of the model's parameters (equal values
        in a storage of their own: ``copy_of``) in a layout other than the parameter's contiguous
        one, such as the channels-last copies of convolution weights the default backend
        (inductor) makes on every step and hands to the backward's ``convolution_backward``.
    Why it costs memory:
        The parameter is alive anyway; the copy is a second one, held from the forward until
        backward, whether the weight trains or is frozen (the input's gradient reads the weight).
        On a ResNet-18 fine-tuned with most layers frozen (2 x 3 x 64 x 64, CPU) such copies
        were 43.9 MB of the 45.6 MB the compiled step held; with the model and input in
        channels_last before compiling it held 1.6 MB.
    Example:
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        model[2].requires_grad_(False)   # frozen: backward still reads its weight for the input's gradient
        compiled = torch.compile(model)  # the default backend makes channels-last copies of the weights
        report = gradaudit.audit(compiled, torch.randn(2, 3, 16, 16))
    Fix:
        ``model.to(memory_format=torch.channels_last)`` and the inputs likewise, before
        compiling: the weights are then in the layout the compiled kernels use and no copy is
        made. Or set ``torch._inductor.config.layout_optimization = False`` before compiling:
        the kernels then run in the parameters' layout.
    Fix safety:
        Not bit-identical: another layout runs other kernels, which may round differently.
    Known limits:
        A copy is recognised by its values equal to exactly one parameter of its shape and dtype
        (not on the meta device, which has no values); the layouts other backends choose may
        differ.
    """
    trains: Optional[dict[str, bool]] = None  # parameter names as copy_of gives them (no _orig_mod)
    for t in ctx.held():
        if (t.node != COMPILED_NODE or t.copy_of is None or t.storage_kind != StorageKind.ACTIVATION
                or tuple(t.stride) == contiguous_strides(t.shape) or t.index in ctx.covered):
            continue
        if trains is None:
            trains = {original_path(name): flag for name, flag in ctx.parameter_names.items()}
        frozen = "frozen " if trains.get(t.copy_of) is False else ""
        yield Flag(ctx.nodes[t.node_id], [t],
                   f"{t.module or 'model'} ({t.module_class}): the compiled region keeps a copy of {frozen}"
                   f"{t.copy_of} ({shape_text(t)}, strides {tuple(t.stride)}) beside the parameter itself",
                   module=t.module, module_class=t.module_class, source=t.source,
                   bytes=sum(ctx.freed_by_storage([t.index]).values()))
