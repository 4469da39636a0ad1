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


@rule("GA602", "gathered-input-saved-where-shard-would-do",
      fix="Keep this rank's shard and gather it again in backward: checkpoint the block (gradaudit plan)",
      fix_code="""
        # the block's input is this rank's sequence shard; checkpointed, the block keeps only that
        # and backward gathers again as it recomputes (gradaudit plan weighs which blocks)
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(block, h, use_reentrant=False)
      """)
def gathered_input_saved_where_shard_would_do(ctx: RuleContext):
    """A tensor all-gathered across ranks is kept for backward although each rank holds a shard of it.

    What it flags:
        A held activation whose storage holds all-gathered data (the result of an all-gather, or
        the chunks-and-concatenation DTensor makes of it) saved for backward: under sequence
        parallelism, the input of a column-parallel linear is gathered from every rank's sequence
        shard, and the linear keeps the gathered input for its weight's gradient. One finding per
        module whose saves hold such storages.
    Why it costs memory:
        The gathered tensor is the group's size times what this rank holds of it. Its shard alone,
        gathered again in backward, is enough: the gather gives the same values both times.
    Example:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)

        class Block(nn.Module):
            def __init__(self, d=64):
                super().__init__()
                self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

            def forward(self, x):
                return x + self.down(torch.relu(self.up(self.norm(x))))

        with gradaudit.fake_world(4):   # rank 0 of 4, in this one process
            mesh = init_device_mesh("cpu", (4,))
            block = parallelize_module(Block(), mesh, {
                "norm": SequenceParallel(),
                "up": ColwiseParallel(input_layouts=Shard(1)),       # gathers the sequence
                "down": RowwiseParallel(output_layouts=Shard(1))})   # scatters it again
            x = torch.randn(8, 16, 64)   # this rank's shard of a 64-token sequence
            report = gradaudit.audit(block, x)
    Fix:
        Keep the shard and gather again in backward. In plain PyTorch, checkpoint the block
        (``torch.utils.checkpoint``; ``gradaudit plan`` chooses which blocks for a budget): it keeps
        the sharded input it is given and gathers again while recomputing. Megatron-Bridge added
        a gather-only recompute for exactly this save (NVIDIA-NeMo/Megatron-Bridge#4581).
    Fix safety:
        Gradients are bit-identical: the gather in backward returns the same values. It costs a
        second all-gather per block in backward (and, checkpointing, the block's recomputation).
    Known limits:
        The bytes count the gathered storage minus one shard of it (the shard a rank would keep
        instead, if nothing else holds it). A gather the recorder cannot see (inside another torch
        function, or a collective other than ``_c10d_functional.all_gather_into_tensor``) is not
        flagged.
    """
    by_module: dict[str, list] = {}
    seen: set[int] = set()
    for t in ctx.held():
        if t.storage_id < 0 or t.storage_kind != StorageKind.ACTIVATION or t.index in ctx.covered:
            continue
        storage = ctx.storages[t.storage_id]
        if storage.gathered_over < 2 or storage.nbytes == 0:
            continue
        by_module.setdefault(t.module, []).append(t)
        seen.add(t.storage_id)
    for module, saves in by_module.items():
        storages = {t.storage_id: ctx.storages[t.storage_id] for t in saves}
        gathered = sum(s.nbytes for s in storages.values())
        shards = sum(s.nbytes // s.gathered_over for s in storages.values())
        groups = sorted({s.gathered_over for s in storages.values()})
        over = " or ".join(str(g) for g in groups)
        yield Flag(ctx.nodes[saves[0].node_id], saves,
                   f"{module or 'model'} keeps {gathered} bytes all-gathered over {over} ranks for backward; this "
                   f"rank's shard is {shards} bytes ({gathered} / {over}): keeping it and gathering again in "
                   f"backward frees {gathered - shards}", bytes=gathered - shards)
