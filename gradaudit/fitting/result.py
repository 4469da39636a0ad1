"""The fit, as data: ``Fit`` (the step's peak, its breakdown by category at that moment, whether it
fits the memory given, the timeline, the remedy), built from a ``StepRun`` by ``figures``; the
target's allocator (``allocated``: what CUDA's caching allocator hands out for a request).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..tracking import Category, sweep
from .allocator import rounded
from .levers import LOSS_OPS
from .step import ACTIVATIONS, BUCKETS, CATEGORIES, GRADIENTS, INPUTS, STAGE_BUFFERS, TEMPORARIES, StepRun

if TYPE_CHECKING:
    from .remedy import Remedy

FIT_SCHEMA_VERSION = 1
TIMELINE_POINTS = 400  # the timeline keeps each stretch's worst sample, at most this many


def allocated(nbytes: int, target: str) -> int:
    """What the target's allocator takes for a storage of ``nbytes``: on CUDA the request rounded
    up to 512 bytes (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize; an empty storage asks for
    nothing); on the CPU the bytes themselves."""
    return rounded(nbytes) if target == "cuda" else nbytes


@dataclass
class Figures:
    """The peak of a step, its breakdown at that moment and the timeline (bytes by category at
    every sample, thinned to its worst moments)."""

    peak_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    timeline: list[dict[str, Any]]
    # what no change to the activations or the micro-batch removes: everything alive throughout but the
    # batch, and every gradient (all alive at once when backward ends)
    floor_bytes: int = 0
    reserved_bytes: Optional[int] = None  # on CUDA, what the caching allocator would reserve (an estimate)
    attribution: dict[str, Any] = field(default_factory=dict)  # what made the bytes at the peak (attribute)
    # what is alive at every moment of the step: parameters, buffers, inputs, optimizer state, workspaces
    steady_bytes: int = 0


LARGEST = 10  # the storages, modules and ops an attribution lists
_BLOCK = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")  # the outermost "<container>.<index>" of a module path


def block_of(module: str) -> str:
    """The outermost numbered block a module belongs to ("model.layers.3.mlp.down_proj" ->
    "model.layers.3"), or the module itself."""
    match = _BLOCK.match(module)
    return f"{match.group(1)}.{match.group(2)}" if match else module


def repeated_blocks(alive: list[Any], size: Any) -> list[dict[str, Any]]:
    """The activations alive then, per container of numbered blocks ("model.layers"): how many of its
    blocks hold any, their bytes in all and the most one block holds; largest first."""
    blocks: dict[str, dict[str, int]] = {}
    for life in alive:
        match = _BLOCK.match(life.module) if life.category == ACTIVATIONS else None
        if match:
            per = blocks.setdefault(match.group(1), {})
            per[match.group(2)] = per.get(match.group(2), 0) + size(life.nbytes)
    rows = [{"name": name, "blocks": len(per), "bytes": sum(per.values()), "largest_block": max(per.values())}
            for name, per in blocks.items()]
    return sorted(rows, key=lambda row: -row["bytes"])[:LARGEST]


def attribute(lives: list[Any], sample: int, phase_of: list[str], size: Any) -> dict[str, Any]:
    """What made the bytes the step made that are alive in ``sample`` (1-based; the peak's): the
    largest storages (bytes as ``size`` counts them, category, op, module, the user's line, the phase
    that made it), the activations summed by module and the temporaries by op and module, largest
    first, ``LARGEST`` of each."""
    alive = [life for life in lives if life.born <= sample and (life.died is None or sample < life.died)]
    alive.sort(key=lambda life: -size(life.nbytes))

    def made_in(life: Any) -> str:
        return phase_of[min(max(life.born, 1), len(phase_of)) - 1] if phase_of else ""

    largest = [{"bytes": size(life.nbytes), "category": life.category, "op": life.op, "module": life.module,
                "source": life.source, "phase": made_in(life)} for life in alive[:LARGEST]]

    def summed(category: str, key: Any) -> list[dict[str, Any]]:
        totals: dict[Any, int] = {}
        for life in alive:
            if life.category == category:
                totals[key(life)] = totals.get(key(life), 0) + size(life.nbytes)
        return [{"name": name, "bytes": nbytes} for name, nbytes in
                sorted(totals.items(), key=lambda item: -item[1])[:LARGEST]]

    return {"largest": largest,
            "activations_by_module": summed(ACTIVATIONS, lambda life: life.module),
            "activations_by_block": summed(ACTIVATIONS, lambda life: block_of(life.module)),
            "repeated_blocks": repeated_blocks(alive, size),
            # every storage of the loss's ops alive then (its log-softmax and backward's gradients of it)
            "loss_bytes": sum(size(life.nbytes) for life in alive if life.op in LOSS_OPS),
            # by op, module and phase (backward's ops by the module whose forward made their node)
            "temporaries_by_op": summed(TEMPORARIES, lambda life: f"{life.op} in {life.module or 'the model'} "
                                        f"({made_in(life)})" if life.module or life.source
                                        else f"{life.op} ({made_in(life)})")}


UNSPLIT = Category.UNSPLIT_BLOCKS  # on CUDA: what the caching allocator hands out beyond the requests (allocator.py)


def figures(run: StepRun, target: str) -> Figures:
    """The step's peak, breakdown and timeline as the target's allocator counts them (on CUDA, the
    blocks it leaves unsplit included, as ``torch.cuda.memory_allocated`` counts them)."""
    from .allocator import replay

    # DDP's gradient buckets and a pipeline stage's buffers are categories where there are some
    categories = tuple(c for c in CATEGORIES if c not in (BUCKETS, STAGE_BUFFERS) or run.persistent.get(c)
                       or any(life.category == c for life in run.lives))
    steady = {c: sum(allocated(n, target) for n in run.persistent.get(c, ())) for c in categories}
    samples = sum(count for _, count in run.phases)
    rows = sweep(run.lives, samples, categories, lambda n: allocated(n, target))
    reserved = None
    if target == "cuda":
        reserved, unsplit = replay([n for c in categories for n in run.persistent.get(c, ())], run.lives, samples)
        steady[UNSPLIT] = 0
        rows.append(unsplit)
        categories = (*categories, UNSPLIT)
    totals = [sum(steady.values()) + sum(row[i] for row in rows) for i in range(samples)]
    phase_of = []
    for phase, count in run.phases:
        phase_of += [phase] * count
    worst = max(range(samples), key=totals.__getitem__) if samples else 0

    def at(i: int) -> dict[str, int]:
        return {c: steady[c] + rows[k][i] for k, c in enumerate(categories)}

    step = max(1, -(-samples // TIMELINE_POINTS))
    timeline = []
    for start in range(0, samples, step):
        i = max(range(start, min(start + step, samples)), key=totals.__getitem__)
        timeline.append({"sample": i + 1, "phase": phase_of[i], **at(i)})
    floor = sum(steady.values()) - steady[INPUTS] + sum(allocated(life.nbytes, target) for life in run.lives
                                                        if life.category == GRADIENTS)
    attribution = attribute(run.lives, worst + 1, phase_of, lambda n: allocated(n, target)) if samples else {}
    return Figures(totals[worst] if samples else sum(steady.values()), at(worst) if samples else steady,
                   phase_of[worst] if samples else "", timeline, floor, reserved, attribution, sum(steady.values()))


@dataclass
class Live:
    """What a ``Fit`` keeps of the step beside its figures: the step's storages and their lives
    (``run``, which ``report.memory_viz`` exports) and a measurer of the step on other inputs
    (``size_search``: (a function from inputs to (peak, headroom), the inputs fitted), which
    ``Fit.largest`` scales). Either is None where the fit keeps none."""

    run: Any = None
    size_search: Optional[tuple[Any, Any]] = None


@dataclass
class Fit:
    """Will one training step fit in ``memory`` bytes on the target device, and if not, what is the
    cheapest change that makes it."""

    model: str
    device: str  # where the step ran: "cpu", "cuda", or "meta" standing for the target
    target: str  # the device type the figures are for
    optimizer: str
    memory: int  # the bytes the step may use (the device's memory, as given)
    peak_bytes: int  # the peak of one steady-state step, as the target's allocator counts it
    breakdown: dict[str, int]  # at that peak, by category (CATEGORIES)
    peak_phase: str  # "forward", "backward" or "optimizer" (with accumulation: "backward (micro-batch 2)"...)
    timeline: list[dict[str, Any]]  # bytes by category through the step (its worst moments)
    trained_parameters: int  # parameter tensors that get a gradient and optimizer state
    # on CUDA: what the caching allocator would reserve by the end of a second step (segments, cached
    # free blocks), replayed from its rules (fitting/allocator.py): an estimate; None on the CPU
    reserved_bytes: Optional[int] = None
    notes: list[str] = field(default_factory=list)
    accumulation: int = 1  # micro-batches per optimizer step (gradient accumulation), each the inputs given
    # what the device needs beside the peak, left free by fits and the remedy: the headroom given, or on
    # CUDA the caching allocator's estimated reserve beyond the peak (reserved_bytes - peak_bytes)
    headroom: int = 0
    headroom_given: bool = False
    # what made the bytes at the peak that the step made (fitting.result.attribute): the largest storages,
    # the activations by module, the temporaries by op and module
    attribution: dict[str, Any] = field(default_factory=dict)
    levers: list[Any] = field(default_factory=list)  # where it does not fit: changes named, not applied (levers.py)
    remedy: Optional["Remedy"] = None  # the cheapest change whose step fits (None: fits as it is, or nothing does)
    remedy_searched: bool = False  # whether a remedy was looked for (only when it does not fit)
    alternatives: list[Any] = field(default_factory=list)  # what users otherwise try, measured beside the remedy
    no_remedy: str = ""  # where a search found none, what it tried, in words (empty: a module's levers)
    # not the fit's data: what it keeps of the live step (the step's storages, a measurer of other sizes)
    live: Live = field(default_factory=Live, repr=False, compare=False)

    @property
    def fits(self) -> bool:
        """Whether the step's peak (the allocated bytes, see ``allocator``) and the headroom beside it
        are within ``memory``."""
        return self.peak_bytes + self.headroom <= self.memory

    @property
    def margin(self) -> int:
        """The memory left beside the peak and the headroom (negative: by how much it does not fit)."""
        return self.memory - self.peak_bytes - self.headroom

    @property
    def allocator(self) -> str:
        """What ``peak_bytes`` counts, in words."""
        if self.target == "cuda":
            return ("bytes allocated by PyTorch's CUDA caching allocator (each storage rounded up to 512 B, and "
                    "whole blocks where it leaves one unsplit, its rules replayed with the parameters allocated "
                    "one after another as loading does), as torch.cuda.max_memory_allocated reports, cuBLAS's "
                    "workspaces included; the allocator reserves "
                    "more (whole segments, cached free blocks: reserved_bytes estimates it by replaying its rules), "
                    "and the CUDA context and cuDNN's per-call convolution workspaces are not counted: give them "
                    "headroom (by default the headroom is what the allocator reserves beyond the peak), or set "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        return "bytes of the storages alive, as the CPU allocator is asked for them"

    def largest(self, dimension: str = "batch", progress: Optional[Callable[[str], None]] = None) -> int:
        """The largest batch (``"batch"``) or sequence length (``"seq"``) whose step fits ``memory``; for a
        pipeline stage, its micro-batch (``"batch"``, their count kept), their ``"seq"``, or their count
        (``"micro_batches"``), the schedule rebuilt at each (fitting/pipeline.py). ``progress``: a
        callable told each size measured (the command line shows it on stderr)."""
        from .largest import largest

        return largest(self, dimension, progress)

    def to_dict(self) -> dict[str, Any]:
        """The fit's JSON document (``gradaudit fit --json``; fields in docs/json.md)."""
        return {
            "schema_version": FIT_SCHEMA_VERSION,
            "tool": "gradaudit",
            "kind": "fit",
            "model": self.model,
            "device": self.device,
            "target": self.target,
            "optimizer": self.optimizer,
            "accumulation": self.accumulation,
            "memory": self.memory,
            "fits": self.fits,
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "reserved_bytes": self.reserved_bytes,
            "headroom": self.headroom,
            "margin": self.margin,
            "allocator": self.allocator,
            "breakdown": dict(self.breakdown),
            "attribution": self.attribution,
            "trained_parameters": self.trained_parameters,
            "remedy": self.remedy.to_dict() if self.remedy is not None else None,
            "levers": [lever.to_dict() for lever in self.levers],
            "remedy_searched": self.remedy_searched,
            "alternatives": [a.to_dict() for a in self.alternatives],
            "timeline": list(self.timeline),
            "notes": list(self.notes),
        }

    def __repr__(self) -> str:
        return (f"<gradaudit.Fit {self.model} on {self.target}: peak {self.peak_bytes} of {self.memory} bytes, "
                f"{'fits' if self.fits else 'does not fit'}>")
