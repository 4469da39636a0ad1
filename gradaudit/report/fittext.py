"""The fit for the terminal: the step's peak against the memory, its breakdown at that moment, the
remedy beside what users otherwise try, and the notes. A pure function of a ``Fit``; the CLI prints it.
"""

from __future__ import annotations

from typing import Any

from .units import human_bytes, path_ranges

_LABELS = {"parameters": "parameters", "buffers": "buffers", "inputs": "inputs (the batch)",
           "optimizer_state": "optimizer state", "workspaces": "cuBLAS workspaces",
           "gradient_buckets": "DDP's gradient buckets", "pipeline_buffers": "pipeline receive buffers",
           "gradients": "gradients",
           "activations": "activations held for backward", "temporaries": "temporaries",
           "unsplit_blocks": "allocator blocks left unsplit"}


def render(fit: Any, *, quiet: bool = False) -> str:
    where = f"{fit.target} (on meta)" if fit.device == "meta" else fit.target
    micro = f" ({fit.accumulation} micro-batches accumulated)" if fit.accumulation > 1 else ""
    lines = [f"gradaudit fit: {fit.model}, one training step{micro} on {where} with {fit.optimizer}, "
             f"{human_bytes(fit.memory)} of memory"]
    verdict = (f"fits, {human_bytes(fit.margin)} to spare" if fit.fits else
               f"does not fit by {human_bytes(-fit.margin)}")
    headroom = ""
    if fit.headroom_given:
        headroom = f", and {human_bytes(fit.headroom)} of headroom beside it (as given)"
    elif fit.headroom:
        headroom = (f", and {human_bytes(fit.headroom)} of headroom beside it (what the CUDA caching allocator "
                    f"would reserve beyond the peak)")
    lines.append(f"peak {human_bytes(fit.peak_bytes)} ({fit.peak_bytes} bytes) in the {fit.peak_phase}{headroom}: "
                 f"{verdict}")
    if fit.reserved_bytes is not None:
        by_default = "" if fit.headroom_given else "; the headroom is what it adds to the peak"
        lines.append(f"the CUDA caching allocator would reserve about {human_bytes(fit.reserved_bytes)} "
                     f"(an estimate: its rules replayed over two steps{by_default})")
    if quiet:  # one line: the verdict, and what the other lines would add, in short
        with_headroom = f" with {human_bytes(fit.headroom)} of headroom" if fit.headroom else ""
        line = (f"gradaudit fit: {fit.model}: peak {human_bytes(fit.peak_bytes)} in the {fit.peak_phase} of "
                f"{human_bytes(fit.memory)}{with_headroom}: {verdict}")
        if fit.reserved_bytes is not None:
            line += f"; about {human_bytes(fit.reserved_bytes)} reserved"
        if fit.remedy is not None:
            line += (f"; remedy: {fit.remedy.describe()}, peak {human_bytes(fit.remedy.peak_bytes)}, "
                     f"+{100 * fit.remedy.extra_compute:.1f}% compute")
        elif fit.remedy_searched:
            line += "; no remedy"
        return line
    lines.append("at that peak:")
    for category, nbytes in fit.breakdown.items():
        lines.append(f"  {_LABELS.get(category, category):<30} {human_bytes(nbytes):>10}")
    lines += _attribution(fit.attribution)
    if fit.remedy is not None:
        remedy = fit.remedy
        beside = f" and {human_bytes(remedy.headroom)} of headroom" if remedy.headroom else ""
        lines.append(f"remedy: {remedy.describe()}: peak {human_bytes(remedy.peak_bytes)}{beside}, "
                     f"{human_bytes(fit.memory - remedy.peak_bytes - remedy.headroom)} to spare, "
                     f"+{100 * remedy.extra_compute:.1f}% compute (FLOPs recomputed per step)")
        if remedy.loop_change():
            lines.append(f"  in the training loop: {remedy.loop_change()}")
        if remedy.checkpointed:
            lines.append(f"  checkpoint {path_ranges(remedy.checkpointed)}")
            if remedy.selective:
                lines.append(f"  of which op by op: {path_ranges(remedy.selective)}")
        if remedy.plan is not None:
            lines.append("  apply it in Python: fit = gradaudit.fit(model, inputs, memory=...); "
                         "fit.remedy.apply(model)")
    elif fit.remedy_searched:
        lines.append(fit.no_remedy or "no remedy: neither smaller micro-batches, trim nor any checkpoint plan of the "
                     "repeated blocks brings the step within memory")
    for alternative in fit.alternatives:
        extra = f", +{100 * alternative.extra_compute:.1f}% compute" if alternative.extra_compute is not None else ""
        lines.append(f"beside it, {alternative.name}: peak {human_bytes(alternative.peak_bytes)}{extra} "
                     f"({'fits' if alternative.fits else 'does not fit'})")
    if fit.levers:
        lines.append("other levers, named but not applied or measured by gradaudit:")
        for lever in fit.levers:
            lines.append(f"  {lever.name}: about {human_bytes(lever.saves_bytes)} less at that peak ({lever.how}; "
                         f"assumes {lever.assumes})")
    lines.append(f"counted: {fit.allocator}")
    lines += [f"note: {note}" for note in fit.notes]
    return "\n".join(lines)


SHOWN = 5  # rows of each attribution list in the terminal (the JSON and HTML have more)


def _attribution(attribution: dict[str, Any]) -> list[str]:
    """The largest storages the step made alive at the peak, and the activations by module."""
    lines = []
    largest = attribution.get("largest") or []
    if largest:
        lines.append("largest storages the step made, alive at that peak:")
        for row in largest[:SHOWN]:
            lines.append(f"  {human_bytes(row['bytes']):>10}  {made_by(row)}")
    for row in (attribution.get("repeated_blocks") or [])[:SHOWN]:
        if row["blocks"] > 1:
            lines.append(f"activations in {row['name']}: {human_bytes(row['bytes'])} in {row['blocks']} blocks, "
                         f"at most {human_bytes(row['largest_block'])} in one")
    modules = attribution.get("activations_by_module") or []
    if modules:
        lines.append("activations held at that peak, by module:")
        for row in modules[:SHOWN]:
            lines.append(f"  {human_bytes(row['bytes']):>10}  {row['name'] or 'the model (outside its submodules)'}")
    return lines


def made_by(row: dict[str, Any]) -> str:
    """One storage of an attribution, in words: its category, the op that made it, where and when."""
    where = f" in {row['module']}" if row["module"] else ""
    line = f" ({row['source']})" if row["source"] else ""
    return f"{_LABELS.get(row['category'], row['category'])}: {row['op']}{where}{line}, {row['phase']}"
