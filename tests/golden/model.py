"""The small deterministic model behind the reporters' golden files and the browser test.

Frozen conv/BN/pool in front of a trainable head, so the report has GA101-style waste, sign-only
ReLU saves, parameters (free) and an input that needs no gradient. Loaded by tests/conftest.py.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

import gradaudit


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


class Tiny(nn.Module):
    def __init__(self, name: str = "head") -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stem_relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.block = Block(8)
        self.add_module(name, nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()))
        self.fc = nn.Linear(8 * 8 * 8, 10)
        self.head_name = name

    def forward(self, x):
        x = self.pool(self.stem_relu(self.stem(x)))
        x = self.block(x)
        x = getattr(self, self.head_name)(x)
        return self.fc(x.flatten(1))


# A head module named like this must show as text in every report, never as markup. (Line
# numbers above this point appear in the golden files.)
MARKUP = "<script>alert(1)</script>"


def build_report(head_name: str = "head") -> gradaudit.Report:
    torch.manual_seed(0)
    model = Tiny(head_name).eval().requires_grad_(False)
    model.stem.requires_grad_(True)  # trainable stem: everything after it must pass gradients back
    getattr(model, head_name).requires_grad_(True)
    model.fc.requires_grad_(True)
    x = torch.randn(2, 3, 16, 16)
    return normalise(gradaudit.audit(model, x))


def _source(source):
    if source is None:
        return None
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}"


def normalise(report: gradaudit.Report) -> gradaudit.Report:
    """Golden files must not depend on the torch build or where the checkout lives."""
    report.torch_version = "TORCH"
    for t in report.tensors:
        t.source = _source(t.source)
    report.findings = [dataclasses.replace(f, source=_source(f.source)) for f in report.findings]
    return report


GOLDEN_DIR = os.path.dirname(os.path.abspath(__file__))


def assert_golden(name: str, text: str) -> None:
    """Compare with tests/golden/<name>; GRADAUDIT_UPDATE_GOLDEN=1 rewrites the file instead."""
    path = os.path.join(GOLDEN_DIR, name)
    if os.environ.get("GRADAUDIT_UPDATE_GOLDEN") == "1":
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        return
    assert os.path.exists(path), f"no golden file {name}; run with GRADAUDIT_UPDATE_GOLDEN=1 to create it"
    with open(path, encoding="utf-8") as handle:
        expected = handle.read()
    assert text == expected, (f"{name} differs from the golden file; if the change is intended, "
                              f"regenerate with GRADAUDIT_UPDATE_GOLDEN=1 and review the diff")
