"""GA8xx: attention keeps its B x H x L x L probabilities (written out by hand, or SDPA's math kernel)."""

from __future__ import annotations

from typing import Iterator

from ..records import HELD_KINDS, Manager, Severity
from .registry import Flag, RuleContext, rule


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
        yield from _dropout_flag(ctx, dropout_calls)


def _dropout_flag(ctx: RuleContext, dropout_calls: list) -> Iterator[Flag]:
    """One finding for every ``scaled_dot_product_attention`` call that attention dropout sent to the
    math kernel: one cause, one fix for the whole model."""
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
