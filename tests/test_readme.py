"""README.md and the documentation pages (docs/) agree with the code they describe."""

import re
from pathlib import Path

from gradaudit.rules import all_rules

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = README.parent / "docs"
# a table row whose first cell is a rule code, linked to its page: | [GA101](rules/GA101.md) | conv-input-... | ... |
RULE_ROW = re.compile(r"^\|\s*\[?(GA\d+)\]?(?:\(rules/\1\.md\))?\s*\|\s*`?([^|`]*?)`?\s*\|", re.M)


def _rows(rows) -> str:
    return ", ".join(f"{code} {name}" for code, name in rows) or "none"


def test_rule_table_lists_exactly_the_registered_rules_in_code_order():
    listed = RULE_ROW.findall((DOCS / "rules.md").read_text(encoding="utf-8"))
    registered = [(r.code, r.name) for r in all_rules()]
    missing = [row for row in registered if row not in listed]
    extra = [row for row in listed if row not in registered]
    assert not missing and not extra, (
        f"docs/rules.md's rule table disagrees with gradaudit.rules.all_rules(): "
        f"missing rows: {_rows(missing)}; rows for no registered rule: {_rows(extra)}")
    assert listed == registered, (
        f"docs/rules.md's rule table lists the rules as {_rows(listed)}; all_rules() (code order) gives "
        f"{_rows(registered)}")


def test_the_developer_page_names_every_module_of_the_package():
    section = (DOCS / "developers.md").read_text(encoding="utf-8")
    package = README.parent / "gradaudit"
    modules = sorted(str(path.relative_to(README.parent)) for path in package.rglob("*.py")
                     if path.name != "__init__.py")
    named = set(re.findall(r"`(gradaudit/[\w/]+\.py)`", section))
    # a bullet may name a package folder and its files by name: `gradaudit/trimming/`: `codec.py` ...
    for bullet in re.split(r"\n(?=- )", section):
        for folder in re.findall(r"`(gradaudit/\w+/)`", bullet):
            named.update(folder + name for name in re.findall(r"`(\w+\.py)`", bullet))
    missing = [m for m in modules if m not in named]
    assert not missing, f"docs/developers.md does not name: {missing}"
