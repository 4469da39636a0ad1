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


def test_op_knowledge_reads_only_the_scalars_it_declares():
    # gradaudit.trim reads (and keys its decision cache on) only the declared scalars; a knowledge
    # function reading an undeclared one would see it missing there and decide differently.
    import itertools

    from gradaudit.knowledge import declaration, declared_ops, scalars_read

    class DeclaredOnly(dict):
        def __init__(self, declared, values):
            super().__init__(values)
            self.declared = declared

        def _check(self, key):
            assert key in self.declared, f"reads undeclared scalar {key!r}"

        def get(self, key, default=None):
            self._check(key)
            return super().get(key, default)

        def __getitem__(self, key):
            self._check(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            self._check(key)
            return super().__contains__(key)

    samples = (True, False, 0, 0.5, None)
    for name in declared_ops():
        declared = scalars_read(name)
        for values in itertools.product(samples, repeat=len(declared)):
            known = declaration(name, DeclaredOnly(declared, dict(zip(declared, values))))
            for mask in itertools.product((False, True), repeat=3):
                for attr in (known.saves if known else ()):
                    known.outcome(attr, list(mask))
