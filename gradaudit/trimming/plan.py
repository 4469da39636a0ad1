"""The plan of ``trim``: per autograd node type, what to do with each save, derived from the op
knowledge's declaration and cached per (module class, edge mask, declared scalars, saves)."""

from __future__ import annotations

from typing import Any, Optional

from ..knowledge import declaration, declared_ops, scalars_read
from ..records import NOT_NEEDED
from ..tensors import dtype_name
from .codec import PACKERS, scaled_mask
from ..torchapi.autograd import is_custom_function, node_scalars, slot_names

class NodeKind:
    """What deciding needs about one autograd node type, found once per type."""

    __slots__ = ("name", "slots", "declared", "scalars", "plans")

    def __init__(self, node: Any) -> None:
        self.name = type(node).__name__
        # (attribute, getter) per tensor slot; None for custom Functions (their own listing)
        self.slots: Optional[tuple[str, ...]] = None
        if not is_custom_function(node):
            self.slots = slot_names(node)[0]
        self.declared = self.name in _declared_names()
        # reading every scalar of every node costs more than the rest of a decision: read only
        # those the op knowledge chooses its variants by
        self.scalars = scalars_read(self.name)
        self.plans: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # see plan_for


def _declared_names() -> set[str]:
    return set(declared_ops())


KINDS: dict[type, NodeKind] = {}


def kind_of(node: Any) -> NodeKind:
    kind = KINDS.get(type(node))
    if kind is None:
        kind = KINDS[type(node)] = NodeKind(node)
    return kind


KEEP = None


def plan_for(kind: NodeKind, node: Any, module_class: str, boxes: list[tuple[str, Any]]) -> tuple[Any, ...]:
    """Per save of ``node``: KEEP, a bool (not needed; True when backward reads only its shape)
    or the packer of a bit-packable save. Cached: the op knowledge's outcome is a pure function of
    the node type, the scalars its variants are chosen by, its edge mask, the module's class and
    the saves' attributes and dtypes.
    """
    scalars = node_scalars(node, kind.scalars) if kind.scalars else {}
    key = (module_class, tuple([fn is not None for fn, _ in node.next_functions]),
           tuple([(k, tuple(v) if type(v) is list else v) for k, v in scalars.items()]),
           tuple([(attr, box.dtype) for attr, box in boxes]))
    plan = kind.plans.get(key)
    if plan is not None:
        return plan
    known = declaration(kind.name, scalars)
    actions = []
    for attr, box in boxes:
        outcome = known.outcome(attr, key[1], module_class, dtype_name(box.dtype)) if known else None
        if outcome is None:
            actions.append(KEEP)
        elif outcome.verdict == NOT_NEEDED:
            actions.append(outcome.shape_only)
        elif outcome.bitpackable:
            actions.append(PACKERS[outcome.bit] if outcome.bit is not None else scaled_mask)
        else:
            actions.append(KEEP)
    if len(kind.plans) > 4096:
        kind.plans.clear()
    plan = kind.plans[key] = tuple(actions)
    return plan
