"""Every rule's Example section (``gradaudit explain CODE``) is a snippet that runs and makes its rule fire.

An example is documentation a user copies: one that does not trigger its rule (GA101's once froze
everything but ``layer4``, which gives no GA101 finding at all) teaches the opposite of the rule.
Each snippet may assume ``torch``, ``nn``, ``F`` (torch.nn.functional), ``torchvision`` and
``gradaudit``; it defines its own model and inputs and ends by auditing into ``report``.
"""

from __future__ import annotations

import ast

import pytest

from gradaudit.rules.registry import all_rules

RULES = all_rules()


def example(r) -> str:
    return r.sections()["Example"]


def ends_by_auditing(tree: ast.Module) -> bool:
    """Is the snippet's last statement ``report = gradaudit.audit(...)`` (possibly inside ``with``)?"""
    last = tree.body[-1] if tree.body else None
    while isinstance(last, ast.With):  # with torch.autocast(...): report = gradaudit.audit(...)
        last = last.body[-1]
    return (isinstance(last, ast.Assign) and [getattr(t, "id", None) for t in last.targets] == ["report"]
            and isinstance(last.value, ast.Call) and isinstance(last.value.func, ast.Attribute)
            and last.value.func.attr == "audit" and getattr(last.value.func.value, "id", None) == "gradaudit")


@pytest.mark.parametrize("r", RULES, ids=lambda r: r.code)
def test_example_is_code_that_audits_into_report(r):
    source = example(r)
    try:
        tree = ast.parse(source, filename=f"<{r.code} Example>")
    except SyntaxError as error:  # prose, or a fragment that is not a whole program
        pytest.fail(f"{r.code}'s Example section is not runnable Python ({error.msg}, line {error.lineno}):\n{source}")
    assert ends_by_auditing(tree), f"{r.code}'s Example must end with `report = gradaudit.audit(model, x)`:\n{source}"


def test_a_prose_example_is_refused():
    with pytest.raises(SyntaxError):
        ast.parse("A custom ``autograd.Function`` that saves x but reads only y.")
    assert not ends_by_auditing(ast.parse("y = model(x)\nreport = model(x)"))
    assert not ends_by_auditing(ast.parse("report = gradaudit.audit(model, x)\nreport.findings"))
    assert ends_by_auditing(ast.parse("with torch.no_grad():\n    report = gradaudit.audit(model, x)"))


def run_example(r):
    import torch
    import torch.nn.functional as F
    from torch import nn

    import gradaudit

    source = example(r)
    namespace = {"__name__": f"example_{r.code}", "torch": torch, "nn": nn, "F": F, "gradaudit": gradaudit}
    if "torchvision" in source:
        namespace["torchvision"] = pytest.importorskip("torchvision")
    if "torch.compile" in source:
        # a fresh compile: dynamo's recompile limit counts per code object (nn.Sequential's forward)
        # across the whole suite, and past it runs the model eagerly
        torch._dynamo.reset()
    exec(compile(source, f"<{r.code} Example>", "exec"), namespace)
    report = namespace.get("report")
    assert isinstance(report, gradaudit.Report), f"{r.code}'s Example defines no report"
    return report


# GA901's example is the hazard checkpoint warns about itself
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")
@pytest.mark.parametrize("r", RULES, ids=lambda r: r.code)
def test_example_makes_its_rule_fire(r):
    report = run_example(r)
    found = [f for f in report.findings if f.code == r.code]
    assert found, (f"{r.code}'s Example gives no {r.code} finding; it gives "
                   f"{sorted({f.code for f in report.findings})}:\n{example(r)}")
    assert all(f.name == r.name for f in found)


def test_ga101_example_says_which_convolutions_it_flags():
    # only layer4 trainable gives no GA101 finding (nothing trainable upstream of a frozen conv);
    # only layer1 trainable flags every frozen conv after it, as the example's comment says
    report = run_example(next(r for r in RULES if r.code == "GA101"))
    flagged = sorted(f.module for f in report.findings if f.code == "GA101")
    torchvision = pytest.importorskip("torchvision")
    later = ("layer2", "layer3", "layer4")
    convs = sorted(name for name, m in torchvision.models.resnet18().named_modules()
                   if type(m).__name__ == "Conv2d" and name.startswith(later))
    assert flagged == convs and len(flagged) == 15
