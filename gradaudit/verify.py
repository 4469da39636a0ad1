"""The empirical proof behind ``audit(..., verify=True)``: does backward read a saved tensor's values?

Each autograd node created during the audited forward is called in isolation with random incoming
gradients, once as recorded and again with one saved tensor's values replaced (at unpack time, by
swapping the tensor inside gradaudit's own ``_Packed`` box). If the gradients for the edges that need
one stay bitwise identical under poisons that differ from each other at every element (NaN and
random values), backward does not read that tensor. If they stay identical under ``sign(t) *
random``, only its sign is read.

Safety (autograd-facts.md):
- only saves gradaudit packed itself are swapped; a node that also holds saves managed by
  ``torch.utils.checkpoint``, offloading or the user's hooks is never called, because calling it
  would run their unpack (a checkpoint recomputes its whole block);
- integer and bool tensors are usually indices or masks: they are only replaced by values they
  already contain (their own minimum / maximum), never by out-of-range values that would make
  native kernels write out of bounds;
- a private ``torch.Generator`` draws the poisons and gradients, so the user's RNG stream is untouched.

Cost: saves whose static verdict is "not needed" are proven together (two calls per node); the
rest one by one against a baseline call. Parameters, buffers and the caller's inputs are alive
anyway, so their saves keep the static verdict unproven (no byte figure depends on them).
"""

from __future__ import annotations

import math
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch

from .errors import GradauditError
from .recorder import Recording, _Packed, _raw_saved_slots
from .records import NEEDED, NOT_NEEDED, SIGN_ONLY, UNKNOWN, GraphNode, SavedTensor

# Storage kinds whose memory does not depend on autograd: proving their saves cannot change a byte.
FREE_KINDS = ("parameter", "buffer", "input")
SEED = 20240917

Outputs = list[Any]


def _floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


_SAME_SIZE_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.detach().contiguous().reshape(-1)
    return t.view(_SAME_SIZE_INTS.get(t.element_size(), torch.uint8))


def same_outputs(a: Outputs, b: Outputs) -> bool:
    """Bitwise equality of two backward results (NaN equals NaN, -0.0 differs from 0.0)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(_bits(x), _bits(y)):
                return False
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return False
        elif x != y:
            return False
    return True


class Poisons:
    """Replacement values for one saved tensor, each with the original's shape, dtype and strides."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def _uniform(self, t: torch.Tensor, low: float, high: float) -> torch.Tensor:
        out = torch.empty_like(t)  # keeps the original's strides (memory format)
        return out.uniform_(low, high, generator=self.generator)

    def pair(self, t: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Two poisons that differ from each other at every element (None: no safe pair exists)."""
        if _floating(t.dtype):
            return torch.empty_like(t).fill_(math.nan), self.random(t)
        return self._in_range_pair(t)

    def witness(self, t: torch.Tensor) -> torch.Tensor:
        """A cheap poison to show that backward reads a tensor: NaN propagates through any
        arithmetic and fails every comparison, so a backward that reads the values changes its
        result. (A backward it does not change still goes through the two-poison test.)"""
        if t.dtype.is_floating_point or t.dtype.is_complex:
            return torch.empty_like(t).fill_(math.nan)
        return self.random(t)

    def random(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point:
            return self._uniform(t, -3.0, 3.0)
        if t.dtype.is_complex:
            return torch.randn(t.shape, generator=self.generator, dtype=t.dtype, device=t.device)
        pair = self._in_range_pair(t)
        return pair[0] if pair else t

    def _in_range_pair(self, t: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        # Integers are indices, offsets or sizes: only values the tensor already holds are safe.
        # A constant tensor keeps the array sorted (offsets stay monotone) and in range.
        if t.numel() == 0:
            return None
        if t.dtype == torch.bool:
            return torch.zeros_like(t), torch.ones_like(t)
        low, high = t.min(), t.max()
        if bool(low == high):
            if bool(low == 0):
                return None
            low = torch.zeros_like(low)  # index 0 is valid wherever any index is
        return torch.full_like(t, low.item()), torch.full_like(t, high.item())

    def signs(self, t: torch.Tensor) -> list[torch.Tensor]:
        """A poison keeping each element's sign, with magnitudes spread over 2**-8 .. 2**8."""
        magnitude = self._uniform(t, -8.0, 8.0).exp2_()
        return [magnitude.mul_(torch.sign(t.detach()))]


class NodeCall:
    """One autograd node called on its own with fixed random incoming gradients."""

    def __init__(self, node: Any, consumed: set[int], generator: torch.Generator) -> None:
        self.node = node
        self.custom = isinstance(node, torch.autograd.function.BackwardCFunction)
        grads: list[Optional[torch.Tensor]] = []
        for i, meta in enumerate(node._input_metadata):
            if i not in consumed or not _floating(meta.dtype) or meta.is_nested_tensor:
                grads.append(None)  # nothing downstream sends a gradient for this output
                continue
            if meta.dtype.is_complex:
                grads.append(torch.randn(tuple(meta.shape), generator=generator, dtype=meta.dtype,
                                         device=meta.device))
                continue
            grads.append(torch.empty(tuple(meta.shape), dtype=meta.dtype, device=meta.device)
                         .uniform_(-2.0, 2.0, generator=generator))
        self.grads = grads
        if self.custom:
            self.wanted = [i for i, need in enumerate(node.needs_input_grad) if need]
        else:
            self.wanted = [i for i, (fn, _) in enumerate(node.next_functions) if fn is not None]
        self._baseline: Optional[Outputs] = None

    def __call__(self) -> Outputs:
        with torch.no_grad():
            if self.custom:
                # a user's backward may modify its incoming gradient in place: give it copies
                out = self.node.apply(*[g.clone() if g is not None else None for g in self.grads])
            else:
                out = self.node(*self.grads)
        if not isinstance(out, (tuple, list)):
            out = (out,)
        return [out[i] if i < len(out) else None for i in self.wanted]

    def baseline(self) -> Outputs:
        if self._baseline is None:
            self._baseline = self()
        return self._baseline

    def changed_by(self, replacements: Sequence[tuple[_Packed, torch.Tensor]]) -> bool:
        """Does backward's result differ from the baseline with these values swapped in?"""
        return not same_outputs(self.baseline(), self.under(replacements))

    def under(self, replacements: Sequence[tuple[_Packed, torch.Tensor]]) -> Outputs:
        with swapped(replacements):
            try:
                return self()
            except Exception as error:  # the backward inspected the values and rejected them
                return [_Raised(error)]


class _Raised:
    """A backward that raised: equal to nothing, so it always counts as "changed"."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]


@contextmanager
def swapped(replacements: Sequence[tuple[_Packed, torch.Tensor]]) -> Iterator[None]:
    """Temporarily make gradaudit's boxes return other values when backward unpacks them."""
    originals = [(box, box.tensor) for box, _ in replacements]
    try:
        for box, value in replacements:
            box.tensor = value
        yield
    finally:
        for box, value in originals:
            box.tensor = value


def _consumed_outputs(recording: Recording) -> dict[int, set[int]]:
    """id(node) -> output numbers some other recorded node (or a model output) sends a gradient to."""
    consumed: dict[int, set[int]] = defaultdict(set)
    for live in recording.nodes:
        if live.node is None:
            continue
        for fn, nr in live.node.next_functions:
            if fn is not None:
                consumed[id(fn)].add(nr)
    for t in recording.outputs:
        if t.grad_fn is not None:
            consumed[id(t.grad_fn)].add(t.output_nr)
    return consumed


def _boxes_of(node: Any) -> Optional[dict[int, _Packed]]:
    """Our boxes by record index; None when the node also holds saves someone else packed."""
    boxes: dict[int, _Packed] = {}
    for _, raw in _raw_saved_slots(node):
        packed = raw.data
        if isinstance(packed, _Packed):
            boxes[packed.index] = packed
        elif packed is not None and not isinstance(packed, torch.Tensor):
            return None
    return boxes


def _two_valued(t: torch.Tensor) -> bool:
    values = torch.unique(t.detach())
    return values.numel() <= 1 or (values.numel() == 2 and bool((values == 0).any()))


def _sign_classes(t: torch.Tensor) -> int:
    t = t.detach()
    return int((t > 0).any()) + int((t < 0).any()) + int((t == 0).any())


class Prover:
    """Runs the proof over one recording and rewrites the verdicts it settles."""

    def __init__(self, recording: Recording, nodes: list[GraphNode], tensors: list[SavedTensor],
                 live_tensors: list[Optional[torch.Tensor]]) -> None:
        self.recording = recording
        self.nodes = nodes
        self.tensors = tensors
        self.live_tensors = live_tensors
        self.notes: list[str] = []
        self.generators: dict[torch.device, torch.Generator] = {}
        self.consumed = _consumed_outputs(recording)

    def generator(self, device: torch.device) -> torch.Generator:
        g = self.generators.get(device)
        if g is None:
            g = self.generators[device] = torch.Generator(device=device)
            g.manual_seed(SEED)
        return g

    def run(self) -> list[str]:
        by_node: dict[int, list[int]] = defaultdict(list)
        for j, t in enumerate(self.tensors):
            if t.node_id >= 0 and t.managed_by == "autograd" and self.live_tensors[j] is not None:
                if self.live_tensors[j].device.type == "meta":
                    raise GradauditError("verify=True needs real values; it cannot run on the meta device")
                by_node[t.node_id].append(j)
        for node_id, indices in by_node.items():
            self.prove_node(node_id, indices)
        return self.notes

    # ------------------------------------------------------------------------------------------
    def prove_node(self, node_id: int, indices: list[int]) -> None:
        live = self.recording.nodes[node_id]
        if live.node is None or not live.created_here:
            return self._unproven(indices, "its node cannot be called on its own")
        boxes = _boxes_of(live.node)
        if boxes is None:
            return self._unproven(indices, "its node also holds saves managed by checkpoint or hooks")
        subjects = []
        for j in indices:
            t = self.tensors[j]
            if t.storage_kind in FREE_KINDS:
                continue  # alive anyway; see the module docstring
            box = boxes.get(t.source_index)
            if box is None or box.tensor is not self.live_tensors[j]:
                self._unproven([j], "gradaudit did not pack it")
                continue
            subjects.append((j, box))
        if not subjects:
            return
        device = self.live_tensors[subjects[0][0]].device
        poisons = Poisons(self.generator(device))
        call = NodeCall(live.node, self.consumed.get(id(live.node), set()), self.generator(device))
        candidates = [(j, box) for j, box in subjects if self.tensors[j].verdict == NOT_NEEDED]
        others = [(j, box) for j, box in subjects if self.tensors[j].verdict != NOT_NEEDED]
        if candidates and self._unread(call, poisons, candidates):
            for j, _ in candidates:
                self._settle(j, NOT_NEEDED)
        else:
            others = candidates + others  # at least one is read: settle each on its own
        if not others:
            return
        try:
            call.baseline()
        except Exception as error:
            return self._unproven([j for j, _ in others],
                                  f"its backward raised {type(error).__name__} when called on its own")
        for j, box in others:
            self._prove_one(call, poisons, j, box)

    def _unread(self, call: NodeCall, poisons: Poisons, subjects: list[tuple[int, _Packed]]) -> bool:
        """True when backward's result does not depend on any of these saves' values."""
        first, second = [], []
        for j, box in subjects:
            pair = poisons.pair(self.live_tensors[j])
            if pair is None:
                return False
            first.append((box, pair[0]))
            second.append((box, pair[1]))
        # Two poisons unequal at every element giving bitwise-equal gradients: the values are
        # not read, so the recorded values give those gradients too (no baseline call needed).
        return same_outputs(call.under(first), call.under(second))

    def _prove_one(self, call: NodeCall, poisons: Poisons, j: int, box: _Packed) -> None:
        t, value = self.tensors[j], self.live_tensors[j]
        if not call.changed_by([(box, poisons.witness(value))]):
            if self._unread(call, poisons, [(j, box)]):
                return self._settle(j, NOT_NEEDED)
        if t.verdict in (SIGN_ONLY, UNKNOWN) and value.dtype.is_floating_point:
            if not any(call.changed_by([(box, p)]) for p in poisons.signs(value)):
                self._settle(j, SIGN_ONLY, bitpackable=_sign_classes(value) <= 2)
                return
        self._settle(j, NEEDED)
        if t.bitpackable and t.verdict == NEEDED and not _two_valued(value):
            t.bitpackable = False
            self._note(t, "was said to hold only two values (0 and one constant), but it does not")

    # ------------------------------------------------------------------------------------------
    def _settle(self, j: int, verdict: str, bitpackable: Optional[bool] = None) -> None:
        t = self.tensors[j]
        static = t.verdict
        t.proven = True
        if verdict == static:
            if bitpackable is not None:
                t.bitpackable = t.bitpackable and bitpackable
            return
        wrong = (static == NOT_NEEDED) or (static == SIGN_ONLY and verdict == NEEDED)
        if wrong:
            self._note(t, f"was judged {static} by op knowledge, but backward reads its values")
        t.verdict = verdict
        t.bitpackable = bool(bitpackable) if verdict == SIGN_ONLY else (t.bitpackable and verdict == NEEDED)
        t.reason = {
            NOT_NEEDED: "proven: the gradients are bitwise unchanged when its values are replaced",
            SIGN_ONLY: "proven: the gradients depend only on its sign pattern",
            NEEDED: "proven: replacing its values changes the gradients",
        }[verdict]

    def _note(self, t: SavedTensor, what: str) -> None:
        self.notes.append(f"rule bug: {t.node}.{t.attr} in {t.module or 'the model'} {what}; "
                          f"the proof's verdict is used (please report this)")

    def _unproven(self, indices: Sequence[int], why: str) -> None:
        for j in indices:
            t = self.tensors[j]
            if "unknown-proof" not in t.reason:
                t.reason = f"{t.reason}; unknown-proof: {why}" if t.reason else f"unknown-proof: {why}"


def prove(*, recording: Recording, nodes: list[GraphNode], tensors: list[SavedTensor],
          live_tensors: list[Optional[torch.Tensor]]) -> list[str]:
    """Prove or correct every held save's verdict in place; returns notes for the report."""
    return Prover(recording, nodes, tensors, live_tensors).run()
