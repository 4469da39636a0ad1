"""Every rule documents itself in the fixed sections, and the registry refuses inconsistent entries."""

import pytest

from gradaudit.rules.registry import DOC_SECTIONS, all_rules, get_rule, rule


@pytest.mark.parametrize("r", all_rules(), ids=lambda r: r.code)
def test_rule_docstring_has_every_section(r):
    sections = r.sections()
    assert list(sections) == list(DOC_SECTIONS)
    assert all(text.strip() for text in sections.values())
    assert r.summary and r.fix and r.fix_code
    compile(r.fix_code, r.code, "exec")


def test_codes_name_their_family():
    families = {r.code: r.family for r in all_rules()}
    assert families["GA000"] == 0 and families["GA402"] == 4 and families["GA801"] == 8
    assert get_rule("ga101").name == "conv-input-saved-for-frozen-weight"


def test_duplicate_code_raises():
    with pytest.raises(ValueError):
        rule("GA101", "another-name", fix="x")(lambda ctx: ())
