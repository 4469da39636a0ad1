"""Each rule's claim re-checked against the installed torch by the empirical proof.

If a PyTorch release stops saving a tensor (an upstream fix) or starts reading one a rule calls
unneeded, the fixture's findings under verify=True differ from the static ones and this fails.
"""

import pytest

from gradaudit.records import NOT_NEEDED, SIGN_ONLY
from tests.fixtures.rule_models import FIXTURES
from tests.rule_harness import actual, audit_fixture, expected


# the proof runs backward nodes one by one, which a parallelised model's collectives cannot (audit
# refuses verify in a world): GA602's claim is checked against real gloo runs (tests/test_ranks_gloo.py)
PROVABLE = [f for f in FIXTURES if not getattr(f, "world", 0)]


@pytest.mark.parametrize("fixture", PROVABLE, ids=lambda f: f.__name__)
def test_rule_claims_hold_under_the_proof(fixture):
    report = audit_fixture(fixture, verify=True)
    assert not report.disagreements, report.disagreements
    assert actual(fixture, report) == expected(fixture)
    for finding in report.findings:
        for i in finding.tensors:
            t = report.tensors[i]
            if t.managed_by == "autograd" and t.verdict in (NOT_NEEDED, SIGN_ONLY):
                assert t.proven, (finding.code, t.node, t.attr, t.reason)
