"""The audit's memory timeline as a snapshot PyTorch's memory_viz page reads (https://pytorch.org/memory_viz,
the format of ``torch.cuda.memory._snapshot()``: a dict with ``segments`` and ``device_traces``), so the
prediction can be looked at in the tool users open real CUDA snapshots with, beside one.

What the audit's snapshot shows (what the audit knows; nothing in it is measured):
- forward: one allocation per storage autograd holds for backward, at its first save, in the order autograd
  saved them, of the size the report counts (the whole storage, once). Parameters, buffers and inputs (alive
  anyway) and activations autograd does not hold (freed during the forward) are not in it, so at the end of
  the forward the trace holds exactly ``report.saved_bytes``;
- backward: each storage released once the earliest-created autograd node holding it has run. Autograd runs
  a step's nodes in reverse creation order, so the storages go in the reverse order of their first saves.
  Gradients and backward's temporaries are not in it;
- the allocator's state at the snapshot, after backward: every storage freed but still cached (an inactive
  block in a segment of its own), as a caching allocator leaves it: reserved = ``report.saved_bytes``.
Addresses are made up (consecutive, 512-byte aligned); sizes are exact, not rounded as CUDA's allocator
rounds them. Each block's frames are the line that saved it (with the autograd node, the attribute and the
audit's verdict), then the module that ran it.

``from_events`` turns any sequence of allocations and frees into such a snapshot: another timeline (a
training step's, from a fit prediction) is exported through it the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from ..records import Report, SavedTensor, Storage
from .views import held_in_save_order

ALIGNMENT = 512  # CUDA's allocator hands out 512-byte aligned blocks; made-up addresses keep to that
_BASE_ADDRESS = 0x7F0000000000


@dataclass(frozen=True)
class Event:
    """One step of a timeline: ``alloc`` (``size`` bytes, made at ``frames``, innermost first) or ``free``
    of the allocation named ``key``."""

    action: str  # "alloc" or "free"
    key: int
    size: int = 0
    frames: tuple[tuple[str, int, str], ...] = ()  # (filename, line, name)


def snapshot(report: Report) -> dict[str, Any]:
    """The audit's timeline (see the module's docstring) as a memory_viz snapshot."""
    held = held_in_save_order(report)
    events = [Event("alloc", storage.id, storage.nbytes, _frames(report, save, storage)) for save, storage in held]
    events += [Event("free", storage.id) for _, storage in reversed(held)]
    return from_events(events, device=_device_index(report.device))


def fit_snapshot(fit: Any) -> dict[str, Any]:
    """A fit's whole training step as a memory_viz snapshot: every storage alive throughout (parameters,
    buffers, the batch, the optimizer's state) allocated first, then each storage the step makes, allocated
    after the op that made it and freed before the op after which it is gone (a sample's frees before its
    allocations), of the size the target's allocator counts (rounded up to 512 B for CUDA); storages alive
    when the step ends (the loss) are not freed. The trace's peak is ``fit.peak_bytes``; each block's frame
    names its category and the phase that made it."""
    from ..fitting.result import allocated

    run, target = fit.live.run, fit.target
    if run is None:
        raise ValueError("this Fit keeps no step to export (made by another version of gradaudit)")
    events, key = [], 0
    for category, sizes in run.persistent.items():
        for nbytes in sizes:
            key += 1
            events.append(Event("alloc", key, allocated(nbytes, target), ((category, 0, "alive throughout the step"),)))
    phases, start = [], 1
    for phase, count in run.phases:
        phases.append((start, start + count, phase))
        start += count

    def phase_of(sample: int) -> str:
        return next((name for first, end, name in phases if first <= sample < end), phases[-1][2])

    keys = {id(life): index for index, life in enumerate(run.lives, start=key + 1)}
    by_sample: dict[int, list[Event]] = {}
    for life in run.lives:
        if life.died is not None:
            by_sample.setdefault(2 * life.died, []).append(Event("free", keys[id(life)]))
        frames = ((life.category, life.born, f"made in the {phase_of(life.born)}"),)
        by_sample.setdefault(2 * life.born + 1, []).append(Event("alloc", keys[id(life)],
                                                                 allocated(life.nbytes, target), frames))
    for moment in sorted(by_sample):
        events.extend(by_sample[moment])
    return from_events(events)


def from_events(events: Sequence[Event], device: int = 0) -> dict[str, Any]:
    """A snapshot whose ``device_traces[device]`` is ``events`` as the allocator's trace (an ``alloc``, or a
    ``free_requested`` and ``free_completed``), and whose ``segments`` are the state after them: one segment
    per allocation, its block active while not freed, inactive (cached) once freed."""
    trace: list[dict[str, Any]] = []
    blocks: dict[int, dict[str, Any]] = {}  # key -> its block
    address = _BASE_ADDRESS
    for event in events:
        if event.action == "alloc":
            if event.key in blocks:
                raise ValueError(f"allocation {event.key} is made twice")
            frames = [{"filename": filename, "line": line, "name": name} for filename, line, name in event.frames]
            blocks[event.key] = {"address": address, "size": event.size, "requested_size": event.size,
                                 "state": "active_allocated", "frames": frames}
            trace.append({"action": "alloc", "addr": address, "size": event.size, "stream": 0, "frames": frames})
            address += -(-max(event.size, 1) // ALIGNMENT) * ALIGNMENT
        elif event.action == "free":
            block = blocks.get(event.key)
            if block is None or block["state"] != "active_allocated":
                raise ValueError(f"allocation {event.key} is freed without being allocated, or twice")
            block["state"] = "inactive"
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": block["address"], "size": block["size"], "stream": 0,
                              "frames": block["frames"]})
        else:
            raise ValueError(f"unknown timeline action {event.action!r}: alloc or free")
    segments = []
    for block in blocks.values():
        active = block["size"] if block["state"] == "active_allocated" else 0
        segments.append({"device": device, "address": block["address"], "total_size": block["size"], "stream": 0,
                         "segment_type": "large" if block["size"] > 1 << 20 else "small",
                         "segment_pool_id": (0, 0), "allocated_size": active, "active_size": active,
                         "requested_size": active, "blocks": [dict(block)]})
    return {"segments": segments, "device_traces": [[] for _ in range(device)] + [trace]}


def _frames(report: Report, save: SavedTensor, storage: Storage) -> tuple[tuple[str, int, str], ...]:
    """The line that saved ``save`` (its node, attribute and verdict), then the module that ran it."""
    filename, line = _file_and_line(save.source)
    verdict = f"{save.verdict}" + (f", {save.rule}" if save.rule else "")
    shared = f", +{len(storage.tensors) - 1} more saves of it" if len(storage.tensors) > 1 else ""
    module = save.module or "<root>"
    return ((filename, line, f"{save.node}.{save.attr} saved ({verdict}{shared})"),
            (f"module {module}", 0, save.module_class or report.model))


def _file_and_line(source: Any) -> tuple[str, int]:
    match = re.fullmatch(r"(.*):(\d+)", source or "")
    return (match.group(1), int(match.group(2))) if match else (source or "<unknown>", 0)


def _device_index(device: str) -> int:
    match = re.fullmatch(r"\w+:(\d+)", device or "")
    return int(match.group(1)) if match else 0
