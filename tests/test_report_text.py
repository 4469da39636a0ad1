"""Terminal reporter: golden output, units, alignment, colour only on request."""

import re

import pytest

from gradaudit.report import text
from gradaudit.report.units import human_bytes, share

ANSI = re.compile(r"\033\[[0-9;]*m")


def test_golden(report, golden):
    golden.assert_golden("report.txt", text.render(report))


@pytest.mark.parametrize("n, expected", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"),
    (1536, "1.5 KiB"),  # 1536 / 1024 = 1.5
    (15872, "15.5 KiB"),  # 15872 / 1024 = 15.5
    (180224, "176 KiB"),  # 180224 / 1024 = 176
    (3 * 1024**3 // 2, "1.5 GiB"), (85130346496, "79.3 GiB"),  # 85130346496 / 2**30 = 79.28
    (-2048, "-2 KiB"),
])
def test_human_bytes(n, expected):
    assert human_bytes(n) == expected


def test_share():
    assert share(8192, 40960) == "20.0%"  # 8192 / 40960 = 0.2
    assert share(1, 10**6) == "<0.1%"
    assert share(5, 0) == "-"


def test_summary_figures(report):
    out = text.render(report)
    # stem_relu result 2*8*16*16*4 = 16384, pool indices (int64) 2*8*8*8*8 = 8192, and four
    # 2*8*8*8*4 = 4096 activations (pool output, block.conv output, block.relu result, head ReLU
    # result): 16384 + 8192 + 4*4096 = 40960 = 40 KiB
    assert report.saved_bytes == 40960
    assert re.search(r"held by autograd\s+40 KiB\s+19 saved tensors", out)
    # GA101 + GA201 frees block.conv's input and block.bn's input, 4096 each: 8192 = 8 KiB = 20%
    assert re.search(r"reclaimable\s+8 KiB\s+20.0%", out)
    assert human_bytes(report.reclaimable_with_bitpacking_bytes) in out


def test_findings_ranked_by_bytes_with_fix(report):
    out = text.render(report)
    rows = [line for line in out.splitlines() if line.startswith("  GA")]
    assert len(rows) == len(report.findings)
    first = max(report.findings, key=lambda f: max(f.bytes, f.bytes_together))
    assert rows[0].split()[0] == first.code
    assert first.module in rows[0] and first.source in rows[0]
    assert f"{first.name}: {first.fix}"[:60] in out


def test_top_limits_rows(report):
    out = text.render(report, top=2)
    assert f"Top findings by bytes (2 of {len(report.findings)})" in out
    assert f"… {len(report.findings) - 2} more" in out
    assert sum(1 for line in out.splitlines() if line.startswith("  GA")) == 2


def test_columns_aligned_and_width_respected(report):
    out = text.render(report, width=80)
    assert max(len(line) for line in out.splitlines() if not line.startswith("note:")) <= 80
    lines = out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("CODE"))
    rows = [line for line in lines if line.startswith("  GA")]
    for column in ("ALONE", "ALL FIXES"):  # right-aligned: every figure ends under the header's end
        end = header.index(column) + len(column)
        for row in rows:
            assert row[end - 1] == "B" and row[end] == " ", (column, row)


def test_colour_only_when_asked(report):
    plain = text.render(report)
    coloured = text.render(report, color=True)
    assert "\033[" not in plain
    assert "\033[31m" in coloured  # waste codes in red
    assert ANSI.sub("", coloured) == plain  # colour never shifts a column


def test_no_findings_message(report):
    import dataclasses
    clean = dataclasses.replace(report, findings=[])
    assert "No findings" in text.render(clean)


def test_a_finding_without_a_source_line_says_unknown():
    """GA901 about a module that never ran has no line to point at: the column says so."""
    import torch
    from torch import nn

    import gradaudit

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.spare = nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    out = text.render(gradaudit.audit(Unused(), torch.randn(2, 4)), width=200)
    row, = [line for line in out.splitlines() if line.lstrip().startswith("GA901")]
    assert row.split()[-1] == "unknown" and "spare (Linear)" in row
