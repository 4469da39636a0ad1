"""GA6xx: views and storages: a saved view keeps its whole base alive."""

from __future__ import annotations

from ..records import StorageKind
from .registry import Flag, RuleContext, rule
from .shared import shape_text


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
        yield Flag(ctx.nodes[t.node_id], refs, f"{t.module or 'model'} saves a {shape_text(t)} view "
                                                f"({covered} bytes) that keeps a {storage.nbytes}-byte "
                                                f"storage alive", bytes=storage.nbytes - covered)
