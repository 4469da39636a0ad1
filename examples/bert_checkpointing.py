"""Gradient checkpointing on a BERT-style encoder: what does it remove from the memory autograd holds,
and what can it not remove?

Two factories build the same small BERT (from a config, random weights, fully trainable, train mode):
``build`` as is, ``build_checkpointed`` with ``gradient_checkpointing_enable()`` (non-reentrant).

    gradaudit scan examples/bert_checkpointing.py:build
    gradaudit scan examples/bert_checkpointing.py:build_checkpointed
    gradaudit plan examples/bert_checkpointing.py:build --budget 1MiB
    python examples/bert_checkpointing.py       # both, side by side, and gradaudit.plan at the same memory

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
    # at the flag's memory the plan can only be the flag; at half the plain figure it recomputes less
    compare_with_a_plan(reports["checkpointed"].saved_bytes, "the flag's")
    compare_with_a_plan(reports["plain"].saved_bytes // 2, "half the plain")


def compare_with_a_plan(budget: int, label: str, runs: int = 5) -> None:
    """gradaudit.plan for the memory Hugging Face's every-layer flag reaches: which layers, at what
    extra compute, and one training step of each measured on this CPU (peak bytes through forward and
    backward by the storage tracker, time as the median of interleaved runs)."""
    import contextlib
    import statistics
    import time

    import gradaudit
    from gradaudit.measure import forward_backward
    from gradaudit.report.units import human_bytes

    plain, inputs = build()
    flagged, _ = build_checkpointed()
    plan = gradaudit.plan(plain, inputs, budget)
    every = next(b for b in plan.baselines if b.name == "every block")
    op_level = f" (op by op: {', '.join(plan.selective)})" if plan.selective else ""
    print(f"\ngradaudit.plan at {label} {human_bytes(budget)}: checkpoint {', '.join(plan.checkpointed) or 'nothing'}"
          f"{op_level}")
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {"plan": [], "flag": []}
    peaks = {}
    with plan.apply(plain):
        peaks["plan"] = forward_backward(plain, (), inputs)[1]
    peaks["flag"] = forward_backward(flagged, (), inputs)[1]
    for _ in range(runs):
        for name, model in (("plan", plain), ("flag", flagged)):
            with plan.apply(model) if name == "plan" else contextlib.nullcontext():
                start = time.perf_counter()
                model(**inputs).logits.float().sum().backward()
                times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    print(f"  {'':<30}{'plan':>12}{'every layer':>14}")
    print(f"  {'held after the forward':<30}{human_bytes(plan.held_bytes):>12}{human_bytes(every.held_bytes):>14}")
    print(f"  {'peak, forward + backward':<30}{human_bytes(peaks['plan']):>12}{human_bytes(peaks['flag']):>14}")
    print(f"  {'extra compute (FLOPs)':<30}{100 * plan.extra_compute:>11.1f}%"
          f"{100 * every.extra_flops / plan.step_flops:>13.1f}%")
    print(f"  {'CPU step, median of ' + str(runs):<30}{1e3 * statistics.median(times['plan']):>9.0f} ms"
          f"{1e3 * statistics.median(times['flag']):>11.0f} ms")


if __name__ == "__main__":
    main()
