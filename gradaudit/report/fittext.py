"""The fit for the terminal: the step's peak against the memory, its breakdown at that moment, the
remedy beside what users otherwise try, and the notes. A pure function of a ``Fit``; the CLI prints it.
"""

from __future__ import annotations

from typing import Any

from .units import human_bytes, path_ranges

_LABELS = {"parameters": "parameters", "buffers": "buffers", "inputs": "inputs (the batch)",
           "optimizer_state": "optimizer state", "workspaces": "cuBLAS workspaces", "gradients": "gradients",
           "activations": "activations held for backward", "temporaries": "temporaries"}


def render(fit: Any, *, quiet: bool = False) -> str:
    where = f"{fit.target} (on meta)" if fit.device == "meta" else fit.target
    lines = [f"gradaudit fit: {fit.model}, one training step on {where} with {fit.optimizer}, "
             f"{human_bytes(fit.memory)} of memory"]
    verdict = "fits" if fit.fits else "does not fit"
    lines.append(f"peak {human_bytes(fit.peak_bytes)} ({fit.peak_bytes} bytes) in the {fit.peak_phase}: {verdict}"
                 + (f", {human_bytes(fit.memory - fit.peak_bytes)} to spare" if fit.fits else
                    f" by {human_bytes(fit.peak_bytes - fit.memory)}"))
    if fit.reserved_bytes is not None:
        lines.append(f"the CUDA caching allocator would reserve about {human_bytes(fit.reserved_bytes)} "
                     f"(an estimate: its rules replayed over two steps; fits compares the allocated peak)")
    if quiet:  # one line: the verdict, and what the other lines would add, in short
        line = (f"gradaudit fit: {fit.model}: peak {human_bytes(fit.peak_bytes)} in the {fit.peak_phase} of "
                f"{human_bytes(fit.memory)}: {verdict}" + (f", {human_bytes(fit.memory - fit.peak_bytes)} to spare"
                                                          if fit.fits else f" by {human_bytes(fit.peak_bytes - fit.memory)}"))
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
    if fit.remedy is not None:
        remedy = fit.remedy
        lines.append(f"remedy: {remedy.describe()}: peak {human_bytes(remedy.peak_bytes)}, "
                     f"+{100 * remedy.extra_compute:.1f}% compute (FLOPs recomputed per step)")
        if remedy.checkpointed:
            lines.append(f"  checkpoint {path_ranges(remedy.checkpointed)}")
            if remedy.plan.selective:
                lines.append(f"  of which op by op: {path_ranges(remedy.plan.selective)}")
        lines.append("  apply it in Python: fit = gradaudit.fit(model, inputs, memory=...); "
                     "fit.remedy.apply(model)")
    elif fit.remedy_searched:
        lines.append("no remedy: neither trim nor any checkpoint plan of the repeated blocks brings the step "
                     "within memory")
    for alternative in fit.alternatives:
        extra = f", +{100 * alternative.extra_compute:.1f}% compute" if alternative.extra_compute is not None else ""
        lines.append(f"beside it, {alternative.name}: peak {human_bytes(alternative.peak_bytes)}{extra} "
                     f"({'fits' if alternative.fits else 'does not fit'})")
    lines.append(f"counted: {fit.allocator}")
    lines += [f"note: {note}" for note in fit.notes]
    return "\n".join(lines)
