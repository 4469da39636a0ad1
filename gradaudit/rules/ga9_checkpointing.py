"""GA9xx: checkpointing hygiene: parameters cut off from the graph, batch norm recomputed in train mode."""

from __future__ import annotations

from ..records import Manager, Severity
from ..torchapi.compiler import original_path
from .registry import Flag, RuleContext, rule


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
        # a compiled model's parameters by the eager model's paths (its _orig_mod left out), as its saves are named
        by_module.setdefault(original_path(name.rpartition(".")[0]), []).append(name)
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
