"""The Python examples of the README and of the documentation pages run.

Every ```python block of README.md and docs/*.md (the generated reference pages aside; the rule pages'
code, docs/rules/, is the rules' docstrings, which tests/test_rule_examples.py runs) is executed, after the setup an HTML
comment before it names (``<!-- example: setup=mlp -->``: the names the block uses, made here), or
alone where none is named, in a folder of its own. A block that is only illustrative says so the same
way, with why (``<!-- illustrative: ... -->``), and is not run; its reason must be given, and such
blocks stay few. Test functions a block defines are called.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import gradaudit
from test_knowledge import ScaleByWeight  # the custom-ops page's Function: y = x * w, saving both

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"api.md", "cli.md"}  # and docs/rules/, outside the glob below
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in GENERATED)]
BLOCK = re.compile(r"^([ \t]*)```python\n(.*?)^\1```", re.M | re.S)
MARK = re.compile(r"<!-- (example: setup=(\w+)|illustrative: (.+?)) -->\s*$")


def blocks():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.search(before)
            yield pytest.param(page.name, line, textwrap.dedent(match.group(2)),
                               mark.group(2) if mark else None, mark.group(3) if mark else None,
                               id=f"{page.name}:{line}")


class MyLayer(nn.Module):
    """A layer that keeps only what its backward needs but for its ReLU's float result (GA401)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return torch.relu(x * self.scale)


def _mlp() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model[0].requires_grad_(False)
    x = torch.randn(8, 16)
    return {"model": model, "inputs": x, "x": x}


def _llama(device: str = "cpu") -> dict:
    """A 4-layer Llama from the tiny config, in training as users fine-tune it (``use_cache=False``, a
    batch of 2 x 16 token ids with a padded attention mask and labels): ``model``, ``inputs``/``batch``.
    On ``meta`` (the fit guide's, standing for a GPU) built under the meta device."""
    import transformers

    from conftest import TINY_HF

    config_class, model_class, arguments = TINY_HF["llama"]
    config = getattr(transformers, config_class)(**{**arguments, "num_hidden_layers": 4, "use_cache": False})
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_class)(config).train()
    ids = torch.randint(0, 100, (2, 16), device=device)
    mask = torch.ones(2, 16, dtype=torch.long, device=device)
    mask[1, 12:] = 0  # the second sequence ends in padding
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    return {"model": model, "inputs": batch, "batch": batch}


SETUPS = {
    "llama": _llama,
    "llama_meta": lambda: _llama("meta"),
    "mlp": _mlp,
    "layer": lambda: {"MyLayer": MyLayer, "torch": torch, "no_waste": gradaudit.assert_no_waste,
                      "gradaudit_audit": gradaudit.audit},
    "function": lambda: {"ScaleByWeight": ScaleByWeight},
}


@pytest.mark.parametrize("page, line, code, setup, illustrative", [b for b in blocks() if b.values[4] is None])
def test_the_example_runs(page, line, code, setup, illustrative, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what an example writes (a trainer's output folder) stays out of the tree
    assert setup is None or setup in SETUPS, f"{page}:{line}: no setup {setup!r} (have: {sorted(SETUPS)})"
    namespace = {"__name__": f"example_{page}_{line}", "torch": torch, "nn": nn, "gradaudit": gradaudit,
                 **(SETUPS[setup]() if setup else {})}
    try:
        exec(compile(code, f"{page}:{line}", "exec"), namespace)
        for name, value in list(namespace.items()):
            if name.startswith("test_") and callable(value):
                arguments = value.__code__.co_varnames[:value.__code__.co_argcount]
                value(*(namespace[a] for a in arguments))
    finally:
        if setup == "function":
            from gradaudit.knowledge.registry import forget

            forget(["ScaleByWeightBackward"])


def test_every_block_is_run_or_says_why_not():
    """The illustrative ones are few and each says why (a count that grows is noticed here)."""
    found = list(blocks())
    illustrative = [(b.values[0], b.values[1], b.values[4]) for b in found if b.values[4] is not None]
    assert all(len(reason.split()) >= 3 for _, _, reason in illustrative), illustrative
    assert len(found) >= 10 and len(illustrative) <= len(found) // 2, illustrative
