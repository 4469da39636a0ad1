"""The data gradaudit produces: saved tensors, graph nodes, findings and the report that holds them.

Everything here is plain data (no tensors, no autograd objects), so a report can be kept, compared,
serialised and rendered long after the audited forward is gone.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from .collecting import collecting_only_new

SCHEMA_VERSION = 1


class Name(str, enum.Enum):
    """A kind named by a string: compares equal to, prints as and serialises to its value."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)


class StorageKind(Name):
    """What a saved tensor's storage is. Only activations and outputs cost memory because of
    autograd; parameters, buffers and the caller's inputs are alive anyway."""

    ACTIVATION = "activation"
    OUTPUT = "output"
    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    # an activation the audited forward stored as a module attribute (``self.cache = h``): the
    # module keeps it, after backward too, so it is not memory autograd holds (nor frees)
    MODULE = "module"
    # an FSDP2 unsharded parameter (``fully_shard``): gathered for the forward and resharded after
    # it (its storage resized to nothing), gathered again in backward; nothing held in between
    RESHARDED = "resharded"


class Manager(Name):
    """Who holds a saved tensor between forward and backward."""

    AUTOGRAD = "autograd"  # autograd holds it (through gradaudit's recording hooks): counted as held
    CHECKPOINT = "checkpoint"  # torch.utils.checkpoint dropped it; backward recomputes it
    OFFLOAD = "offload"  # torch.autograd.graph.save_on_cpu moved it elsewhere
    HOOKS = "hooks"  # the user's own saved-tensor hooks manage it; where it lives is unknown


class Verdict(Name):
    """Whether backward can need a saved tensor."""

    NEEDED = "needed"
    NOT_NEEDED = "not-needed"
    SIGN_ONLY = "sign-only"  # only a 1-bit pattern (sign / mask) of the values is needed
    UNKNOWN = "unknown"


class Severity(Name):
    WASTE = "waste"  # memory to reclaim
    WARNING = "warning"  # a correctness hazard
    INFO = "info"  # true, but frees nothing


class Cost(Name):
    """What recomputing a checkpointed block costs, which a plan minimises (``plan(cost=...)``)."""

    FLOPS = "flops"  # its forward FLOPs, counted (any device)
    TIME = "time"  # its forward time, measured on the model's device


class Bound(Name):
    """What a plan's budget bounds (``plan(bound=...)``)."""

    HELD = "held"  # the bytes held after the forward (exact)
    PEAK = "peak"  # the peak of one training step (measured)


STORAGE_KINDS = tuple(StorageKind)
HELD_KINDS = (StorageKind.ACTIVATION, StorageKind.OUTPUT)  # kinds whose bytes autograd holds
FREE_KINDS = (StorageKind.PARAMETER, StorageKind.BUFFER, StorageKind.INPUT, StorageKind.MODULE,
              StorageKind.RESHARDED)  # alive anyway, or (resharded) not alive between forward and backward
MANAGERS = tuple(Manager)
NEEDED, NOT_NEEDED, SIGN_ONLY, UNKNOWN = Verdict.NEEDED, Verdict.NOT_NEEDED, Verdict.SIGN_ONLY, Verdict.UNKNOWN
VERDICTS = tuple(Verdict)
SEVERITIES = tuple(Severity)


@dataclass(frozen=True)
class Leaf:
    """The leaf tensor an AccumulateGrad node accumulates into: a parameter (by name), one of the
    caller's inputs (by position) or another leaf."""

    kind: str  # "param", "input" or "leaf"
    name: str = ""

    @property
    def parameter(self) -> Optional[str]:
        """The parameter's name, or None for any other leaf."""
        return self.name if self.kind == "param" else None

    def __str__(self) -> str:  # the JSON form: "param:fc.weight", "input:0", "leaf"
        return f"{self.kind}:{self.name}" if self.name else self.kind


@dataclass
class SavedTensor:
    """One tensor an autograd node saved for backward, as seen during the audited forward."""

    index: int  # order in which autograd saved it during the forward
    node_id: int  # index into Report.nodes; -1 when the save is not reachable from the outputs
    node: str  # autograd node type, e.g. "ConvolutionBackward0"
    attr: str  # saved attribute, e.g. "input", "result", "saved_tensors[0]"
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32"
    device: str
    numel: int
    itemsize: int
    storage_id: int  # index into Report.storages; -1 when unknown (checkpointed tensors)
    storage_kind: StorageKind
    module: str  # module path running when it was saved ("" is the root module)
    module_class: str
    source: Optional[str]  # "file.py:123" of the innermost frame outside torch
    managed_by: Manager = Manager.AUTOGRAD
    verdict: Verdict = Verdict.UNKNOWN
    proven: bool = False  # True when the verdict comes from the empirical check (verify=True)
    reason: str = ""  # why the verdict holds, in one sentence
    rule: Optional[str] = None  # code of the finding that covers it, if any
    bitpackable: bool = False  # backward needs at most 1 bit per element (a sign pattern or 0/c mask)
    source_index: int = -1  # order in which autograd packed it (-1: not packed by gradaudit)
    storage_offset: int = 0
    stride: tuple[int, ...] = ()
    explained_by: Optional[str] = None  # the rule the op knowledge names for it when unneeded/bit-packable
    unproven: str = ""  # verify=True: why the proof could not settle it ("" when proven or not tried)
    copy_of: Optional[str] = None  # a compiled region's copy of this parameter (its values in a storage of its own)

    @property
    def held(self) -> bool:
        """Autograd holds it until backward: reachable from the outputs and not checkpointed,
        offloaded or managed by anybody else's hooks. (Byte figures also need its storage known:
        ``storage_id >= 0``; sparse saves have none.)"""
        return self.node_id >= 0 and self.managed_by == Manager.AUTOGRAD

    @property
    def view_nbytes(self) -> int:
        """Bytes of the elements the saved view itself covers (numel * itemsize)."""
        return self.numel * self.itemsize

    @property
    def needed(self) -> Optional[bool]:
        """True/False when known; None when no rule or proof decided."""
        if self.verdict == UNKNOWN:
            return None
        return self.verdict != NOT_NEEDED

    def to_dict(self, report: "Report") -> dict[str, Any]:
        """This saved tensor as its JSON object (the report's ``tensors[]``), its storage looked up in ``report``."""
        storage = report.storages[self.storage_id] if self.storage_id >= 0 else None
        return {
            "index": self.index,
            "node": self.node,
            "node_id": self.node_id,
            "attr": self.attr,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "device": self.device,
            "nbytes": storage.nbytes if storage else None,
            "view_nbytes": self.view_nbytes,
            "storage": self.storage_id if storage else None,
            "storage_kind": self.storage_kind,
            "module": self.module,
            "module_class": self.module_class,
            "source": self.source,
            "managed_by": self.managed_by,
            "needed": self.needed,
            "verdict": self.verdict,
            "proven": self.proven,
            "reason": self.reason,
            "rule": self.rule,
            "bitpackable": self.bitpackable,
            "unproven": self.unproven or None,
            "copy_of": self.copy_of,
        }


@dataclass(frozen=True)
class CheckpointRegion:
    """One ``torch.utils.checkpoint`` call of the audited forward, as the rules see it."""

    reentrant: bool
    node_id: int  # its node in Report.nodes (CheckpointFunctionBackward, or the inputs it holds); -1: none
    module: str  # the checkpointed module
    module_class: str
    source: Optional[str]  # the line that called checkpoint
    # reentrant: trainable parameters of the modules that ran in it (or that its function names);
    # its backward builds their part of the graph and gives them gradients, if its node is reached
    parameters: tuple[str, ...] = ()


@dataclass(frozen=True)
class Disagreement:
    """A save where the proof (verify=True) refuted the op knowledge: a bug in gradaudit's
    knowledge, reported so it can be fixed; the proof's verdict is the one used."""

    tensor: int  # SavedTensor.index
    node: str
    attr: str
    module: str
    static: str  # the op knowledge's verdict
    proven: str  # the proof's verdict
    what: str  # what the knowledge claimed that does not hold, in one sentence

    def to_dict(self) -> dict[str, Any]:
        """This disagreement as its JSON object (the report's ``disagreements[]``)."""
        return dataclasses.asdict(self)

    def message(self) -> str:
        """The disagreement in one sentence, as the report prints it."""
        return (f"op knowledge refuted: {self.node}.{self.attr} in {self.module or 'the model'} {self.what}; the proof's "
                f"verdict is used (please report this)")


@dataclass
class Storage:
    """One storage referenced by saved tensors; bytes are counted once per storage."""

    id: int
    nbytes: int
    kind: StorageKind
    module: str  # module of the first save that referenced it (attribution for per-module totals)
    tensors: list[int] = field(default_factory=list)  # SavedTensor.index values referencing it
    # all-gathered data (a collective's result, or a rearrangement of it): the number of ranks it
    # was gathered over, each holding 1/gathered_over of it; 0 when not gathered
    gathered_over: int = 0

    def to_dict(self) -> dict[str, Any]:
        document = dataclasses.asdict(self)
        if not self.gathered_over:  # (only in distributed audits)
            del document["gathered_over"]
        return document


@dataclass(frozen=True)
class AttentionCall:
    """The ``F.scaled_dot_product_attention`` call a node was created in, and the kernel it chose."""

    index: int  # the call's number in the forward
    kernel: str  # "flash", "efficient", "cudnn", "math", ... (torch.nn.attention.SDPBackend, lower case)
    kernel_without_dropout: str  # the kernel the same call picks with dropout_p = 0
    dropout_p: float
    masked: bool  # an attn_mask was passed
    causal: bool
    device: str  # the device type the kernel was chosen for (on meta: the audit's target)
    # what a fused kernel would keep instead: the storages of query, key, value and output as
    # (Report.storages id, or -1 when no save refers to it; bytes), and its float32 logsumexp
    fused_keeps: tuple[tuple[int, int], ...] = ()
    logsumexp_bytes: int = 0
    # (backend, why) for each fused backend tried before the chosen one: known where gradaudit chose
    # the kernel itself (target="cuda" on meta), empty otherwise
    passed_over: tuple[tuple[str, str], ...] = ()

    @property
    def math_fallback(self) -> bool:
        """The unfused kernel ran: it keeps the B x H x L x L probabilities for backward."""
        return self.kernel == "math"


@dataclass
class GraphNode:
    """One autograd node created during the audited forward."""

    id: int
    name: str  # node type, e.g. "AddmmBackward0"
    module: str  # module of its first save ("" when it saved nothing or ran at the root)
    next_ids: list[Optional[int]]  # next_functions as node ids; None = that input needs no gradient
    edge_mask: list[bool]  # which inputs of the op need a gradient
    saved: list[int] = field(default_factory=list)  # SavedTensor.index values
    variable: Optional[Leaf] = None  # AccumulateGrad: the leaf it accumulates into
    scalars: dict[str, Any] = field(default_factory=dict)  # non-tensor saved values (BN "training"...)
    created_here: bool = True  # False: the node predates the audited forward and was not inspected
    attention: Optional[AttentionCall] = None  # made inside F.scaled_dot_product_attention

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["variable"] = str(self.variable) if self.variable is not None else None
        return data


def rule_docs(code: str) -> str:
    """Where rule ``code`` is documented: the command that prints its documentation."""
    return f"gradaudit explain {code}"


DOCS_URL_VARIABLE = "GRADAUDIT_DOCS_URL"


def rule_docs_url(code: str) -> str:
    """The address of rule ``code``'s page: under ``$GRADAUDIT_DOCS_URL`` where the documentation site is
    served (``mkdocs build`` of the repository's ``docs/``), else the page's path in the source
    repository, ``docs/rules/CODE.md``."""
    base = os.environ.get(DOCS_URL_VARIABLE, "").strip()
    return f"{base.rstrip('/')}/rules/{code}/" if base else f"docs/rules/{code}.md"


@dataclass(frozen=True)
class Finding:
    """One piece of memory autograd holds that backward does not need (or needs less of)."""

    code: str  # "GA101"
    name: str  # "conv-input-saved-for-frozen-weight"
    severity: Severity
    message: str
    module: str
    module_class: str
    node: str
    attrs: tuple[str, ...]
    source: Optional[str]
    tensors: tuple[int, ...]  # SavedTensor.index values the finding is about
    bytes: int  # bytes freed by fixing this finding alone (storage-aware)
    bytes_together: int  # this finding's share when every finding is fixed (shares sum to the total)
    fix: str  # one-line fix title
    fix_code: str  # a snippet the user can paste
    fix_safe: bool  # True: gradients stay bit-identical
    proven: bool = False
    # True: the fix is a code change (fused attention, a clone, a detached input) and ``bytes`` is the
    # rule's own figure for it; False: the fix drops or bit-packs the saves in ``tensors`` and the
    # byte figures are the Accountant's
    rewrite: bool = False

    @property
    def docs(self) -> str:
        """Where this finding's rule is documented: the command that prints it."""
        return rule_docs(self.code)

    @property
    def docs_url(self) -> str:
        """The address of this finding's rule page (see ``rule_docs_url``)."""
        return rule_docs_url(self.code)

    def to_dict(self) -> dict[str, Any]:
        """This finding as its JSON object (the report's ``findings[]``)."""
        data = dataclasses.asdict(self)
        data["attrs"] = list(self.attrs)
        data["tensors"] = list(self.tensors)
        data["docs"] = self.docs
        data["docs_url"] = self.docs_url
        return data


@dataclass(frozen=True)
class ModuleCall:
    """One call of a module the audit watched (``audit(watch=...)``; the checkpoint planner's
    candidates): the storages of the tensors it was passed, which a checkpoint of it would hold."""

    path: str
    module_class: str
    # (storage id, bytes, kind) per distinct storage passed in; an id >= len(Report.storages) names
    # a storage no save references (the same id in every call that passed it)
    inputs: tuple[tuple[int, int, StorageKind], ...] = ()
    uncounted: int = 0  # tensors passed in without one storage (sparse layouts): in no byte figure
    # class names of arguments that hold tensors out of reach (a cache object, a dataclass): a
    # checkpoint would keep them through its closure, where no saved-tensor hook sees them
    opaque: tuple[str, ...] = ()
    # (storage id, bytes, kind) per distinct storage of the tensors it returned (ids as for inputs)
    outputs: tuple[tuple[int, int, StorageKind], ...] = ()
    # a tensor it was passed was written in place during the call or after it, before the forward ended
    # (an in-place module, a later op on its input): a checkpoint of it could not recompute it
    inputs_written: bool = False


@dataclass
class ModuleTotal:
    path: str
    module_class: str
    own_bytes: int  # held bytes attributed to this module itself
    total_bytes: int  # including its children
    own_reclaimable_bytes: int
    total_reclaimable_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ModuleChange:
    """One module's own saves compiled and eager (``EagerComparison``)."""

    path: str
    module_class: str
    eager_bytes: int  # held by the saves eager autograd makes in its forward
    compiled_bytes: int  # held by the compiled regions' saves attributed to it

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class EagerComparison:
    """What the same model run eagerly holds, beside what its compiled regions hold
    (``audit(..., compare_eager=True)``): the eager audit's figures and, per module, both."""

    saved_bytes: int
    reclaimable_with_bitpacking_bytes: int
    modules: list[ModuleChange]  # every module either holds something in, largest change first

    def to_dict(self) -> dict[str, Any]:
        return {"saved_bytes": self.saved_bytes,
                "reclaimable_with_bitpacking_bytes": self.reclaimable_with_bitpacking_bytes,
                "modules": [m.to_dict() for m in self.modules]}


@dataclass
class Report:
    """The result of one audit. Plain data; ``to_dict()`` is the JSON form (docs/json.md)."""

    model: str  # class name of the audited model
    torch_version: str
    device: str
    training: bool
    verified: bool
    tensors: list[SavedTensor]
    storages: list[Storage]
    nodes: list[GraphNode]
    modules: list[ModuleTotal]
    findings: list[Finding]
    saved_bytes: int
    reclaimable_bytes: int
    reclaimable_with_bitpacking_bytes: int
    recomputed_bytes: int  # bytes checkpointing recomputes instead of holding (known part)
    offloaded_bytes: int
    parameters_requiring_grad: int
    inputs_requiring_grad: int
    unexplained: list[dict[str, Any]] = field(default_factory=list)  # blind spots
    notes: list[str] = field(default_factory=list)
    disagreements: list[Disagreement] = field(default_factory=list)  # verify=True refuted the op knowledge
    # activations the forward stored on modules as attributes (StorageKind.MODULE), in bytes
    kept_on_modules_bytes: int = 0
    # bytes the selected waste findings' code changes (``Finding.rewrite``) free on top of dropping
    # and bit-packing, each storage counted once
    rewrite_bytes: int = 0
    # the rule code prefixes the audit selected and ignored: the findings and every byte figure
    # above count the selected rules only
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    # calls of the watched modules, in call order (empty unless audit(watch=...) named some)
    module_calls: list[ModuleCall] = field(default_factory=list)
    # the device type the audit stands for: the device it ran on, or for an audit on the meta
    # device the one whose kernel choices it emulated (audit(target=...), "cpu" by default)
    target: str = "cpu"
    # audited as one rank of a distributed run (a fake world, or a real one): its size and this rank
    world_size: int = 1
    rank: int = 0
    # FSDP2 gathered parameters the forward saved: resharded after it (nothing held), gathered again
    # for backward; their bytes once gathered, each storage once
    regathered_bytes: int = 0
    # audit(compare_eager=True) of a compiled model: what the model run eagerly holds, per module too
    eager: Optional[EagerComparison] = None

    @property
    def held_tensors(self) -> list[SavedTensor]:
        """The saved tensors autograd still holds after the forward (those of unused outputs are freed)."""
        return [t for t in self.tensors if t.held]

    @property
    def waste_findings(self) -> list[Finding]:
        """The findings of severity "waste": memory to reclaim."""
        return [f for f in self.findings if f.severity == Severity.WASTE]

    @property
    def reclaimable_with_all_fixes_bytes(self) -> int:
        """Bytes freed when every (selected) waste finding is fixed together: dropping, bit-packing
        and the code changes. The one figure ``--max-reclaimable`` and ``assert_no_waste`` compare."""
        return self.reclaimable_with_bitpacking_bytes + self.rewrite_bytes

    def summary(self) -> dict[str, Any]:
        """The report's headline figures and counts (the JSON document's ``summary``)."""
        held = self.held_tensors
        return {
            "saved_bytes": self.saved_bytes,
            "reclaimable_bytes": self.reclaimable_bytes,
            "reclaimable_with_bitpacking_bytes": self.reclaimable_with_bitpacking_bytes,
            "rewrite_bytes": self.rewrite_bytes,
            "reclaimable_with_all_fixes_bytes": self.reclaimable_with_all_fixes_bytes,
            "recomputed_bytes": self.recomputed_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "kept_on_modules_bytes": self.kept_on_modules_bytes,
            "saved_tensors": len(held),
            "unknown_tensors": sum(1 for t in held if t.verdict == UNKNOWN),
            # held saves without one storage (sparse layouts): not in any byte figure
            "uncounted_tensors": sum(1 for t in held if t.storage_id < 0),
            "findings": len(self.findings),
            "waste_findings": len(self.waste_findings),
            "parameters_requiring_grad": self.parameters_requiring_grad,
            "inputs_requiring_grad": self.inputs_requiring_grad,
        }

    @collecting_only_new()  # (thousands of dicts: a collection they start looks at them, not at the model)
    def to_dict(self) -> dict[str, Any]:
        """The report's JSON document (``gradaudit scan --json``; fields in docs/json.md)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "tool": "gradaudit",
            "model": self.model,
            "torch_version": self.torch_version,
            "device": self.device,
            "target": self.target,
            "training": self.training,
            "verified": self.verified,
            "select": list(self.select),
            "ignore": list(self.ignore),
            "summary": self.summary(),
            "findings": [f.to_dict() for f in self.findings],
            "tensors": [t.to_dict(self) for t in self.tensors],
            "storages": [s.to_dict() for s in self.storages],
            "modules": [m.to_dict() for m in self.modules],
            "nodes": [n.to_dict() for n in self.nodes],
            "unexplained": list(self.unexplained),
            "notes": list(self.notes),
            "disagreements": [d.to_dict() for d in self.disagreements],
            # present only for an audit of one rank of a distributed run
            **({"world": {"size": self.world_size, "rank": self.rank, "regathered_bytes": self.regathered_bytes}}
               if self.world_size > 1 else {}),
            **({"eager": self.eager.to_dict()} if self.eager is not None else {}),
        }

    def __repr__(self) -> str:  # keep the repr short: reports can hold thousands of tensors
        return (
            f"<gradaudit.Report {self.model}: {len(self.held_tensors)} saved tensors, "
            f"saved_bytes={self.saved_bytes}, reclaimable_bytes={self.reclaimable_bytes}, "
            f"{len(self.findings)} findings>"
        )
