"""The one declaration per autograd node type: what its backward reads of each saved tensor.

A declaration names the node's gradient edges (the op's differentiable inputs, in
``next_functions`` order) and says, per saved attribute, what backward reads of it and for
which gradients (a ``Read``). Everything else derives from it:

- the audit's verdicts (``outcome``): not needed when no gradient that reads a save is wanted,
  or when backward reads only its shape; sign-only / two-valued saves are bit-packable;
- which rule explains a save that is not needed or bit-packable (``Read.rule``);
- ``trim``'s action per save (drop, drop with a zero-stride placeholder, bit-pack and how);
- the proof's hint (``witness_edges``): one gradient to compute alone to show a read cheaply;
- which save holds a layer's weight (``weight_slot``);
- the verdict on a save hidden inside CopySlices by an in-place op on a view (``in_place``: the
  functions that may create the node there, ``hidden_by``; one function may make one of several
  node types, by release or by its arguments: ``x[mask] = 0`` is IndexPutBackward0 on torch 2.14,
  MaskedFillBackward0 on 2.15).

Variants: an op whose reads depend on a non-tensor saved value (batch norm's ``training``)
declares one variant per value (``when={"training": False}``); a node whose values match no
variant gets no verdict ("unknown"). Declaring the same node name with the same ``when`` twice
raises, as registering one rule code twice does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from ..errors import DeclarationError
from ..records import NEEDED, NOT_NEEDED, SIGN_ONLY

__all__ = ["Reads", "Bit", "Read", "Declaration", "Outcome", "declare", "declare_function",
           "declaration", "declarations", "declared_ops"]


class Reads(enum.Enum):
    """What backward reads of a saved tensor (when a gradient that reads it is wanted)."""

    VALUES = "values"  # the values
    SHAPE = "shape"  # only shape, dtype and memory format: never the values
    SIGN = "sign"  # one bit per element: a comparison with 0 (see Bit)
    MASK = "mask"  # the values, which hold only 0 and one positive constant (see Read.only_in)
    BOOL = "bool"  # the values of a bool tensor (a keep-mask): one bit per element holds them exactly
    NOTHING = "nothing"  # nothing at all


class Bit(enum.Enum):
    """Which comparison with zero a SIGN read makes (and so which bit a packed save keeps):
    NOT_LE_ZERO (``threshold_backward``), GT_ZERO (``leaky_relu_backward``), NE_ZERO (NOT_LE_ZERO on a
    save that is never negative, such as relu's result: the cheapest to pack), BOOL (a bool save's
    own values)."""

    NOT_LE_ZERO = "not x <= 0"  # threshold_backward(grad, x, 0): x <= 0 ? 0 : grad (NaN passes)
    GT_ZERO = "x > 0"  # leaky_relu_backward: x > 0 ? grad : grad * slope (NaN takes the slope)
    # a save that is never negative (relu's result): there x <= 0 only where x is 0, so NOT_LE_ZERO's
    # bit is x != 0 (NaN passes both), which one conversion to bool makes and one back unpacks
    NE_ZERO = "x != 0"
    BOOL = "x"  # a bool tensor's own values (a BOOL read: needed, each element one bit)


@dataclass(frozen=True)
class Read:
    """What backward reads of one saved attribute.

    by: names of the gradient edges whose formulas read it (see ``Declaration.edges``); when
        none of them is wanted the save is not needed. Empty: read whenever the node runs.
    reads: what those formulas read of it (Reads).
    bit: for Reads.SIGN, the comparison made.
    only_in: for Reads.MASK, the module classes where the saved tensor is such a mask (a dropout's
        keep-mask); elsewhere, and when the save itself needs a gradient, it is plain VALUES.
    rule: the finding code that explains the save whenever it is not needed or bit-packable
        (required for such reads; a test checks the rule exists).
    why / unread: the verdict's reason when read / when not read (default: from the edges).
    witness: the one gradient to compute alone to show the read cheaply: a speed hint for the
        proof (a wrong one costs time, not verdicts). Opt-in, op by op: computing one gradient
        alone must work on every supported torch (torch 2.13's group norm backward crashes when
        asked for the weight gradient alone).
    sometimes: for a VALUES read that happens only for some values (``pow(0, x)`` reads x,
        ``pow(2, x)`` does not): why, so the proof finding it unread on one case is no contradiction.
    """

    by: tuple[str, ...] = ()
    reads: Reads = Reads.VALUES
    bit: Optional[Bit] = None
    only_in: tuple[str, ...] = ()
    rule: Optional[str] = None
    why: str = ""
    unread: str = ""
    witness: Optional[str] = None
    sometimes: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.by, str):
            object.__setattr__(self, "by", (self.by,))
        if (self.reads is Reads.SIGN) != (self.bit is not None):
            raise DeclarationError("a SIGN read names its comparison (bit=Bit...), and only a SIGN read does")
        if (self.reads is Reads.MASK) != bool(self.only_in):
            raise DeclarationError("a MASK read names the module classes where it holds (only_in=...)")
        if self.reads is Reads.BOOL and self.by:
            raise DeclarationError("a BOOL read is needed whenever the node runs (no by=...)")
        if self.rule is None and (self.reads is not Reads.VALUES or self.by):
            raise DeclarationError("a read that can leave a save unneeded or bit-packable names the rule "
                             "that explains it (rule='GA...')")


@dataclass(frozen=True)
class Outcome:
    """The verdict on one save, and what ``trim`` may do with it."""

    verdict: str  # records.NEEDED / NOT_NEEDED / SIGN_ONLY
    reason: str
    bitpackable: bool = False
    bit: Optional[Bit] = None  # bit-packable: Bit for a sign or a bool tensor; None for a two-valued mask
    shape_only: bool = False  # not needed and only its shape is read: a zero-stride stand-in does
    rule: Optional[str] = None  # the finding code explaining it (not needed or bit-packable)


@dataclass(frozen=True)
class Declaration:
    """Everything gradaudit knows about one autograd node type (one variant of it)."""

    name: str
    edges: tuple[str, ...]
    saves: Mapping[str, Read]
    default: Optional[Read] = None  # for saved attributes not named in ``saves``
    when: Mapping[str, Any] = field(default_factory=dict)
    weight: Optional[str] = None  # the saved attribute that holds a layer's weight
    source: str = ""  # where the claims come from (derivatives.yaml, a kernel, an issue)
    # Python-level functions whose in-place call on a view creates this node hidden inside a
    # CopySlices node (which exposes none of its saves): function name -> the attributes it may
    # save (several where which one depends on the inputs that need a gradient, as for mul_)
    in_place: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # for the node of a library's custom autograd.Function declared by name (libraries.py): the
    # package that defines it; empty for torch's own node types and for declare_function
    library: str = ""

    def read(self, attr: str) -> Optional[Read]:
        found = self.saves.get(attr)
        if found is None and attr.endswith("]") and "[" in attr:
            # an item of a saved list (IndexPutBackward0's indices[1]) reads like the list
            found = self.saves.get(attr[:attr.index("[")])
        return found if found is not None else self.default

    def edge(self, name: str) -> int:
        return self.edges.index(name)

    def matches(self, scalars: Mapping[str, Any]) -> bool:
        return all(key in scalars and _same(scalars[key], value) for key, value in self.when.items())

    def outcome(self, attr: str, edge_mask: Sequence[bool], module_class: str = "",
                dtype: str = "") -> Optional[Outcome]:
        """The verdict on saved ``attr`` given which edges need a gradient; None: not declared."""
        read = self.read(attr)
        if read is None:
            return None
        wanted = [name for name in read.by if self._wanted(name, edge_mask)]
        if read.by and not wanted or read.reads is Reads.NOTHING:
            return Outcome(NOT_NEEDED, read.unread or self._unread_reason(attr, read), rule=read.rule)
        if read.reads is Reads.SHAPE:
            return Outcome(NOT_NEEDED, read.unread or "the backward reads only its shape",
                           shape_only=True, rule=read.rule)
        why = read.why or (f"read by the {' and '.join(wanted)} gradient{'s' if len(wanted) > 1 else ''}"
                           if wanted else "read by the gradient formula of an input that needs a gradient")
        if read.reads is Reads.SIGN:
            return Outcome(SIGN_ONLY, why, bitpackable=True, bit=read.bit, rule=read.rule)
        if read.reads is Reads.BOOL and dtype == "bool":
            return Outcome(NEEDED, f"{why}; a bool tensor spends a byte per element on one bit", bitpackable=True,
                           bit=Bit.BOOL, rule=read.rule)
        if (read.reads is Reads.MASK and module_class in read.only_in and dtype in FLOATS
                and not (attr in self.edges and self._wanted(attr, edge_mask))):
            return Outcome(NEEDED, f"{why}; it holds only 0 and one constant (1/(1-p) for dropout), so one "
                                   f"bit per element would do", bitpackable=True, rule=read.rule)
        return Outcome(NEEDED, why)

    def witness_edges(self, attr: str, edge_mask: Sequence[bool]) -> Optional[tuple[int, ...]]:
        """The declared witness edge for ``attr`` when that gradient is wanted (None: no hint)."""
        read = self.read(attr)
        if read is None or read.witness is None or not self._wanted(read.witness, edge_mask):
            return None
        return (self.edge(read.witness),)

    def _wanted(self, edge_name: str, edge_mask: Sequence[bool]) -> bool:
        i = self.edge(edge_name)
        return i < len(edge_mask) and bool(edge_mask[i])

    @staticmethod
    def _unread_reason(attr: str, read: Read) -> str:
        if read.reads is Reads.NOTHING:
            return "the backward never reads it"
        readers = " and ".join(read.by)
        plural = "s" if len(read.by) > 1 else ""
        needs = "need" if len(read.by) > 1 else "needs"
        return f"only the {readers} gradient{plural} read{'' if plural else 's'} the {attr}, and the {readers} {needs} no gradient"


FLOATS = ("float16", "bfloat16", "float32", "float64")


def _same(actual: Any, wanted: Any) -> bool:
    # True == 1 in Python: a boolean flag must match a boolean
    if isinstance(wanted, bool) or isinstance(actual, bool):
        return type(actual) is type(wanted) and actual == wanted
    return actual == wanted


_DECLARED: dict[str, list[Declaration]] = {}


def declare(*names: str, edges: Sequence[str], saves: Optional[Mapping[str, Read]] = None,
            default: Optional[Read] = None, when: Optional[Mapping[str, Any]] = None,
            weight: Optional[str] = None, source: str = "",
            in_place: Optional[Mapping[str, Union[str, Sequence[str]]]] = None, library: str = "") -> list[Declaration]:
    """Declare what backward reads for the autograd node types ``names`` (one variant each).

    ``edges``: the names of the op's gradient edges in ``next_functions`` order; ``saves``:
    saved attribute -> Read; ``default``: the Read of saved attributes not listed; ``when``: the
    non-tensor saved values this variant applies to; ``weight``: the saved attribute holding a
    layer's weight; ``in_place``: function name -> the saved attribute (or the attributes, when
    which one is saved depends on the inputs that need a gradient), for the functions whose
    in-place call on a view may hide this node inside CopySlices; a function that makes one of
    several node types (by release or by its arguments) is named by each of them, and a hidden
    save gets a verdict only when every node and attribute named for its function gives the same
    one. A node type names a function for one variant only: a hidden save has no scalars to
    choose a variant by. ``library``: the package whose custom autograd.Function makes the node,
    declared by name without importing it; another package's Function of the same class name
    makes a node of the same name, so such a declaration may say only "needed" (what can cost a
    finding, never a gradient). Raises ValueError on a second declaration of a name with the same
    ``when``, a Read naming an edge not in ``edges``, an in-place function naming an undeclared
    save or already named by a variant of the same node, ``in_place`` given for several names, or a library's
    declaration with a read that can leave a save unneeded or bit-packable.
    """
    saves = dict(saves or {})
    when = dict(when or {})
    hiding = {function: (attrs,) if isinstance(attrs, str) else tuple(attrs)
              for function, attrs in (in_place or {}).items()}
    if hiding and len(names) > 1:
        raise DeclarationError(f"{', '.join(names)}: in_place names the functions that create one node type; "
                               f"declare it alone")
    for function, attrs in hiding.items():
        if not attrs:
            raise DeclarationError(f"{names[0]}: in-place {function} names no saved attribute")
        for attr in attrs:
            if attr not in saves:
                raise DeclarationError(f"{names[0]}: in-place {function} saves {attr!r}, which is not a declared save")
        if any(variant.name == names[0] for variant, _ in hidden_by(function)):
            # a hidden save has no scalars: one variant of a node per function
            raise DeclarationError(f"{names[0]}: in-place {function} already hides a variant of {names[0]}")
    for attr, read in [*saves.items(), *([("<default>", default)] if default else [])]:
        for edge in (*read.by, *([read.witness] if read.witness else [])):
            if edge not in edges:
                raise DeclarationError(f"{names[0]}.{attr}: edge {edge!r} is not one of {tuple(edges)}")
    if library and (default is not None or any(read != Read(why=read.why) for read in saves.values())):
        raise DeclarationError(f"{names[0]}: a declaration by name of {library}'s Function may only say "
                               f"what backward reads whenever the node runs (Read(why=...)): a Function of "
                               f"the same name elsewhere gets the same verdicts")
    if weight is not None and weight not in saves:
        raise DeclarationError(f"{names[0]}: weight slot {weight!r} is not a declared save")
    made = []
    for name in names:
        variants = _DECLARED.setdefault(name, [])
        if any(v.when == when for v in variants):
            raise DeclarationError(f"op knowledge for {name} (when={when}) declared twice")
        declaration = Declaration(name, tuple(edges), saves, default, when, weight, source, hiding, library)
        variants.append(declaration)
        # the most specific variant first; among equals, the first declared
        variants.sort(key=lambda v: -len(v.when))
        made.append(declaration)
    return made


def declare_function(function: type, *, edges: Sequence[str], saves: Sequence[Read], source: str = "") -> Declaration:
    """Declare a custom ``torch.autograd.Function``: ``saves`` in ``ctx.save_for_backward`` order,
    ``edges`` its ``forward`` arguments after ``ctx``. The node is ``<Function name>Backward``."""
    declared = declare(f"{function.__name__}Backward", edges=edges,
                       saves={f"saved_tensors[{i}]": read for i, read in enumerate(saves)}, source=source)
    return declared[0]


def declaration(name: str, scalars: Mapping[str, Any] = {}) -> Optional[Declaration]:  # noqa: B006
    """The variant of ``name`` whose ``when`` the node's scalars match (None: unknown)."""
    for variant in _DECLARED.get(name, ()):
        if variant.matches(scalars):
            return variant
    return None


def hidden_by(function: Optional[str]) -> tuple[tuple[Declaration, tuple[str, ...]], ...]:
    """The declarations (each with the saved attributes it may be) of the nodes an in-place call of
    ``function`` on a view may create inside CopySlices, in declaration order; empty when no
    declaration names the function."""
    if not function:
        return ()
    return tuple((variant, variant.in_place[function]) for variants in _DECLARED.values()
                 for variant in variants if function in variant.in_place)


def declarations() -> list[Declaration]:
    return [v for name in sorted(_DECLARED) for v in _DECLARED[name]]


def declared_ops() -> list[str]:
    return sorted(_DECLARED)


def scalars_read(name: str) -> tuple[str, ...]:
    """The non-tensor saved values a node type's variants are chosen by."""
    keys: list[str] = []
    for variant in _DECLARED.get(name, ()):
        keys.extend(k for k in variant.when if k not in keys)
    return tuple(keys)


def weight_slots() -> dict[str, str]:
    """Node type -> the saved attribute holding a layer's weight."""
    return {v.name: v.weight for v in declarations() if v.weight}


def weight_slot(name: str) -> Optional[str]:
    """``weight_slots().get(name)`` for one node type, without listing every declaration."""
    slot = None
    for variant in _DECLARED.get(name, ()):
        if variant.weight:
            slot = variant.weight  # the last variant naming one, as in weight_slots()
    return slot


def forget(names: Iterable[str]) -> None:
    """Remove declarations (tests that declare their own ops clean up with this)."""
    for name in names:
        _DECLARED.pop(name, None)
