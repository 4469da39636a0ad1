"""The project as installed and as checked out: one version, the HTML templates found either way."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gradaudit

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_installed_distributions():
    try:
        installed = importlib.metadata.version("gradaudit")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("gradaudit is not installed (tests run from a checkout)")
    assert gradaudit.__version__ == installed, (
        "gradaudit.__version__ and the installed metadata differ: reinstall (pip install -e .)")


def test_pyproject_takes_the_version_from_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gradaudit.__version__"}


RENDER = textwrap.dedent("""
    import importlib.util, json
    import torch
    import gradaudit
    from gradaudit.report import html

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    document = html.render(gradaudit.audit(model, torch.randn(2, 4)))
    print(json.dumps({"file": gradaudit.__file__, "document": document,
                      "templates_package": importlib.util.find_spec("gradaudit.templates") is not None}))
""")


def test_html_renders_from_a_checkout_that_is_not_installed(tmp_path):
    # gradaudit/ and templates/ copied side by side, as in a checkout. `python -S` skips the site
    # hooks (an editable install's finder would serve gradaudit.templates from this repository);
    # the interpreter's own search path, minus this checkout, still provides torch and jinja2.
    for folder in ("gradaudit", "templates"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    # every path but those that would provide gradaudit (this checkout): a virtual environment inside the
    # checkout (.venv, CI's .ci/venv-*) still provides torch
    elsewhere = [p for p in sys.path if p and Path(p).is_dir() and not (Path(p) / "gradaudit" / "__init__.py").exists()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *elsewhere])}
    result = subprocess.run([sys.executable, "-S", "-c", RENDER], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    assert Path(out["file"]).resolve().is_relative_to(tmp_path.resolve())
    assert not out["templates_package"]  # so the templates came from tmp_path/templates
    assert out["document"].startswith("<!DOCTYPE html>") and "TanhBackward0" in out["document"]


def test_every_subpackage_is_shipped():
    # a package missing from this list installs without it: `pip install .` then fails at the
    # first import of it (gradaudit.planning once did), while an editable install hides that
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    shipped = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "gradaudit").rglob("__init__.py")}
    assert found <= shipped, sorted(found - shipped)


def test_the_test_extra_installs_every_package_a_test_may_skip_without():
    # CI installs '.[test]' and runs every test: a test that skips for a package the extra does not
    # install never runs there
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    import re

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    installed = {re.split(r"[<>=!~\[ ;]", requirement)[0] for requirement in extras["test"]}  # name before version, extra or marker
    installed |= {"torch"}  # a dependency of gradaudit itself
    skipped_without = set()
    for test_file in (ROOT / "tests").glob("*.py"):
        for module in re.findall(r"importorskip\(\"([\w.]+)\"", test_file.read_text(encoding="utf-8")):
            top = module.split(".")[0]
            if top not in sys.stdlib_module_names:
                skipped_without.add(top)
    assert skipped_without <= installed, sorted(skipped_without - installed)
    # each trainer callback's extra brings what its Trainer needs to run
    assert {"transformers", "accelerate"} <= {re.split(r"[<>=!~ ]", r)[0] for r in extras["transformers"]}
    assert {"lightning"} <= {re.split(r"[<>=!~ ]", r)[0] for r in extras["lightning"]}
