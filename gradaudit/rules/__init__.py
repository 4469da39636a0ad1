"""Op knowledge and the rule catalogue; importing this package registers both."""

from . import ops, catalogue  # noqa: F401  (registration happens on import)
from .registry import Flag, Rule, RuleContext, all_rules, get_rule, known_ops, parse_sections, selected

__all__ = ["Flag", "Rule", "RuleContext", "all_rules", "get_rule", "known_ops", "parse_sections", "selected"]
