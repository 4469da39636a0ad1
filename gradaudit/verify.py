"""The empirical proof behind ``audit(..., verify=True)``: does backward read a saved tensor's values?

Each autograd node created during the audited forward is called in isolation with random incoming
gradients, once as recorded and again with one saved tensor's values replaced (at unpack time, by
swapping the tensor inside gradaudit's own ``Packed`` box). If the gradients for the edges that need
one stay bitwise identical under poisons that differ from each other at every element (NaN and
random values), backward does not read that tensor. If they stay identical under ``sign(t) *
random``, only its sign is read.

Safety (autograd-facts.md):
- only saves gradaudit packed itself are swapped; a node that also holds saves managed by
  ``torch.utils.checkpoint``, offloading or the user's hooks is never called, because calling it
  would run their unpack (a checkpoint recomputes its whole block); nor is a reentrant
  checkpoint's node (CheckpointFunctionBackward), whose backward reruns the block;
- integer and bool tensors are usually indices or masks: they are only replaced by values they
  already contain (their own minimum / maximum), never by out-of-range values that would make
  native kernels write out of bounds;
- a private ``torch.Generator`` draws the poisons and gradients, so the user's RNG stream is untouched.

Cost: saves whose static verdict is "not needed" are proven together (two calls per node); the
rest one by one against a baseline call. A save op knowledge says one gradient reads (a conv's
input, read by its weight gradient) is proven "needed" by computing that gradient alone, with and
without a witness (``only_edges``): half a conv backward per call. Poisons and gradients are views
of buffers filled once (``Pools``). Parameters, buffers and the caller's inputs are alive anyway,
so their saves keep the static verdict unproven (no byte figure depends on them).
"""

from __future__ import annotations

import math
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge

from .errors import GradauditError
from .recorder import CHECKPOINT_INPUTS, Packed, Recording
from .tensors import storage_span
from .knowledge import declaration
from .records import FREE_KINDS, NEEDED, NOT_NEEDED, SIGN_ONLY, UNKNOWN, Disagreement, GraphNode, SavedTensor
from .torchapi.autograd import input_metadata, is_custom_function, raw_saved_slots
from .torchapi.checkpoint import REENTRANT_CHECKPOINT_NODE
from .torchapi.compiler import COMPILED_NODE, donated_saves
from .torchapi.storages import version_counter

# Storage kinds whose memory does not depend on autograd: proving their saves cannot change a byte.
SEED = 20240917

Outputs = list[Any]

NOT_REPEATABLE = ("its backward gives different results when called twice on the same values "
                  "(a nondeterministic kernel): a change proves no read; "
                  "torch.use_deterministic_algorithms(True) around the audit lets the proof settle it")


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


class _PoolsTouched(Exception):
    """A backward wrote into a poison or gradient it was given (see Pools)."""


class Pools:
    """Shared, filled-once buffers that poisons and incoming gradients are views of.

    Drawing random numbers cost about as much as the backward calls themselves (a third of
    verify=True on ResNet-50): each kind of value is drawn once per dtype and device, at the size
    of the largest tensor seen (grown by doubling), and handed out as strided views. Backward
    formulas only read them; a call that writes into one (in place, bumping a version counter) is
    detected and its node is proven again with private copies (``fresh``).
    """

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []  # outgrown while proving the current node

    def begin(self) -> None:
        """A new node: views of outgrown buffers handed to earlier nodes are no longer called."""
        self.retired.clear()

    def get(self, kind: str, dtype: torch.dtype, device: torch.device, size: int) -> torch.Tensor:
        buffer = self.buffers.get((kind, dtype))
        if buffer is None or buffer.numel() < size:
            grown = max(size, 2 * buffer.numel() if buffer is not None else 0, 1)
            if buffer is not None:
                self.retired.append(buffer)  # this node may still hold views of it
            buffer = self.buffers[(kind, dtype)] = self._filled(kind, dtype, device, grown)
        return buffer

    def _filled(self, kind: str, dtype: torch.dtype, device: torch.device, size: int) -> torch.Tensor:
        out = torch.empty(size, dtype=dtype, device=device)
        if kind == "nan":
            return out.fill_(math.nan)
        if dtype.is_complex:
            return out.normal_(generator=self.generator)
        low, high = {"random": (-3.0, 3.0), "grad": (-2.0, 2.0), "magnitude": (-8.0, 8.0)}[kind]
        out.uniform_(low, high, generator=self.generator)
        return out.exp2_() if kind == "magnitude" else out

    def like(self, kind: str, t: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """A view with ``t``'s shape and strides (memory format), ``offset`` elements into the pool."""
        buffer = self.get(kind, t.dtype, t.device, storage_span(t.shape, t.stride()) + offset)
        return buffer.as_strided(t.shape, t.stride(), offset)

    def shaped(self, kind: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
               offset: int = 0) -> torch.Tensor:
        numel = math.prod(shape)
        return self.get(kind, dtype, device, numel + offset)[offset:offset + numel].view(tuple(shape))

    def versions(self) -> list[tuple[torch.Tensor, int]]:
        return [(b, version_counter(b)) for b in [*self.buffers.values(), *self.retired]]

    def check(self, before: list[tuple[torch.Tensor, int]]) -> None:
        """Raise when a call wrote into any buffer (views share their base's version counter)."""
        if any(version_counter(b) != version for b, version in before):
            self.buffers.clear()
            self.retired.clear()
            raise _PoolsTouched()


class Poisons:
    """Replacement values for one saved tensor, each with the original's shape, dtype and strides.

    ``offset`` shifts where in the pools a poison starts, so two tensors poisoned in the same call
    do not receive the same values. ``fresh``: private copies (for backwards that may write into
    what they are given).
    """

    def __init__(self, pools: Pools, fresh: bool = False) -> None:
        self.pools = pools
        self.fresh = fresh

    def _view(self, kind: str, t: torch.Tensor, offset: int) -> torch.Tensor:
        view = self.pools.like(kind, t, offset)  # strided tensors only (see Prover.prove_node)
        return view.clone() if self.fresh else view

    def pair(self, t: torch.Tensor, offset: int = 0) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Two poisons that differ from each other at every element (None: no safe pair exists)."""
        if _floating(t.dtype):
            return self._view("nan", t, offset), self._view("random", t, offset)
        return self._in_range_pair(t)

    def witness(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """A cheap poison to show that backward reads a tensor: NaN propagates through any
        arithmetic and fails every comparison, so a backward that reads the values changes its
        result. (A backward it does not change still goes through the two-poison test.)
        None: no safe value differs from the tensor's own (an all-zero or empty integer tensor)."""
        if _floating(t.dtype):
            return self._view("nan", t, 0)
        pair = self._in_range_pair(t)
        return pair[0] if pair else None

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
        return [torch.sign(t.detach()).mul_(self.pools.like("magnitude", t))]


class NodeCall:
    """One autograd node called on its own with fixed random incoming gradients."""

    def __init__(self, node: Any, consumed: set[int], pools: Pools, fresh: bool = False,
                 narrowing: Optional["Narrowing"] = None, protect: Sequence[Packed] = ()) -> None:
        self.node = node
        # saves whose memory the backward may write into without a version bump (a compiled
        # region's donated buffers): every call gets its own copies of them
        self.protect = protect
        self.narrowing = narrowing if narrowing is not None else Narrowing()
        self.custom = is_custom_function(node)
        self.pools = pools
        # a user's backward may modify its incoming gradient in place: it gets copies, as does
        # any node once it was seen writing into the shared pools
        self.copies = fresh or self.custom
        grads: list[Optional[torch.Tensor]] = []
        for i, meta in enumerate(input_metadata(node)):
            if i not in consumed or not _floating(meta.dtype) or meta.is_nested_tensor:
                grads.append(None)  # nothing downstream sends a gradient for this output
                continue
            # each output's gradient starts elsewhere in the pool: outputs get different values
            grads.append(pools.shaped("grad", tuple(meta.shape), meta.dtype, meta.device, offset=i))
        self.grads = grads
        if self.custom:
            self.wanted = [i for i, need in enumerate(node.needs_input_grad) if need]
        else:
            self.wanted = [i for i, (fn, _) in enumerate(node.next_functions) if fn is not None]
        self._baselines: dict[Optional[tuple[int, ...]], Outputs] = {}
        self._repeats: dict[Optional[tuple[int, ...]], bool] = {}

    def __call__(self, edges: Optional[tuple[int, ...]] = None) -> Outputs:
        """The gradients for the wanted edges (``edges``: only those, computed alone if the
        backward lets its graph task choose; see ``only_edges``)."""
        grads = [g.clone() if g is not None else None for g in self.grads] if self.copies else self.grads
        before = self.pools.versions()

        def call() -> Any:
            copies = [(box, box.tensor.clone()) for box in self.protect if box.tensor is not None]
            with torch.no_grad(), swapped(copies):
                return self.node.apply(*grads) if self.custom else self.node(*grads)

        if edges is None:
            out = call()
        else:
            try:
                out = only_edges(self.node, edges, call)
            except NarrowingUnavailable:  # the machinery failed on this torch: call plainly from now on
                self.narrowing.works = False
                out = call()
        self.pools.check(before)
        if not isinstance(out, (tuple, list)):
            out = (out,)
        return [out[i] if i < len(out) else None for i in (self.wanted if edges is None else edges)]

    def narrowable(self, edges: Optional[tuple[int, ...]]) -> Optional[tuple[int, ...]]:
        """``edges`` when computing only them skips work: a strict subset of the wanted edges of
        a built-in node (custom Functions compute what ``needs_input_grad`` says)."""
        if (edges is None or self.custom or not self.narrowing.works or not set(edges) < set(self.wanted)):
            return None
        return edges

    def baseline(self, edges: Optional[tuple[int, ...]] = None) -> Outputs:
        if edges not in self._baselines:
            self._baselines[edges] = self(edges)
        return self._baselines[edges]

    def repeatable(self, edges: Optional[tuple[int, ...]] = None) -> bool:
        """Whether a second call with the recorded values gives the baseline's result bit for bit.
        Not where a kernel is nondeterministic (atomic adds on a GPU): there a change under a
        poison proves nothing, and "read" would be a guess."""
        if edges not in self._repeats:
            self._repeats[edges] = same_outputs(self.baseline(edges), self(edges))
        return self._repeats[edges]

    def changed_by(self, replacements: Sequence[tuple[Packed, torch.Tensor]],
                   edges: Optional[tuple[int, ...]] = None) -> bool:
        """Does backward's result differ from the baseline with these values swapped in?
        With ``edges``, only those gradients are compared: "changed" is then still a proof,
        "unchanged" is not (another gradient may read the values)."""
        return not same_outputs(self.baseline(edges), self.under(replacements, edges))

    def under(self, replacements: Sequence[tuple[Packed, torch.Tensor]],
              edges: Optional[tuple[int, ...]] = None) -> Outputs:
        with swapped(replacements):
            try:
                return self(edges)
            except _PoolsTouched:
                raise
            except Exception as error:  # the backward inspected the values and rejected them
                return [_Raised(error)]


@contextmanager
def deterministic_cudnn() -> Iterator[None]:
    """cuDNN's deterministic algorithms while the proof calls nodes (its default ones for a
    convolution's weight gradient add with atomics, so two calls on the same values differ in the
    last bits, and every save would look read), the user's setting restored after."""
    before = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic = before


class Narrowing:
    """Whether ``only_edges`` works with the installed torch: one per proof, switched off at its
    first failure (``works`` as a class attribute is the default a test may change)."""

    works = True


class NarrowingUnavailable(Exception):
    """``only_edges`` could not arrange a graph task on this torch (the pre-hook never ran)."""


def only_edges(node: Any, edges: tuple[int, ...], call: Callable[[], Any]) -> Any:
    """Run ``call`` (which calls ``node`` directly) while autograd believes that only the
    gradients for ``node``'s ``edges`` are wanted.

    A built-in backward computes gradient i only if ``task_should_compute_output(i)``: with no
    graph task running, whenever edge i exists; inside one, only if the function behind edge i is
    in that task's execution plan. So ``call`` runs in a pre-hook of a throwaway one-node graph
    whose ``torch.autograd.grad`` also names the functions behind ``edges`` as inputs: they are in
    the plan (as captures, never reached, so neither they nor their hooks run) and no other
    function is. A conv with a trainable weight then computes its weight gradient alone, half
    the work. Nothing of the audited graph runs but ``node``, called directly (no hooks).
    """
    outcome: list[tuple[bool, Any]] = []

    def prehook(grad_outputs: Any) -> None:
        try:
            outcome.append((True, call()))
        except BaseException as error:  # the backward's own error, re-raised below
            outcome.append((False, error))

    leaf = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        root = leaf.clone()
    root.grad_fn.register_prehook(prehook)
    targets = [GradientEdge(*node.next_functions[i]) for i in edges]
    try:
        torch.autograd.grad([root], [leaf, *targets], grad_outputs=[torch.ones(())], allow_unused=True)
    except Exception:
        pass  # judged by whether the pre-hook ran: an error of the backward itself is in outcome
    if not outcome:  # the machinery itself failed on this torch
        raise NarrowingUnavailable()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


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
def swapped(replacements: Sequence[tuple[Packed, torch.Tensor]]) -> Iterator[None]:
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


def _boxes_of(node: Any) -> Optional[dict[int, Packed]]:
    """Our boxes by record index; None when the node also holds saves someone else packed."""
    boxes: dict[int, Packed] = {}
    for _, raw in raw_saved_slots(node):
        packed = raw.data
        if isinstance(packed, Packed):
            boxes[packed.index] = packed
        elif packed is not None and not isinstance(packed, torch.Tensor):
            return None
    return boxes


def _donated_boxes(node: Any) -> list[Packed]:
    """A compiled region's saves its backward may reuse the memory of (all of them where the node
    does not say which); none for any other node."""
    if type(node).__name__ != COMPILED_NODE:
        return []
    donated = donated_saves(node)
    boxes = []
    for attr, raw in raw_saved_slots(node):  # saved_tensors[i]
        packed = raw.data
        position = int(attr[attr.index("[") + 1:-1])
        if isinstance(packed, Packed) and (donated is None or position in donated):
            boxes.append(packed)
    return boxes


def _two_valued(t: torch.Tensor) -> bool:
    values = torch.unique(t.detach())
    return values.numel() <= 1 or (values.numel() == 2 and bool((values == 0).any()))


def _sign_classes(t: torch.Tensor) -> int:
    """How many of the classes negative, zero and positive occur in ``t``; 3 when it holds NaN
    (a sign pattern of 1 bit per element could not keep it)."""
    t = t.detach()
    if t.numel() == 0:
        return 0
    low, high = torch.aminmax(t)  # one pass: the zero class follows from min/max unless mixed
    if bool(low.isnan()) or bool(high.isnan()):
        return 3
    if bool(low >= 0):
        return int(bool(high > 0)) + int(bool(low == 0))
    if bool(high <= 0):
        return int(bool(low < 0)) + int(bool(high == 0))
    return 2 + int(bool((t == 0).any()))


class Prover:
    """Runs the proof over one recording and rewrites the verdicts it settles."""

    def __init__(self, recording: Recording, nodes: list[GraphNode], tensors: list[SavedTensor],
                 live_tensors: list[Optional[torch.Tensor]]) -> None:
        self.recording = recording
        self.nodes = nodes
        self.tensors = tensors
        self.live_tensors = live_tensors
        self.static = [t.verdict for t in tensors]  # the op knowledge's verdicts, before any proof
        self.disagreements: list[Disagreement] = []
        self.narrowing = Narrowing()
        self.pools: dict[torch.device, Pools] = {}
        self.consumed = _consumed_outputs(recording)

    def pool(self, device: torch.device) -> Pools:
        pools = self.pools.get(device)
        if pools is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(SEED)
            pools = self.pools[device] = Pools(generator)
        return pools

    def run(self) -> list[Disagreement]:
        by_node: dict[int, list[int]] = defaultdict(list)
        for j, t in enumerate(self.tensors):
            if t.held and self.live_tensors[j] is not None:
                if self.live_tensors[j].device.type == "meta":
                    raise GradauditError("verify=True needs real values; it cannot run on the meta device")
                by_node[t.node_id].append(j)
        with deterministic_cudnn():
            for node_id, indices in by_node.items():
                self.prove_node(node_id, indices)
        return self.disagreements

    # ------------------------------------------------------------------------------------------
    def prove_node(self, node_id: int, indices: list[int]) -> None:
        live = self.recording.nodes[node_id]
        if live.name == "CopySlices":  # recorder._collect_hidden: saves of a node CopySlices does not expose
            hidden = [j for j in indices if self.tensors[j].attr.startswith("hidden[")]
            if hidden:
                self._unproven(hidden, "hidden inside CopySlices by an in-place op on a view: the node that "
                                       "reads it cannot be called on its own")
                indices = [j for j in indices if j not in hidden]
                if not indices:
                    return None
        if live.name == CHECKPOINT_INPUTS:
            return self._unproven(indices, "torch.utils.checkpoint holds it to recompute its block; no node reads it "
                                           "that could be called on its own")
        if live.node is None or not live.created_here:
            return self._unproven(indices, "its node cannot be called on its own")
        if live.name == REENTRANT_CHECKPOINT_NODE:
            # calling it reruns the checkpointed block (its modules, their hooks, batch norm's
            # running statistics): its inputs keep the verdict of what holds them
            return self._unproven(indices, "calling its node would recompute the checkpointed block")
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
            if self.live_tensors[j].layout != torch.strided:
                self._unproven([j], f"its layout ({self.live_tensors[j].layout}) is not poisoned")
                continue
            subjects.append((j, box))
        if not subjects:
            return
        pools = self.pool(self.live_tensors[subjects[0][0]].device)
        pools.begin()
        try:
            self._prove_subjects(live.node, subjects, pools, fresh=False)
        except _PoolsTouched:
            # this backward wrote into a shared poison or gradient (detected right after that
            # call, so verdicts settled before it stand): prove its saves again with copies
            self._prove_subjects(live.node, subjects, pools, fresh=True)

    def _prove_subjects(self, node: Any, subjects: list[tuple[int, Packed]], pools: Pools,
                        fresh: bool) -> None:
        call = NodeCall(node, self.consumed.get(id(node), set()), pools, fresh=fresh, narrowing=self.narrowing,
                        protect=_donated_boxes(node))
        # a user's backward could write into a poison without bumping a version (through .data
        # or numpy): custom Functions always get private copies
        poisons = Poisons(pools, fresh=call.copies)
        candidates = [(j, box) for j, box in subjects if self.tensors[j].verdict == NOT_NEEDED]
        others = [(j, box) for j, box in subjects if self.tensors[j].verdict != NOT_NEEDED]
        if candidates and self._unread(call, poisons, candidates):
            for j, _ in candidates:
                self._settle(j, NOT_NEEDED)
        else:
            others = candidates + others  # at least one is read: settle each on its own
        if not others:
            return
        graph_node = self.nodes[self.tensors[others[0][0]].node_id]
        known = declaration(graph_node.name, graph_node.scalars)
        hints = {j: call.narrowable(known.witness_edges(self.tensors[j].attr, graph_node.edge_mask)
                                    if known else None) for j, _ in others}
        for j, box in others:
            try:
                witness = poisons.witness(self.live_tensors[j])
                if witness is None:
                    self._unproven([j], "no in-range value differs from its own")
                    continue
                if hints[j] is not None and self.tensors[j].verdict == NEEDED:
                    # one gradient that should read it, computed alone with and without a
                    # witness: a change proves the read at a fraction of the cost
                    if call.changed_by([(box, witness)], hints[j]):
                        if not call.repeatable(hints[j]):
                            self._unproven([j], NOT_REPEATABLE)
                        else:
                            self._settle_needed(j)
                        continue
                self._prove_one(call, poisons, j, box, witness)
            except _PoolsTouched:
                raise
            except Exception as error:  # only a baseline call gets here (under() catches the rest)
                self._unproven([j], f"its backward raised {type(error).__name__} when called on its own")

    def _unread(self, call: NodeCall, poisons: Poisons, subjects: list[tuple[int, Packed]]) -> bool:
        """True when backward's result does not depend on any of these saves' values."""
        first, second = [], []
        for k, (j, box) in enumerate(subjects):
            pair = poisons.pair(self.live_tensors[j], offset=k)
            if pair is None:
                return False
            first.append((box, pair[0]))
            second.append((box, pair[1]))
        # Two poisons unequal at every element giving bitwise-equal gradients: the values are
        # not read, so the recorded values give those gradients too (no baseline call needed).
        return same_outputs(call.under(first), call.under(second))

    def _prove_one(self, call: NodeCall, poisons: Poisons, j: int, box: Packed,
                   witness: torch.Tensor) -> None:
        t, value = self.tensors[j], self.live_tensors[j]
        if not call.changed_by([(box, witness)]):
            if self._unread(call, poisons, [(j, box)]):
                return self._settle(j, NOT_NEEDED)
        if t.verdict in (SIGN_ONLY, UNKNOWN) and value.dtype.is_floating_point:
            if not any(call.changed_by([(box, p)]) for p in poisons.signs(value)):
                self._settle(j, SIGN_ONLY, bitpackable=_sign_classes(value) <= 2)
                return
        if not call.repeatable():
            # every change seen may be the kernel's own: neither read nor unread is proven
            return self._unproven([j], NOT_REPEATABLE)
        self._settle_needed(j)

    def _settle_needed(self, j: int) -> None:
        t = self.tensors[j]
        self._settle(j, NEEDED)
        if t.bitpackable and t.verdict == NEEDED and not _two_valued(self.live_tensors[j]):
            t.bitpackable = False
            self._disagree(j, NEEDED, "was said to hold only two values (0 and one constant), but it does not")

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
            self._disagree(j, verdict, f"was judged {static} by op knowledge, but backward reads its values")
        t.verdict = verdict
        t.bitpackable = bool(bitpackable) if verdict == SIGN_ONLY else (t.bitpackable and verdict == NEEDED)
        t.reason = {
            NOT_NEEDED: "proven: the gradients are bitwise unchanged when its values are replaced",
            SIGN_ONLY: "proven: the gradients depend only on its sign pattern",
            NEEDED: "proven: replacing its values changes the gradients",
        }[verdict]

    def _disagree(self, j: int, proven: str, what: str) -> None:
        t = self.tensors[j]
        self.disagreements.append(Disagreement(tensor=t.index, node=t.node, attr=t.attr, module=t.module,
                                               static=self.static[j], proven=proven, what=what))

    def _unproven(self, indices: Sequence[int], why: str) -> None:
        for j in indices:
            t = self.tensors[j]
            if not t.unproven:
                t.unproven = why


def prove(*, recording: Recording, nodes: list[GraphNode], tensors: list[SavedTensor],
          live_tensors: list[Optional[torch.Tensor]]) -> list[Disagreement]:
    """Prove or correct every held save's verdict in place (``verdict``, ``bitpackable``, ``proven``,
    ``reason``; ``unproven`` says why a save could not be settled). Returns where the proof
    refuted the op knowledge."""
    return Prover(recording, nodes, tensors, live_tensors).run()
