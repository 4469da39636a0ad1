"""The SOURCE of a save or finding is a line that explains it, or None ('unknown'): never a frame of
click, pytest, gradaudit or torch, never the line that called ``audit()``.

A model whose forward is its own points at the forward's line; ops run by torch alone inside the
forward (``nn.Sequential`` and the layers in it) point at the line that constructed their layer
when the model was built by the command line (which notes construction lines while the factory
runs), else they are unknown.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradaudit
from gradaudit import loading
from gradaudit.cli import cli
from gradaudit.report import text
from gradaudit.sites import _is_internal, construction_site, noting_construction, short_path

# Each layer's line carries "# built: <module path>"; findings: GA401 (the ReLU's sign-only save),
# GA301 (the max-pool's unread input), GA101 (the frozen convolution's input), on one layer each.
SEQUENTIAL_FILE = textwrap.dedent("""
    import torch
    from torch import nn


    class Square(nn.Conv2d):  # a torch layer subclassed, with torch's forward
        def __init__(self, channels):
            super().__init__(channels, 4, 3)


    def build():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3),  # built: 0
            nn.ReLU(),  # built: 1
            nn.MaxPool2d(2),  # built: 2
            nn.Sequential(
                Square(8),  # built: 3.0
            ),
        )
        model[3].requires_grad_(False)
        return model, torch.randn(2, 3, 32, 32)


    def broken():
        nn.Linear(2, 2)
        raise ValueError("no weights")


    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))  # built: flat
""")


class OwnForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2))

    def forward(self, x):
        return self.body(x).sum()  # own-forward line


def _line_of(text: str, marker: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if line.rstrip().endswith(marker))


def _explains(source, allowed) -> None:
    """A source is None or a line in an allowed file; never click, pytest, gradaudit or torch."""
    if source is None:
        return
    path, _, line = source.rpartition(":")
    assert os.path.basename(path) in allowed, source
    assert line.isdigit(), source
    for internal in ("click", "_pytest", "pluggy", "gradaudit", "torch", "runpy", "importlib"):
        assert f"{internal}/" not in path.replace(os.sep, "/"), source


@pytest.fixture
def runner(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "seqmodels.py").write_text(SEQUENTIAL_FILE)
    return CliRunner()


def _scan(runner, *args):
    result = runner.invoke(cli, ["scan", *args, "--json", "-", "--no-html"], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def test_cli_sequential_findings_point_at_the_line_that_built_their_layer(runner):
    document, summary = _scan(runner, "seqmodels.py:build")
    built = {path: f"seqmodels.py:{_line_of(SEQUENTIAL_FILE, '# built: ' + path)}"
             for path in ("0", "1", "2", "3.0")}
    by_code = {f["code"]: f for f in document["findings"]}
    assert {"GA101", "GA301", "GA401"} <= set(by_code)
    for finding in document["findings"]:
        assert finding["source"] == built[finding["module"]], finding
    for tensor in document["tensors"]:
        _explains(tensor["source"], {"seqmodels.py"})
        assert tensor["source"] == built[tensor["module"]], tensor
    assert "click" not in summary and built["3.0"] in summary


def test_cli_module_object_built_at_import_points_at_its_line(runner):
    document, _ = _scan(runner, "seqmodels.py:flat", "--input-shape", "3,4")
    line = f"seqmodels.py:{_line_of(SEQUENTIAL_FILE, '# built: flat')}"
    assert document["tensors"]
    assert {t["source"] for t in document["tensors"]} == {line}  # one line builds every layer


def test_cli_model_with_its_own_forward_points_at_the_forward(runner, tmp_path):
    (tmp_path / "own.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2))

            def forward(self, x):
                return self.body(x)  # forward


        def build():
            return Net(), torch.randn(2, 3, 16, 16)
    """))
    document, _ = _scan(runner, "own.py:build")
    line = f"own.py:{_line_of((tmp_path / 'own.py').read_text(), '# forward')}"
    assert document["findings"]
    assert {f["source"] for f in document["findings"]} == {line}
    assert {t["source"] for t in document["tensors"]} == {line}


def test_api_sequential_sources_are_unknown_not_the_audit_line():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 4, 3))
    model[3].requires_grad_(False)
    report = gradaudit.audit(model, torch.randn(2, 3, 32, 32))
    assert {f.code for f in report.findings} >= {"GA101", "GA301", "GA401"}
    # the model was built before audit(): where its layers were constructed is not known
    assert {f.source for f in report.findings} == {None}
    assert {t.source for t in report.tensors} == {None}
    rows = [line for line in text.render(report, width=200).splitlines() if line.lstrip().startswith("GA")]
    assert rows and all(row.split()[-1] == "unknown" for row in rows)


def test_api_own_forward_points_at_the_forward_line():
    torch.manual_seed(0)
    report = gradaudit.audit(OwnForward(), torch.randn(2, 3, 16, 16))
    line = _line_of(open(__file__).read(), "# own-forward line")
    assert report.findings
    for item in [*report.findings, *report.tensors]:
        assert item.source is not None and item.source.endswith(f"test_sources.py:{line}"), item


def test_construction_is_noted_only_inside_and_torch_is_put_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "seqmodels.py").write_text(SEQUENTIAL_FILE)
    original = nn.Module.__init__
    with noting_construction():
        inside = nn.Linear(2, 2)  # noted here
    outside = nn.Linear(2, 2)
    assert nn.Module.__init__ is original
    here = _line_of(open(__file__).read(), "# noted here")
    assert construction_site(inside).endswith(f"test_sources.py:{here}")
    assert construction_site(outside) is None
    with pytest.raises(loading.LoadError, match="no weights"):
        loading.build_model("seqmodels.py:broken")
    assert nn.Module.__init__ is original


def test_driver_libraries_are_internal_model_libraries_are_not():
    def code(filename: str):
        return compile("pass", filename, "exec")

    site = os.path.join(os.sep, "env", "lib", "python3.11", "site-packages")
    for driver in ("click/core.py", "_pytest/python.py", "pluggy/_callers.py", "IPython/core/interactiveshell.py"):
        assert _is_internal(code(os.path.join(site, *driver.split("/")))), driver
    assert _is_internal(code(os.path.join(os.path.dirname(os.__file__), "runpy.py")))
    for library in ("transformers/models/bert/modeling_bert.py", "torchvision/models/resnet.py", "timm/layers/mlp.py"):
        assert not _is_internal(code(os.path.join(site, *library.split("/")))), library
    assert not _is_internal(code(os.path.join(os.sep, "home", "me", "model.py")))


def test_installed_files_are_named_by_their_package_path_even_under_the_project():
    # issue 45 item 7: with the venv inside the project (python -m venv .venv, uv's and poetry's default)
    # a torchvision frame used to read ".venv/lib/python3.11/site-packages/torchvision/models/resnet.py"
    project = os.path.join(os.sep, "work", "proj")
    for venv_lib in (os.path.join(project, ".venv", "lib", "python3.11", "site-packages"),
                     os.path.join(os.sep, "usr", "lib", "python3", "dist-packages")):
        resnet = os.path.join(venv_lib, "torchvision", "models", "resnet.py")
        assert short_path(resnet, cwd=project) == os.path.join("torchvision", "models", "resnet.py")
    # the user's own files stay relative to where they ran it, and elsewhere as given
    assert short_path(os.path.join(project, "src", "model.py"), cwd=project) == os.path.join("src", "model.py")
    assert short_path(os.path.join(os.sep, "elsewhere", "model.py"), cwd=project) == "/elsewhere/model.py"
