"""pytest plugin registered through the ``pytest11`` entry point (see gradaudit.testing).

pytest loads it in every test run of an environment where gradaudit is installed, so it defines
names only; the audit machinery is imported when a test asks for the fixture.

    def test_layer_holds_only_what_backward_needs(no_waste):
        no_waste(MyLayer(), torch.randn(8, 64), allow=["GA401"])
"""

import pytest


@pytest.fixture
def no_waste():
    """``gradaudit.assert_no_waste``: fails the test with the list of waste findings."""
    from gradaudit.testing import assert_no_waste

    return assert_no_waste


@pytest.fixture
def gradaudit_audit():
    """``gradaudit.audit``, for tests that assert on the report themselves."""
    from gradaudit import audit

    return audit
