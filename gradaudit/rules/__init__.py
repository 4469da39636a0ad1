"""The rule catalogue; importing this package registers it (and declares the op knowledge)."""

from .. import knowledge  # noqa: F401  (the verdicts the rules read come from its declarations)
from . import catalogue  # noqa: F401  (registration happens on import)
from .registry import Flag, Rule, RuleContext, all_rules, get_rule, parse_sections, selected

__all__ = ["Flag", "Rule", "RuleContext", "all_rules", "get_rule", "parse_sections", "selected"]
