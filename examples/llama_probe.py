"""The linear-probe question at full scale: an 80-layer, 69B-parameter Llama with only layer 40
trainable. Does autograd hold activations for layers 41-80? For layers 1-39? Which of them are needed?

Everything runs on the ``meta`` device: the model is built without allocating its 138 GB of bf16
weights, the forward records every tensor autograd saves (shape, dtype, storage) without computing a
value, and the byte figures are those of the real model at sequence length 2048.

The answers the scan gives:
- Layers 1-39 hold nothing: no parameter before layer 40 trains and the token ids need no gradient,
  so autograd builds no graph there.
- Layers 41-80 are frozen, but the gradient must flow back through them from the loss to layer 40, so
  they hold activations. Their frozen linear layers save only the (already resident) weights; what they
  hold is what the input gradient needs: RMSNorm inputs, the SiLU gate input, attention inputs and
  outputs. Those are needed - the scan marks them as such.
- Layer 40 itself holds what its weight gradients need as well.

    gradaudit scan examples/llama_probe.py:build --device meta
    python examples/llama_probe.py        # prints the per-layer answer
    gradaudit plan examples/llama_probe.py:build --budget 16GiB --budget 8GiB --budget 4GiB
                                          # which layers to recompute to fit each budget

Layer numbers in prose count from 1; module paths count from 0 (layer 40 is ``model.layers.39``).
"""

import torch

LAYERS, PROBED, SEQUENCE = 80, 40, 2048


PADDING = 64  # the batch's sequence ends in this many padding tokens (a padded batch, as collators make)


def config(layers: int = LAYERS):
    from transformers import LlamaConfig

    # Llama-2-70B's shape: 8192 wide, 64 heads sharing 8 key/value heads, 28672 MLP, 32000 tokens.
    return LlamaConfig(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
        torch_dtype=torch.bfloat16, use_cache=False,
    )


def build(layers: int = LAYERS, probed: int = PROBED, sequence: int = SEQUENCE):
    """The stock ``LlamaForCausalLM`` on meta in its training configuration (``use_cache=False``, SDPA
    attention), with a training batch: token ids, a padded attention mask and labels."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):  # no weights are allocated, whatever --device says
        model = LlamaForCausalLM._from_config(config(layers), attn_implementation="sdpa").to(torch.bfloat16)
    # the batch as a collator makes it, on the CPU: values decide what the model's mask code does
    input_ids = torch.zeros(1, sequence, dtype=torch.long)
    attention_mask = torch.ones(1, sequence, dtype=torch.long)
    attention_mask[:, sequence - min(PADDING, sequence // 4):] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    model.requires_grad_(False)
    model.model.layers[probed - 1].requires_grad_(True)
    model.train()
    return model, {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def held_by_layer(report) -> dict[int, dict[str, int]]:
    """Layer number (from 1) -> bytes held by the saves made inside it, by verdict.

    A storage is counted once, under the verdict of its most demanding save (needed > unknown >
    sign-only > not-needed): dropping it frees memory only if no save needs it.
    """
    rank = {"needed": 3, "unknown": 2, "sign-only": 1, "not-needed": 0}
    storages: dict[int, tuple[int, str]] = {}
    for t in report.held_tensors:
        parts = t.module.split(".")
        if len(parts) < 3 or parts[:2] != ["model", "layers"]:
            continue
        if report.storages[t.storage_id].kind not in ("activation", "output"):
            continue
        layer, verdict = storages.get(t.storage_id, (int(parts[2]) + 1, "not-needed"))
        storages[t.storage_id] = (layer, max(verdict, t.verdict, key=rank.__getitem__))
    totals: dict[int, dict[str, int]] = {}
    for storage_id, (layer, verdict) in storages.items():
        entry = totals.setdefault(layer, dict.fromkeys(rank, 0))
        entry[verdict] += report.storages[storage_id].nbytes
    return dict(sorted(totals.items()))


def main() -> None:
    import gradaudit
    from gradaudit.report.units import human_bytes

    model, inputs = build()
    report = gradaudit.audit(model, inputs)
    layers = held_by_layer(report)

    def row(label: str, first: int, last: int) -> str:
        sums = {v: sum(layers.get(i, {}).get(v, 0) for i in range(first, last + 1))
                for v in ("needed", "unknown", "sign-only", "not-needed")}
        held = sum(sums.values())
        return (f"  {label:<13}{human_bytes(held):>10} held: {human_bytes(sums['needed'])} needed, "
                f"{human_bytes(sums['unknown'])} undecided, "
                f"{human_bytes(sums['sign-only'] + sums['not-needed'])} not needed in full")

    print(f"{LAYERS}-layer Llama ({sum(p.numel() for p in model.parameters()) / 1e9:.1f}B parameters), "
          f"only layer {PROBED} trainable, sequence {SEQUENCE}, meta device")
    print(row(f"layers 1-{PROBED - 1}", 1, PROBED - 1))
    print(row(f"layer {PROBED}", PROBED, PROBED))
    print(row(f"layers {PROBED + 1}-{LAYERS}", PROBED + 1, LAYERS))
    print(f"  whole model  {human_bytes(report.saved_bytes):>10} held, "
          f"{human_bytes(report.reclaimable_bytes)} reclaimable, {len(report.findings)} findings")


if __name__ == "__main__":
    main()
