"""Record what autograd saves during one forward pass and tie each save to its node, module and line.

Mechanism (see tests/test_facts.py for the pinned autograd behaviour it relies on):
- a saved-tensors hook whose ``pack`` wraps every saved tensor in a ``Packed`` box;
- a node-creation hook that notes the running module and user source line of every new node;
- after the forward, a walk from the outputs through ``next_functions`` that reads each saved
  slot's *packed* object (``SavedTensor.data``), never its unpacked value. Reading the packed object
  does not run anybody's unpack hook, so a ``torch.utils.checkpoint`` region is never recomputed.

The recorder never decides anything about the tensors; it only observes (rules live elsewhere).
"""

from __future__ import annotations

import bisect
import functools
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from . import torchapi
from .sdpa import SdpaChoice, cpu_choice, emulated_sdpa, sdpa_arguments
from .module_tracker import ModuleTracker
from .compiled import ParameterLayouts, attribute
from .torchapi.compiler import COMPILED_NODE, InlinedMode, SavedOrigin, compiling, traced_setter
from .records import NEEDED, AttentionCall, Leaf, Manager
from .sites import constructed, user_frame, construction_site, short_path, user_source_line
from .sites import noting_construction  # noqa: F401  (recorder.noting_construction, as before the move)
from .tensors import flatten, iter_tensors, storage_key, tensor_attributes, unique
from .torchapi.autograd import (NO_SEQUENCE, called_from_autograd, caller_frame, manager_of, node_scalars,
                                node_sequence_number, packed_by_checkpoint, pop_node_creation_hook,
                                push_node_creation_hook, raw_saved_slots, sequence_number,
                                top_saved_tensors_hooks)
from .torchapi.checkpoint import (REENTRANT_CHECKPOINT_NODE, cached_tensors, checkpoint_arguments,
                                  checkpoint_cache, checkpoint_placeholder, checkpoint_run_function,
                                  reentrant_checkpoint_frames, saving_checkpoint_inputs)
from .torchapi.distributed import local_of
from .torchapi.kernels import sdp_backend_name
from .torchapi.storages import storage_id, version_counter

_COPY_SLICES_REACH = 4  # nodes announced between an in-place-on-view save and its CopySlices


class Packed:
    """What autograd stores instead of the tensor while gradaudit records."""

    __slots__ = ("tensor", "index", "__weakref__")

    def __init__(self, tensor: torch.Tensor, index: int) -> None:
        self.tensor = tensor
        self.index = index


@dataclass
class NodeSite:
    """Where a node was created: the module running and the user's source line."""

    module: str
    module_class: str
    source: Optional[str]


@dataclass
class LiveSave:
    """A saved slot found in the graph walk, still tied to live objects."""

    index: int
    node_pos: int  # position in Recording.nodes
    attr: str
    tensor: Optional[torch.Tensor]  # None when the tensor is not held (checkpointed, unknown)
    managed_by: str
    site: NodeSite
    shape: Optional[tuple[int, ...]] = None  # set when tensor is None but the shape is known
    dtype: Optional[torch.dtype] = None
    verdict: Optional[str] = None  # known from what holds it (a checkpoint's inputs), not from op knowledge
    reason: str = ""
    function: Optional[str] = None  # the Python-level torch function running when it was packed (hidden saves)
    origin: Optional[SavedOrigin] = None  # a compiled region's save: where its graphs say it comes from
    copy_of: Optional[str] = None  # a compiled region's save: the parameter it is a copy of (its values, a new storage)


CHECKPOINT_INPUTS = "CheckpointInputs"  # the node a non-reentrant checkpoint's saved inputs are shown on


@dataclass
class LiveRegion:
    """One ``torch.utils.checkpoint`` call seen during the forward.

    Reentrant: its block ran under no_grad inside ``CheckpointFunction.forward``; the block's inner
    graph (and so its parameters' AccumulateGrad nodes) is built only in backward, when the
    CheckpointFunctionBackward node ``ctx`` runs. Non-reentrant: its inputs were saved with
    gradaudit's hooks (``packs``) and are held by the checkpoint itself, out of the graph walk's reach.
    """

    reentrant: bool
    depth: int  # length of the module stack when it began (its top-level modules run at this depth)
    caller: tuple[str, str]  # the module running when checkpoint was called (path, class)
    source: Optional[str]  # the user's line that called checkpoint
    entered: list[tuple[str, str]] = field(default_factory=list)  # modules run directly inside it
    ctx: Optional[weakref.ref] = None  # reentrant: its CheckpointFunctionBackward node
    hook: Optional[int] = None  # non-reentrant: id of checkpoint's pack hook while the region runs
    packs: list[int] = field(default_factory=list)  # non-reentrant: box indices of its saved inputs
    # non-reentrant: aliases of the tensors it keeps by plain reference (inside non-tensor arguments,
    # keyword arguments): held as long as its packed inputs are, seen by no hook
    kept: list[torch.Tensor] = field(default_factory=list)
    # non-reentrant with a selective-checkpoint policy: the cache of op outputs it keeps (a dict
    # torch fills while the block runs), held as long as its packed inputs are, seen by no hook
    cache: Any = None
    run_modules: list[tuple[str, str]] = field(default_factory=list)  # the module(s) its block function is
    closure_modules: list[tuple[str, str]] = field(default_factory=list)  # modules its function's closure holds
    node_pos: Optional[int] = None  # reentrant: its node's position in Recording.nodes, when reached

    @property
    def module(self) -> tuple[str, str]:
        """The checkpointed module: the only module run directly inside the region, else the one
        the block function is (or is bound to), else the module that called checkpoint."""
        if len(self.entered) == 1:
            return self.entered[0]
        if len(self.run_modules) == 1:
            return self.run_modules[0]
        return self.caller

    def site(self) -> "NodeSite":
        path, cls = self.module
        return NodeSite(path, cls, self.source)

    def cache_reason(self) -> str:
        path = self.module[0]
        return (f"kept by the selective checkpoint of {path or 'model'}: an op output its policy saves, which backward "
                f"reuses instead of recomputing it")

    def reason(self) -> str:
        path = self.module[0]
        return (f"held by torch.utils.checkpoint: an input of the checkpointed {path or 'model'}, which "
                f"backward reruns from it (needed to recompute the block)")


_ALL_GATHER = "all_gather_into_tensor"  # torch.ops._c10d_functional's, as DTensor and funcol call it
# what passes gathered data on unchanged (DTensor's gather along a dimension other than 0 chunks and
# concatenates the gathered buffer)
_GATHERING = frozenset({_ALL_GATHER, "wait_tensor", "_wrap_tensor_autograd", "chunk", "split", "cat", "contiguous",
                        "view", "view_as", "reshape", "permute", "transpose", "flatten", "unflatten"})


class AttentionCalls(InlinedMode):
    """Notes every ``F.scaled_dot_product_attention`` call: the kernel it picks (and would pick
    without dropout) and the sequence numbers of the nodes it creates, so a rule can tell the
    math fallback of a fused-attention call from attention written out by hand. Also names the
    torch function running at each moment (``current``): a save hidden inside CopySlices (an
    in-place op on a view) is known by the function that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, AttentionCall]] = []  # (first sequence nr, end, call)
        # per call: (weak storage reference, bytes) of query, key, value and output (see
        # AttentionCall.fused_keeps); weak, so that an address reused after a free is not mistaken
        self.tensors: list[list[tuple[StorageWeakRef, int]]] = []
        self.gathered = {}
        self._gather_result: Optional[tuple] = None  # (shape, dtype, group) of the last all-gather's result

    current: Optional[str] = None  # the outermost torch function running now (its __name__)
    # storages holding all-gathered data: storage key -> (weak reference, ranks gathered over)
    gathered: dict[int, tuple[StorageWeakRef, int]]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention and func is not emulated_sdpa:
            if compiling():
                # traced by torch.compile: none of this bookkeeping belongs in a region (a region's saves
                # are named from its graphs), and changing the mode's state inside a higher-order op
                # breaks the graph (torch 2.11, Bloom); a tensor attribute is set as dynamo can trace it
                setting = traced_setter(func)
                return setattr(args[0], setting, args[1]) if setting is not None else func(*args, **kwargs)
            # the name of the function running, for saves hidden inside CopySlices (their node
            # is never exposed); the mode is off inside func, so this is the outermost call
            name = self.current = getattr(func, "__name__", None)
            try:
                out = func(*args, **kwargs)
            finally:
                self.current = None
            if name in _GATHERING and (name == _ALL_GATHER or self.gathered or self._gather_result):
                self._note_gathered(name, args, out)
            return out
        if compiling():
            # traced by torch.compile: the call becomes part of a compiled region, whose saves get no
            # per-op verdict; asking the dispatcher for its kernel here would break the user's graph
            return func(*args, **kwargs)
        if func is emulated_sdpa:  # a call the meta kernel choices run for a target device: its kernel is given
            choice, bound = args[0], sdpa_arguments(args[2:], kwargs)
        else:
            choice, bound = None, sdpa_arguments(args, kwargs)
        query = bound["query"]
        call = None
        if isinstance(query, torch.Tensor):
            try:
                if choice is None:
                    kernel = sdp_backend_name(cpu_choice(bound))
                    without = (sdp_backend_name(cpu_choice(bound, dropout_p=0.0)) if bound["dropout_p"]
                               else kernel)
                    choice = SdpaChoice(kernel, without, "cpu" if query.device.type == "meta" else query.device.type)
                batch_heads_queries = query.numel() // query.shape[-1] if query.dim() else 0
                call = AttentionCall(
                    index=len(self.calls), logsumexp_bytes=batch_heads_queries * 4, kernel=choice.kernel,
                    kernel_without_dropout=choice.kernel_without_dropout,
                    dropout_p=float(bound["dropout_p"]), masked=bound["attn_mask"] is not None,
                    causal=bool(bound["is_causal"]), device=choice.device, passed_over=choice.passed_over)
            except Exception:  # the choice cannot be asked for these arguments: say nothing
                call = None
        start = sequence_number()
        out = func(*args, **kwargs)
        if call is not None:
            self.calls.append((start, sequence_number(), call))
            kept = {}  # one entry per storage (a packed qkv projection gives three views of one)
            for t in (bound["query"], bound["key"], bound["value"], out):
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    ref = StorageWeakRef(t.untyped_storage())
                    kept.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
            self.tensors.append(list(kept.values()))
        return out

    def _note_gathered(self, name: str, args: tuple, out: Any) -> None:
        """A collective's all-gather (DTensor's redistribution to Replicate, sequence parallelism's
        gather before a column-parallel linear) and what only rearranges its result (waiting for it,
        chunks and their concatenation, views): their storages hold gathered data, ``group`` times
        what one rank holds of it."""
        if name == _ALL_GATHER:
            group = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
            first = next(iter_tensors(out), None)
            # on the meta device the collective's result reaches the next op as another storage (no
            # wait_tensor runs): that op is known by the result's shape and dtype, once
            self._gather_result = (tuple(first.shape), first.dtype, group) if first is not None else None
        else:
            group = 0
            for t in iter_tensors(args):
                entry = self.gathered.get(storage_key(t)) if t.layout == torch.strided else None
                if entry is not None and not entry[0].expired():
                    group = entry[1]
                    self._gather_result = None
                    break
                pending = self._gather_result
                if pending is not None and (tuple(t.shape), t.dtype) == pending[:2]:
                    group = pending[2]
                    self._gather_result = None
                    break
        if group < 2:
            return
        for t in iter_tensors(out):
            if t.layout == torch.strided:
                storage = local_of(t).untyped_storage()
                self.gathered[storage_id(storage)] = (StorageWeakRef(storage), group)

    def call_of(self, sequence: int) -> Optional[AttentionCall]:
        # calls are recorded in sequence order and do not overlap: the last one starting at or
        # before ``sequence`` is the only candidate (asked once per node: no linear scan)
        i = bisect.bisect_right(self.calls, sequence, key=lambda entry: entry[0]) - 1
        if i >= 0:
            start, end, call = self.calls[i]
            if start <= sequence < end:
                return call
        return None


@dataclass
class LiveNode:
    node: Any  # torch.autograd.graph.Node
    name: str
    site: NodeSite
    next_positions: list[Optional[int]] = field(default_factory=list)
    edge_mask: list[bool] = field(default_factory=list)
    saves: list[int] = field(default_factory=list)  # positions in Recording.saves
    variable: Optional[str] = None
    scalars: dict[str, Any] = field(default_factory=dict)
    created_here: bool = True
    attention: Optional[AttentionCall] = None


@dataclass
class Recording:
    """The raw result of a traced forward: live nodes and saves, valid while the graph lives."""

    nodes: list[LiveNode]
    saves: list[LiveSave]
    outputs: list[torch.Tensor]
    pack_count: int  # tensors packed during the forward (reachable or not)
    node_sites: dict[int, NodeSite]
    attention_tensors: list[list[tuple[Any, int]]] = field(default_factory=list)  # AttentionCalls.tensors
    regions: list[LiveRegion] = field(default_factory=list)  # torch.utils.checkpoint calls seen
    # storages of the modules' plain tensor attributes before the forward (module state, not activations)
    attributes_before: set[int] = field(default_factory=set)
    # calls of the watched modules (Recorder.watch): [path, class, aliases of the tensors passed in,
    # class names of the other arguments that hold tensors, aliases of the tensors it returned, the
    # version counters of the tensors passed in when it was called]
    calls: list[list[Any]] = field(default_factory=list)
    # storages holding all-gathered data (AttentionCalls.gathered): storage key -> ranks gathered over
    gathered: dict[int, int] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# The recording


class Recorder:
    """Context manager around a forward pass; ``collect(outputs)`` returns the Recording."""

    def __init__(self, model: nn.Module, watch: Sequence[str] = (),
                 modules: Optional[Sequence[tuple[str, nn.Module]]] = None) -> None:
        self.model = model
        # ``list(model.named_modules())`` before the forward, when the caller has it
        self._named_modules = list(model.named_modules()) if modules is None else modules
        self.tracker = ModuleTracker(model, modules=self._named_modules)  # told of _on_enter while entered
        # module paths whose calls' tensor inputs are kept (aliases) for Report.module_calls
        self.watch = tuple(watch)
        self.calls: list[tuple[str, str, list[torch.Tensor], list[str]]] = []
        self._watch_handles: list[Any] = []
        self._boxes: list[weakref.ref] = []
        self.node_sites: dict[int, NodeSite] = {}
        self.pack_sites: list[NodeSite] = []
        # Nodes announce themselves only after their saves are packed, so a pack belongs to a node
        # announced later. For each pack: how many nodes had been announced when it happened.
        self.pack_owners: list[int] = []
        self.pack_functions: list[Optional[str]] = []  # per pack: the torch function running (AttentionCalls)
        self._announced = 0
        self._copy_slices: list[tuple[int, int]] = []  # (announce position, sequence nr) of CopySlices
        self._node_hook_installed = False
        self.start_sequence = 0
        self.end_sequence = 0
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self.attention = AttentionCalls()
        self.regions: list[LiveRegion] = []
        self._reentrant: dict[int, LiveRegion] = {}  # id(CheckpointFunctionBackward node) -> region
        # the last non-reentrant region whose inputs were saved: (id of the saving frame, what had
        # happened by its last input, region); its next input follows with nothing in between
        self._saving: Optional[tuple[int, tuple[int, int, int], LiveRegion]] = None
        self._placeholders: set[int] = set()  # packs of checkpoint placeholders (torch 2.11 to 2.13), not saves
        self._entered = 0  # submodule forwards started so far
        self._module_paths: Optional[dict[int, tuple[str, str]]] = None  # id(module) -> (path, class)
        self._layouts: Optional[ParameterLayouts] = None  # made when a compiled region's saves need it
        # the frame that calls the forward (audit()'s): lines at or outside it explain nothing
        self._caller: Any = None
        # module path -> its construction line, for ops whose every frame inside the forward is
        # torch's (nn.Sequential and the layers in it): known when the model was built under
        # noting_construction() (the command line), else those ops' source is unknown
        self._built: dict[str, str] = {}
        self._short_paths: dict[str, str] = {}  # file name -> short_path(), for this recording's cwd
        self._cwd: Optional[str] = None
        if constructed:
            for path, module in self._named_modules:
                site = construction_site(module)
                if site is not None:
                    self._built[path] = site

    # -- hooks ---------------------------------------------------------------------------------
    def _site(self) -> NodeSite:
        """The running module and the line explaining the op: the innermost line of the model's own
        code (a forward written by the user or a model library), else, when only torch ran inside
        the forward call (``nn.Sequential``, an ``nn.Linear`` called by it), the line that
        constructed the running module if known, else None (never the line that called the forward)."""
        return self._site_from(sys._getframe(1))

    def _site_from(self, frame: Any) -> NodeSite:
        """``_site`` for the op whose innermost Python frame is ``frame``."""
        path, cls = self.tracker.stack[-1]
        frame = user_frame(frame, self._caller)
        if frame is None:
            return NodeSite(path, cls, self._built.get(path))
        filename = frame.f_code.co_filename
        short = self._short_paths.get(filename)
        if short is None:  # the working directory as the recording began (short_path's, once per file)
            short = self._short_paths[filename] = short_path(filename, self._cwd)
        return NodeSite(path, cls, f"{short}:{frame.f_lineno}")

    def _pack(self, tensor: torch.Tensor) -> Packed:
        # The box keeps a detached alias (same storage, strides, version counter; no grad_fn), never
        # ``tensor`` itself: when a node saves its own output, ``tensor.grad_fn`` is that node, and
        # tensor -> grad_fn -> saved slot -> box -> tensor would be a cycle through C++ that Python's
        # collector cannot see, keeping the whole graph alive after the audit. Backward does not
        # care: it re-attaches the unpacked data to the node it saved for (torch's
        # saved_tensors_hooks docs ask for exactly this).
        box = Packed(tensor.detach(), len(self._boxes))
        self._boxes.append(weakref.ref(box))
        self.pack_owners.append(self._announced)
        self.pack_functions.append(self.attention.current)
        if not self._node_hook_installed:
            self.pack_sites.append(self._site())
        frame = caller_frame(1)  # whoever autograd's pack call came from
        if saving_checkpoint_inputs(frame):
            if checkpoint_placeholder(frame, tensor):
                self._placeholders.add(box.index)  # held by the checkpoint, 0 bytes, no input: not a save
            else:
                self._note_checkpoint_input(box.index, frame)
        return box

    def _note_checkpoint_input(self, index: int, frame: Any) -> None:
        """A non-reentrant checkpoint saves its region's inputs, all at once before the region runs."""
        saving = self._saving
        # nothing since its previous input: no pack, node or module (frame ids are reused)
        before = (index - 1, self._announced, self._entered)
        if saving is not None and saving[0] == id(frame) and saving[1] == before:
            region = saving[2]
        else:
            stack = self.tracker.stack
            region = LiveRegion(reentrant=False, depth=len(stack), caller=stack[-1],
                                source=user_source_line(frame, self._caller))
            called = checkpoint_arguments(frame)
            if called is not None:
                args, kwargs = called
                packed = {id(a) for a in args if isinstance(a, torch.Tensor)}  # these come as packs
                region.kept = [t.detach() for t in unique(list(iter_tensors((args, kwargs))))
                               if id(t) not in packed]
            region.cache = checkpoint_cache(frame)
            self.regions.append(region)
        self._saving = (id(frame), (index, self._announced, self._entered), region)
        region.packs.append(index)

    def _on_enter(self, entry: tuple[str, str]) -> None:
        """A submodule's forward starts: note it in the checkpoint region it runs in, if any."""
        stack = self.tracker.stack
        self._entered += 1
        if not torch.is_grad_enabled():
            # reentrant checkpointing runs the block under no_grad, inside CheckpointFunction.forward
            for frame, ctx in reentrant_checkpoint_frames(sys._getframe(1)):
                region = self._reentrant.get(id(ctx))
                if region is None or region.ctx() is not ctx:
                    region = LiveRegion(reentrant=True, depth=len(stack), caller=stack[-1],
                                        source=user_source_line(frame.f_back, self._caller),
                                        ctx=weakref.ref(ctx))
                    self._reentrant[id(ctx)] = region
                    self.regions.append(region)
                if len(stack) == region.depth:
                    region.entered.append(entry)
            return
        region = self._saving[2] if self._saving is not None else None
        if region is None or len(stack) != region.depth:
            return
        # a non-reentrant region runs its block under checkpoint's own saved-tensor hooks
        top = top_saved_tensors_hooks()
        if top is None or not packed_by_checkpoint(top[0]):
            return
        if region.hook is None:
            region.hook = id(top[0])
        if region.hook == id(top[0]):
            region.entered.append(entry)

    @staticmethod
    def _unpack(box: Packed) -> torch.Tensor:
        return box.tensor

    def _site_by_sequence(self, seq: int, created_here: bool) -> Optional[NodeSite]:
        """Without the node-creation hook: the module that ran when the node was made (no source
        line but the module's construction; a save's pack, where there is one, says more)."""
        if self.tracker.timeline is None or not created_here or seq == NO_SEQUENCE:
            return None
        path, cls = self.tracker.running_at(seq)
        return NodeSite(path, cls, self._built.get(path))

    def _on_node(self, node: Any) -> None:
        seq = node_sequence_number(node)
        if seq != NO_SEQUENCE:
            self.node_sites[seq] = self._site_from(sys._getframe(0))
            if type(node).__name__ == "CopySlices":
                self._copy_slices.append((self._announced, seq))
        self._announced += 1

    def __enter__(self) -> "Recorder":
        """Enter in the frame that then calls the model's forward (see ``user_source_line``)."""
        self._caller = sys._getframe(1)
        self._cwd = os.getcwd()
        self.attributes_before = {storage_key(t) for _, t in tensor_attributes(self.model, self._named_modules)
                                  if t.layout == torch.strided}
        self.tracker.on_enter = self._on_enter
        self.tracker.__enter__()
        modules = dict(self._named_modules) if self.watch else {}
        for path in self.watch:
            before, after = self._make_watcher(path, type(modules[path]).__name__)
            self._watch_handles.append(modules[path].register_forward_pre_hook(before, with_kwargs=True))
            self._watch_handles.append(modules[path].register_forward_hook(after, always_call=True))
        self.attention.__enter__()
        if torchapi.has("node creation hook"):
            push_node_creation_hook(called_from_autograd(self._on_node), "the recorder")
            self._node_hook_installed = True
        else:
            self.tracker.timeline = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(called_from_autograd(self._pack),
                                                              called_from_autograd(self._unpack))
        self.start_sequence = sequence_number()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end_sequence = sequence_number()
        self._caller = None  # the caller's frame holds this recorder: no cycle left behind
        try:
            if self._hooks is not None:
                self._hooks.__exit__(*exc)
        finally:
            # nor through the bound methods the hooks and the tracker hold: the recorder, and all
            # it noted, is freed as soon as the audit lets go of it, not by a garbage collection
            self._hooks = None
            if self._node_hook_installed:
                pop_node_creation_hook()
            self.attention.__exit__(*exc)
            self.tracker.__exit__(*exc)
            self.tracker.on_enter = None
            for handle in self._watch_handles:
                handle.remove()
            self._watch_handles.clear()

    def _make_watcher(self, path: str, cls: str) -> tuple[Callable[..., None], Callable[..., None]]:
        """A forward pre-hook noting what a watched module is passed and a forward hook noting what
        it returns (a stack: a module may run inside its own call)."""
        calls, running = self.calls, []

        def before(module: nn.Module, args: Any, kwargs: Any) -> None:
            # detached aliases: they keep each storage (and so its key) alive until the report is
            # built, and no grad_fn, so no graph either
            tensors, _, opaque = flatten((args, kwargs))
            passed = unique(tensors)
            # (the aliases share each tensor's version counter: a write in place to an input from here to the
            # forward's end shows as a later version, where a checkpoint of the module could not recompute it)
            calls.append([path, cls, [t.detach() for t in passed], [type(v).__name__ for v in opaque], [],
                          [version_counter(t) for t in passed]])
            running.append(len(calls) - 1)

        def after(module: nn.Module, args: Any, output: Any) -> None:
            if running:
                calls[running.pop()][4] = [t.detach() for t in unique(flatten(output)[0])]

        return before, after

    def _collect_hidden(self, nodes: list[LiveNode], saves: list[LiveSave]) -> None:
        """Saves still alive but held by nodes the walk cannot see.

        An in-place op on a view wraps its node inside a CopySlices node, which does not expose
        it, and the inner node is never announced to the node-creation hook. Its saved tensors are
        alive (their boxes are), so they are held: report them on the CopySlices node announced
        next after they were packed, as ``hidden[i]``, with verdict unknown.
        """
        found = {s.index for s in saves if s.index >= 0} | self._placeholders
        self._collect_checkpoint_inputs(nodes, saves, found)
        if len(found) == len(self._boxes):  # every pack is a save the walk found: nothing hidden
            return
        by_sequence = {}
        for pos, live in enumerate(nodes):
            if live.name == "CopySlices" and live.node is not None:
                by_sequence[node_sequence_number(live.node)] = pos
        announced = [position for position, _ in self._copy_slices]
        fallback = NodeSite("", type(self.model).__name__, None)
        for index, ref in enumerate(self._boxes):
            box = ref()
            if box is None or index in found:
                continue
            k = bisect.bisect_left(announced, self.pack_owners[index])
            # only the in-place op's own helper nodes (clone, as_strided) are announced in between
            near = k < len(announced) and announced[k] - self.pack_owners[index] <= _COPY_SLICES_REACH
            seq = self._copy_slices[k][1] if near else -1
            pos = by_sequence.get(seq)
            if pos is None:  # not reachable, or no CopySlices followed: keep it visible anyway
                site = self.node_sites.get(seq) or (self.pack_sites[index] if index < len(self.pack_sites)
                                                    else fallback)
                pos = by_sequence[seq] = len(nodes)
                nodes.append(LiveNode(node=None, name="CopySlices", site=site))
            live = nodes[pos]
            saves.append(LiveSave(index, pos, f"hidden[{len(live.saves)}]", box.tensor, Manager.AUTOGRAD, live.site,
                                  function=self.pack_functions[index] if index < len(self.pack_functions) else None))
            live.saves.append(len(saves) - 1)

    def _collect_checkpoint_inputs(self, nodes: list[LiveNode], saves: list[LiveSave], found: set[int]) -> None:
        """The inputs non-reentrant checkpoints hold: on one node per region, attributed to the
        checkpointed module, needed (backward recomputes the block from them)."""
        for region in self.regions:
            live = None
            for index in region.packs:
                box = self._boxes[index]()
                if box is None or index in found:
                    continue  # freed with the region (its output unused)
                if live is None:
                    live = LiveNode(node=None, name=CHECKPOINT_INPUTS, site=region.site())
                    region.node_pos = len(nodes)
                    nodes.append(live)
                saves.append(LiveSave(index, region.node_pos, f"inputs[{len(live.saves)}]", box.tensor,
                                      Manager.AUTOGRAD, live.site, verdict=NEEDED, reason=region.reason()))
                live.saves.append(len(saves) - 1)
                found.add(index)
            if live is None:
                continue
            for tensor in region.kept:  # held by the checkpoint's references, as long as its inputs are
                saves.append(LiveSave(-1, region.node_pos, f"inputs[{len(live.saves)}]", tensor,
                                      Manager.AUTOGRAD, live.site, verdict=NEEDED, reason=region.reason()))
                live.saves.append(len(saves) - 1)
            cached = cached_tensors(region.cache) if region.cache is not None else []
            for k, tensor in enumerate(unique(cached)):
                saves.append(LiveSave(-1, region.node_pos, f"cached[{k}]", tensor.detach(), Manager.AUTOGRAD,
                                      live.site, verdict=NEEDED, reason=region.cache_reason()))
                live.saves.append(len(saves) - 1)

    def _reentrant_region(self, node: Any, site: NodeSite) -> LiveRegion:
        """The region of a reentrant checkpoint node reached by the walk (made here when no module
        ran inside it), with the modules its block function names."""
        region = self._reentrant.get(id(node))
        if region is None or region.ctx() is not node:
            region = LiveRegion(reentrant=True, depth=-1, caller=(site.module, site.module_class),
                                source=site.source, ctx=weakref.ref(node))
            self._reentrant[id(node)] = region
            self.regions.append(region)
        if self._module_paths is None:
            self._module_paths = {id(m): (path, type(m).__name__) for path, m in self.model.named_modules()}
        paths = self._module_paths
        direct, closure = _modules_named_by(checkpoint_run_function(node))
        region.run_modules = [paths[id(m)] for m in direct if id(m) in paths]
        region.closure_modules = [paths[id(m)] for m in closure if id(m) in paths]
        return region

    def _parameter_layouts(self) -> ParameterLayouts:
        if self._layouts is None:
            self._layouts = ParameterLayouts(self.model)
        return self._layouts

    # -- the walk ------------------------------------------------------------------------------
    def _owned(self, packed: Any) -> bool:
        if not isinstance(packed, Packed):
            return False
        index = packed.index
        return index < len(self._boxes) and self._boxes[index]() is packed

    def collect(self, outputs: list[torch.Tensor], leaf_names: dict[int, str]) -> Recording:
        """Walk the graph from ``outputs`` and tie every saved slot to its node.

        ``leaf_names`` maps ``id(tensor)`` of parameters/inputs to a label for AccumulateGrad nodes.
        """
        roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
        positions: dict[Any, int] = {}
        nodes: list[LiveNode] = []
        saves: list[LiveSave] = []
        order: list[Any] = []
        earlier: list[LiveNode] = []  # nodes from before the audited forward
        unknown_site = NodeSite("", type(self.model).__name__, None)

        def visit(node: Any) -> int:
            pos = positions.get(node)
            if pos is None:
                pos = len(order)
                positions[node] = pos
                order.append(node)
            return pos

        for root in roots:
            visit(root)
        cursor = 0
        while cursor < len(order):
            node = order[cursor]
            cursor += 1
            seq = node_sequence_number(node)
            created_here = seq == NO_SEQUENCE or self.start_sequence <= seq < self.end_sequence
            site = self.node_sites.get(seq)
            live = LiveNode(node=node, name=type(node).__name__, site=site or self._site_by_sequence(seq, created_here)
                            or unknown_site)
            nodes.append(live)
            if live.name == "AccumulateGrad":
                variable = getattr(node, "variable", None)
                if variable is not None:
                    live.variable = leaf_names.get(id(variable), Leaf("leaf"))
            live.created_here = created_here
            if created_here and self.attention.calls:
                live.attention = self.attention.call_of(seq)
            if not created_here:
                # A node from before the audit (e.g. the inputs came out of an earlier graph): its
                # saved tensors may be managed by hooks we do not own; do not touch them. Its edges
                # get the positions of the nodes the walk reaches otherwise, once it is over.
                live.edge_mask = [fn is not None for fn, _ in node.next_functions]
                earlier.append(live)
                continue
            live.scalars = node_scalars(node)
            region = None
            if live.name == REENTRANT_CHECKPOINT_NODE:
                region = self._reentrant_region(node, live.site)
                region.node_pos = cursor - 1
                live.site = site = region.site()
            edges = node.next_functions
            live.next_positions = [None if fn is None else visit(fn) for fn, _ in edges]  # final already
            live.edge_mask = [fn is not None for fn, _ in edges]
            self._read_saves(live, cursor - 1, region, site is not None, saves)
        for live in earlier:
            live.next_positions = [
                None if fn is None else positions.get(fn) for fn, _ in live.node.next_functions
            ]
        self._collect_hidden(nodes, saves)
        gathered = {key: group for key, (ref, group) in self.attention.gathered.items() if not ref.expired()}
        return Recording(nodes=nodes, saves=saves, outputs=outputs, pack_count=len(self._boxes), gathered=gathered,
                         node_sites=self.node_sites, attention_tensors=self.attention.tensors,
                         regions=list(self.regions), attributes_before=self.attributes_before,
                         calls=self.calls)


    def _read_saves(self, live: LiveNode, position: int, region: Any, site_known: bool,
                    saves: list[LiveSave]) -> None:
        """Append the saves of node ``live`` (at ``position`` in the walk) to ``saves``: whose hooks hold
        each (ours: its tensor and pack index, and the site of its pack where the node had none), with the
        verdict a reentrant checkpoint's region gives its inputs."""
        boxes = self._boxes
        for attr, raw in raw_saved_slots(live.node):
            packed = raw.data
            if packed is None:
                continue  # an optional save that was not made
            if isinstance(packed, Packed) and packed.index < len(boxes) and boxes[packed.index]() is packed:
                # self._owned(packed), inlined: asked for every save
                tensor, managed = packed.tensor, Manager.AUTOGRAD
                index = packed.index
                if not site_known and index < len(self.pack_sites):
                    live.site = self.pack_sites[index]
            elif isinstance(packed, torch.Tensor):
                # saved while hooks were disabled: held plainly by autograd
                tensor, managed, index = packed, Manager.AUTOGRAD, -1
            else:
                managed = manager_of(raw.unpack_hook)
                tensor, index = None, -1
                # save_on_cpu packs (device, tensor): the shape is readable without unpacking
                if isinstance(packed, tuple) and packed and isinstance(packed[-1], torch.Tensor):
                    shadow = packed[-1]
                    saves.append(LiveSave(index, position, attr, None, managed, live.site,
                                          tuple(shadow.shape), shadow.dtype))
                    live.saves.append(len(saves) - 1)
                    continue
            saves.append(LiveSave(index, position, attr, tensor, managed, live.site))
            if region is not None:  # CheckpointFunction saves exactly the block's tensor inputs
                saves[-1].verdict, saves[-1].reason = NEEDED, region.reason()
            live.saves.append(len(saves) - 1)
        if live.name == COMPILED_NODE:
            _attribute_compiled(live, [saves[k] for k in live.saves], self._parameter_layouts)


def _attribute_compiled(live: LiveNode, saves: list[LiveSave], parameters: Callable[[], ParameterLayouts]) -> None:
    """Each save of a compiled region's node attributed from the region's graphs (``compiled.attribute``):
    its site, its ``origin`` and the parameter it copies; left at the region's site when the graphs
    say nothing certain."""
    region = live.site
    found = attribute(live.node, [save.attr for save in saves], [save.tensor for save in saves],
                      (region.module, region.module_class, region.source), parameters)
    for save, (module, module_class, source, origin, copy_of) in zip(saves, found or ()):
        save.site, save.origin, save.copy_of = NodeSite(module, module_class, source), origin, copy_of


def _modules_named_by(function: Any) -> tuple[list[nn.Module], list[nn.Module]]:
    """Modules a checkpointed block function names: (the module it is, is bound to or is a
    ``functools.partial`` of, as Hugging Face's layers pass ``partial(forward, self)``; modules
    its closure cells hold, as ``create_custom_forward(module)`` wrappers and lambdas do)."""
    direct: list[nn.Module] = []
    closure: list[nn.Module] = []
    seen: set[int] = set()

    def visit(obj: Any, found: list[nn.Module], depth: int) -> None:
        if obj is None or id(obj) in seen or depth < 0:
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, found, depth - 1)
        elif isinstance(obj, functools.partial):
            for item in (obj.func, *obj.args, *obj.keywords.values()):
                visit(item, found, depth - 1)
        else:
            visit(getattr(obj, "__self__", None), found, depth - 1)
            visit(getattr(obj, "__func__", None), found, depth - 1)
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                visit(contents, closure, depth - 1)

    visit(function, direct, 3)
    return direct, closure

