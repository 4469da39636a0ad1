"""Gradient checkpointing on a BERT-style encoder: what does it remove from the memory autograd holds,
and what can it not remove?

Two factories build the same small BERT (from a config, random weights, fully trainable, train mode):
``build`` as is, ``build_checkpointed`` with ``gradient_checkpointing_enable()`` (non-reentrant).

    gradaudit scan examples/bert_checkpointing.py:build
    gradaudit scan examples/bert_checkpointing.py:build_checkpointed
    python examples/bert_checkpointing.py       # both, side by side

What the scans show: with checkpointing, the saves inside each encoder layer (attention inputs and
probabilities, GELU inputs, layer-norm statistics, dropout masks) are no longer held - they are
recomputed in backward and reported as managed by the checkpoint. What stays held is everything
outside the checkpointed blocks: the embeddings (their layer norm and dropout mask), each layer's
input hidden state (kept by the checkpoint to re-run the layer; the report shows it in the layer's
name, on a ``CheckpointInputs`` node), the pooler and the classifier. Checkpointing trades compute
for those bytes; it does not make a
wasteful save cheaper - whatever a layer saves for nothing is still saved for nothing during the
recomputation, at the peak of backward.
"""

import torch

BATCH, SEQUENCE = 4, 64


def _model(checkpointed: bool):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=128, num_labels=2,
                        use_cache=False)
    model = BertForSequenceClassification(config)
    if checkpointed:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5 name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQUENCE))
    return model, {"input_ids": input_ids, "attention_mask": torch.ones(BATCH, SEQUENCE, dtype=torch.long)}


def build():
    return _model(checkpointed=False)


def build_checkpointed():
    return _model(checkpointed=True)


PLACES = ("embeddings", "encoder layers", "pooler and classifier", "model level", "checkpoint inputs")
# where gradaudit shows what a checkpoint keeps to re-run its block (non-reentrant, reentrant)
CHECKPOINT_NODES = ("CheckpointInputs", "CheckpointFunctionBackward")


def place_of(module: str, node: str = "") -> str:
    if node in CHECKPOINT_NODES:
        return "checkpoint inputs"
    if ".embeddings" in module:
        return "embeddings"
    if ".encoder" in module:
        return "encoder layers"
    if module:
        return "pooler and classifier"
    return "model level"  # saves made outside every submodule


def held_by_place(report) -> dict[str, int]:
    """Held bytes grouped by where they were saved (each storage counted once)."""
    places = dict.fromkeys(PLACES, 0)
    seen: set[int] = set()
    for t in report.held_tensors:
        storage = report.storages[t.storage_id]
        if t.storage_id in seen or storage.kind not in ("activation", "output"):
            continue
        seen.add(t.storage_id)
        places[place_of(t.module, t.node)] += storage.nbytes
    return places


def main() -> None:
    import gradaudit
    from gradaudit.report.units import human_bytes

    reports = {name: gradaudit.audit(*factory()) for name, factory in
               (("plain", build), ("checkpointed", build_checkpointed))}
    print(f"BERT, 4 layers, hidden 128, batch {BATCH} x {SEQUENCE} tokens, train mode")
    print(f"  {'':<30}{'plain':>12}{'checkpointed':>14}")
    rows = [("held by autograd", lambda r: human_bytes(r.saved_bytes)),
            ("saves recomputed in backward",
             lambda r: str(sum(1 for t in r.tensors if t.node_id >= 0 and t.managed_by == "checkpoint")))]
    for place in PLACES:
        rows.append((f"  held: {place}", lambda r, p=place: human_bytes(held_by_place(r)[p])))
    for label, figure in rows:
        print(f"  {label:<30}" + "".join(f"{figure(r):>13} " for r in reports.values()))


if __name__ == "__main__":
    main()
