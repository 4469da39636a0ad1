"""Reads ``# expect: GAxxx`` comments in fixture models and compares them with an audit's findings.

An expectation may also carry the finding's bytes (freed by fixing it alone) and a fragment of its
message, beside the code that causes it (as pylint's functional tests keep messages beside code):

    x = self.conv(x)  # expect: GA101 bytes=3136 "input for a weight gradient nobody asked for"
"""

from __future__ import annotations

import contextlib

import inspect
import os
import re
from collections import Counter

import torch

import gradaudit

EXPECT = re.compile(r"#\s*expect:\s*(GA\d{3}(?:\s*,\s*GA\d{3})*)")
DETAILS = re.compile(r"#\s*expect:\s*(GA\d{3})(?:\s+bytes=(\d+))?(?:\s+\"([^\"]*)\")?")


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


def expected_details(fixture) -> dict:
    """(line, code) -> (bytes or None, message fragment or None), for expectations that carry them."""
    lines, first = inspect.getsourcelines(fixture)
    found = {}
    for offset, text in enumerate(lines):
        match = DETAILS.search(text)
        if match and (match.group(2) or match.group(3)):
            nbytes = int(match.group(2)) if match.group(2) else None
            found[(first + offset, match.group(1))] = (nbytes, match.group(3))
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
    """A fixture with ``world = n`` is built and audited as rank 0 of a fake world of n."""
    world = gradaudit.fake_world(fixture.world) if getattr(fixture, "world", 0) else contextlib.nullcontext()
    with world:
        model, inputs, options = fixture.build()
        if type(model).__name__ == "OptimizedModule":
            # a fresh compile: dynamo's recompile limit counts across the suite, and past it the
            # model runs eagerly
            torch._dynamo.reset()
        options = {**options, **overrides}
        return gradaudit.audit(model, inputs, **options)
