"""Reads ``# expect: GAxxx`` comments in fixture models and compares them with an audit's findings."""

from __future__ import annotations

import inspect
import os
import re
from collections import Counter

import gradaudit

EXPECT = re.compile(r"#\s*expect:\s*(GA\d{3}(?:\s*,\s*GA\d{3})*)")


def expected(fixture) -> Counter:
    """(line, code) pairs written next to the code of one fixture class."""
    lines, first = inspect.getsourcelines(fixture)
    found = Counter()
    for offset, text in enumerate(lines):
        match = EXPECT.search(text)
        if match:
            for code in re.split(r"\s*,\s*", match.group(1)):
                found[(first + offset, code)] += 1
    return found


def actual(fixture, report) -> Counter:
    """(line, code) of every finding whose source line is in the fixture's file.

    Findings without a source line (rules about parameters, GA901) take the line of the fixture's
    expectation with the same code, if there is one.
    """
    filename = os.path.basename(inspect.getsourcefile(fixture))
    wanted = expected(fixture)
    found = Counter()
    for finding in report.findings:
        if finding.source is None:
            lines = [line for line, code in wanted if code == finding.code]
            found[(lines[0] if lines else None, finding.code)] += 1
            continue
        path, _, line = finding.source.rpartition(":")
        if os.path.basename(path) == filename:
            found[(int(line), finding.code)] += 1
        else:
            found[(finding.source, finding.code)] += 1
    # one expectation per line and code: several findings on one line (e.g. per module) count once
    return Counter(set(found))


def audit_fixture(fixture, **overrides):
    model, inputs, options = fixture.build()
    options = {**options, **overrides}
    return gradaudit.audit(model, inputs, **options)
