"""``gradaudit rules`` and ``gradaudit explain``: the rule catalogue, and one rule's documentation."""

from __future__ import annotations

import json
import sys

import click

from .output import EXIT_ERROR


@click.command("rules", short_help="List the rule catalogue.")
@click.option("--json", "as_json", is_flag=True, help="The catalogue as one JSON document on stdout: each rule's "
              "code, name, severity, summary, documentation (whole and by section), fix and fix code.")
def rules_command(as_json: bool) -> None:
    """List the rule catalogue: code, name, severity and what each rule flags."""
    from ..records import rule_docs, rule_docs_url
    from ..rules import all_rules

    catalogue = all_rules()
    if as_json:
        rules = [{"code": r.code, "name": r.name, "severity": r.severity, "family": r.family, "summary": r.summary,
                  "doc": r.doc, "sections": r.sections(), "fix": r.fix, "fix_code": r.fix_code,
                  "fix_safe": r.fix_safe, "docs": rule_docs(r.code), "docs_url": rule_docs_url(r.code)}
                 for r in catalogue]
        click.echo(json.dumps({"tool": "gradaudit", "kind": "rules", "rules": rules}, indent=2))
        return
    name_width = max((len(r.name) for r in catalogue), default=4)
    for r in catalogue:
        click.echo(f"{r.code}  {r.name:<{name_width}}  {r.severity:<7}  {r.summary}")
    click.echo(f"\n{len(catalogue)} rules. `gradaudit explain CODE` prints one rule's documentation.")


@click.command("explain", short_help="Print one rule's documentation.")
@click.argument("code")
def explain(code: str) -> None:
    """Print one rule's documentation, e.g. `gradaudit explain GA101`."""
    from ..rules import all_rules

    wanted = code.strip()
    found = [r for r in all_rules() if r.code == wanted.upper() or r.name == wanted.lower()]
    if not found:
        click.echo(f"gradaudit: error: no rule {code!r}; `gradaudit rules` lists the codes", err=True)
        sys.exit(EXIT_ERROR)
    r = found[0]
    click.echo(f"{r.code} {r.name} ({r.severity})\n")
    click.echo(r.doc)
    if r.fix_code:
        click.echo(f"\nFix ({'gradients stay bit-identical' if r.fix_safe else 'changes numerics'}): {r.fix}")
        click.echo("\n".join("    " + line for line in r.fix_code.splitlines()))
