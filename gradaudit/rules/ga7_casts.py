"""GA7xx: dtype casts: autocast's per-step copy of a frozen weight saved for backward."""

from __future__ import annotations

from typing import Optional

from ..knowledge import weight_slot
from ..records import NOT_NEEDED, Manager, StorageKind
from .registry import Flag, RuleContext, rule
from .shared import shape_text

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
