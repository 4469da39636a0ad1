"""One registry for rules: a decorator fills it, duplicate codes raise, docs come from docstrings.

Rules (``@rule("GA101", "conv-input-saved-for-frozen-weight")``) read the verdicts and the graph
and emit flags; the analysis turns flags into Findings with storage-aware byte figures. The
verdicts come from the op knowledge (gradaudit/knowledge), whose declarations also name the rule
that explains each save they leave unneeded or bit-packable (``RuleContext.claims``).
Rules are pure functions of the recording's plain data: they never touch tensors or hooks.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

from ..accounting import Accountant
from ..errors import RuleError, UnknownCodeError, UnknownRuleError
from ..records import HELD_KINDS, SEVERITIES, CheckpointRegion, GraphNode, SavedTensor, Severity

DOC_SECTIONS = ("What it flags", "Why it costs memory", "Example", "Fix", "Fix safety", "Known limits")
CODE_PATTERN = re.compile(r"^GA\d{3}$")
NAME_PATTERN = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclass
class Flag:
    """What a rule reports; the analysis adds bytes and turns it into a Finding."""

    node: Optional[GraphNode]
    tensors: Sequence[SavedTensor]
    message: str
    fix: Optional[str] = None  # default: the rule's fix title
    fix_code: Optional[str] = None  # default: the rule's fix snippet
    module: Optional[str] = None  # default: the node's module
    module_class: Optional[str] = None  # default: the first tensor's module class
    source: Optional[str] = None  # default: the first tensor's source line
    severity: Optional[str] = None  # default: the rule's severity
    bytes: Optional[int] = None  # override storage-derived bytes (e.g. what SDPA would save)


@dataclass
class RuleContext:
    """What a rule can read: plain data only."""

    tensors: list[SavedTensor]
    nodes: list[GraphNode]
    storages: list[Any]
    covered: set[int] = field(default_factory=set)  # tensor indices already in a finding
    parameter_names: dict[str, bool] = field(default_factory=dict)  # name -> requires_grad
    training: bool = False
    module_classes: dict[str, str] = field(default_factory=dict)  # module path -> class name
    checkpoints: list[CheckpointRegion] = field(default_factory=list)  # torch.utils.checkpoint calls
    accountant: Optional[Accountant] = field(default=None, repr=False)  # built from the above if None
    # what-if measurements made by the audit (bytes held by a forward run otherwise), by name:
    #   "held_without_attention_dropout": every scaled_dot_product_attention call with dropout_p=0
    measured: dict[str, int] = field(default_factory=dict)
    # built on first use from the plain data above, which rules only read: the held saves, and per
    # rule code the nodes whose held saves the op knowledge explains by it (see ``claims``)
    _held: Optional[list[SavedTensor]] = field(default=None, init=False, repr=False, compare=False)
    _claimed: Optional[dict[str, list[tuple[GraphNode, list[SavedTensor]]]]] = field(
        default=None, init=False, repr=False, compare=False)

    def nodes_named(self, *names: str) -> Iterator[GraphNode]:
        wanted = set(names)
        return (n for n in self.nodes if n.name in wanted and n.created_here)

    def claims(self, code: str, verdict: str, *, bitpackable: bool = False
               ) -> Iterator[tuple[GraphNode, list[SavedTensor]]]:
        """Per node: the held saves (activations or outputs) with ``verdict`` whose op knowledge
        names rule ``code`` as their explanation (``bitpackable``: only bit-packable ones)."""
        if self._claimed is None:
            self._claimed = self._claims_by_code()
        for node, candidates in self._claimed.get(code, ()):
            hits = [t for t in candidates if t.verdict == verdict and (t.bitpackable or not bitpackable)]
            if hits:
                yield node, hits

    def _claims_by_code(self) -> dict[str, list[tuple[GraphNode, list[SavedTensor]]]]:
        """Rule code -> (node, its held saves whose op knowledge names that rule) in node order,
        saves in the node's order: every rule asks ``claims``, and most saves name no rule."""
        claimed: dict[str, list[tuple[GraphNode, list[SavedTensor]]]] = {}
        tensors = self.tensors
        for node in self.nodes:
            if not node.created_here:
                continue
            by_code: dict[str, list[SavedTensor]] = {}
            for i in node.saved:
                t = tensors[i]
                if t.explained_by is not None and t.held and t.storage_kind in HELD_KINDS:
                    by_code.setdefault(t.explained_by, []).append(t)
            for code, hits in by_code.items():
                claimed.setdefault(code, []).append((node, hits))
        return claimed

    def saved(self, node: GraphNode) -> dict[str, SavedTensor]:
        return {self.tensors[i].attr: self.tensors[i] for i in node.saved}

    def held(self) -> Iterator[SavedTensor]:
        if self._held is None:
            self._held = [t for t in self.tensors if t.held]
        return iter(self._held)

    def freed_by_storage(self, indices: Iterable[int]) -> dict[int, int]:
        """Storage id -> bytes freed if the saves ``indices`` were gone (storage-aware: a storage
        counts only when every held save of it is among them and it is an activation)."""
        return self._accounts().freed_by_storage(set(indices))

    def storage_refs(self, storage_id: int) -> list[SavedTensor]:
        return list(self._accounts().refs.get(storage_id, ()))

    def _accounts(self) -> Accountant:
        if self.accountant is None:
            self.accountant = Accountant(self.tensors, self.storages)
        return self.accountant


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    severity: str
    summary: str  # first docstring line
    doc: str  # the whole docstring, sections included
    fix: str  # fix title
    fix_code: str
    fix_safe: bool
    check: Callable[[RuleContext], Iterable[Flag]]
    catch_all: bool = False  # runs after every other rule: it reports what none of them covered

    @property
    def family(self) -> int:
        return int(self.code[2])

    def sections(self) -> dict[str, str]:
        return parse_sections(self.doc)


_RULES: dict[str, Rule] = {}


def rule(code: str, name: str, *, severity: Severity = Severity.WASTE, fix: str, fix_code: str = "",
         fix_safe: bool = True, catch_all: bool = False) -> Callable[[Callable[[RuleContext], Iterable[Flag]]], Callable]:
    """Register a rule. Its docstring is its documentation (sections: DOC_SECTIONS)."""
    if not CODE_PATTERN.match(code):
        raise RuleError(f"rule code {code!r} must look like GA123")
    if not NAME_PATTERN.match(name):
        raise RuleError(f"rule name {name!r} must be kebab-case")
    if severity not in SEVERITIES:
        raise RuleError(f"severity {severity!r} not in {SEVERITIES}")

    def register(check: Callable[[RuleContext], Iterable[Flag]]) -> Callable:
        if code in _RULES:
            raise RuleError(f"rule code {code} registered twice")
        if any(r.name == name for r in _RULES.values()):
            raise RuleError(f"rule name {name} registered twice")
        doc = inspect.cleandoc(check.__doc__ or "")
        _RULES[code] = Rule(code, name, severity, doc.splitlines()[0] if doc else "", doc,
                            fix, inspect.cleandoc(fix_code) if fix_code else "", fix_safe, check, catch_all)
        return check

    return register


def claims_rule(code: str, name: str, verdict: str, *, bitpackable: bool = False, each: bool = False,
                when: Optional[Callable[[list[SavedTensor]], bool]] = None, **options: Any) -> Callable:
    """Register a rule that only reports the saves the op knowledge names it for: per node, the held
    saves with ``verdict`` (``bitpackable``: only bit-packable ones) whose declaration names ``code``
    (``RuleContext.claims``), one flag per node (``each``: per save), skipping nodes whose saves
    ``when`` refuses. The decorated function gives a flag's message from its node and saves; its
    docstring is the rule's documentation; ``options`` are ``rule``'s."""
    def register(message: Callable[[GraphNode, list[SavedTensor]], str]) -> Callable:
        def check(ctx: RuleContext) -> Iterator[Flag]:
            for node, hits in ctx.claims(code, verdict, bitpackable=bitpackable):
                if when is None or when(hits):
                    for saves in ([t] for t in hits) if each else [hits]:
                        yield Flag(node, saves, message(node, saves))

        functools.update_wrapper(check, message)
        return rule(code, name, **options)(check)

    return register


def all_rules() -> list[Rule]:
    return [_RULES[c] for c in sorted(_RULES)]


def get_rule(code: str) -> Rule:
    code = code.upper()
    if code not in _RULES:
        raise UnknownRuleError(f"no rule has code {code}; `gradaudit rules` lists them")
    return _RULES[code]


def parse_sections(doc: str) -> dict[str, str]:
    """Split a rule docstring into its named sections ("What it flags:" ... ), each dedented: the
    Example section is then a runnable snippet (tests/test_rule_examples.py runs every one)."""
    sections: dict[str, str] = {}
    current: Optional[str] = None
    lines: list[str] = []
    for line in doc.splitlines()[1:]:
        header = line.rstrip().rstrip(":")
        if line.rstrip().endswith(":") and header in DOC_SECTIONS:
            if current:
                sections[current] = textwrap.dedent("\n".join(lines)).strip()
            current, lines = header, []
        elif current:
            lines.append(line)
    if current:
        sections[current] = textwrap.dedent("\n".join(lines)).strip()
    return sections


def selected(code: str, select: Sequence[str] = (), ignore: Sequence[str] = ()) -> bool:
    """Prefix selection, longest matching prefix wins; ties go to select."""
    if not select and not ignore:  # the default: every rule
        return True
    best_select = max((len(p) for p in select if code.startswith(p.upper())), default=-1)
    best_ignore = max((len(p) for p in ignore if code.startswith(p.upper())), default=-1)
    if not select:
        best_select = 0
    return best_select >= best_ignore if best_select >= 0 else False


def code_prefixes(codes: Union[str, Sequence[str], None]) -> tuple[str, ...]:
    """``"GA1,ga301"`` or ``["GA1", "ga301"]`` -> ("GA1", "GA301"): a lone string is a list of one
    comma-separated entry, not of its characters."""
    if codes is None:
        return ()
    if isinstance(codes, str):
        codes = (codes,)
    return tuple(part.strip().upper() for c in codes for part in str(c).split(",") if part.strip())


def check_codes(codes: Union[str, Sequence[str], None], label: str) -> tuple[str, ...]:
    """``code_prefixes(codes)``, each checked to be a prefix of at least one rule code.

    An unknown entry (``GA4O1``, ``GA9999``) would select or ignore nothing without a word, and a CI
    gate would silently check something else than written; ``label`` names the option in the
    one-line error (``--ignore``, ``allow entry``).
    """
    entries = code_prefixes(codes)
    if not entries:  # nothing to check (the default)
        return entries
    known = [r.code for r in all_rules()]
    for entry in entries:
        if any(code.startswith(entry) for code in known):
            continue
        near = difflib.get_close_matches(entry, known, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise UnknownCodeError(f"{label} {entry}: no rule code starts with {entry}{hint}; codes are "
                               f"{known[0]}..{known[-1]}, `gradaudit rules` lists them")
    return entries
