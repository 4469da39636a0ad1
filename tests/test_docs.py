"""The documentation site builds, strictly (a broken link between its pages fails the build),
and every page the README links to exists."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strictly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for page in ("index", "getting-started", "command-line", "python-api", "trim", "plan", "fit", "per-rank",
                 "custom-ops", "testing", "trainers", "numbers", "how-it-works", "accuracy", "limits", "faq", "rules",
                 "rules/GA101", "cli", "api", "json", "benchmarks", "developers"):
        built = tmp_path / "site" / ("index.html" if page == "index" else f"{page}/index.html")
        assert built.is_file(), page


def test_the_generated_pages_are_what_the_code_says():
    """docs/cli.md (every command's --help), docs/rules/CODE.md (every rule's documentation) and docs/api.md
    are generated; a changed option or docstring without a regenerated page fails here."""
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py"), "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_every_public_name_is_documented():
    """Each name of ``gradaudit.__all__`` is in the API reference, and it, each public method and property of
    its classes have a docstring (the generated page says "(no docstring)" otherwise)."""
    import gradaudit

    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert all(f"## `gradaudit.{name}`" in page for name in gradaudit.__all__)
    undocumented = re.findall(r"^#+ `([^`]+)`\n\n(?:```python\n[^\n]*\n```\n\n)?```text\n\(no docstring\)", page, re.M)
    assert not undocumented, f"public names without a docstring: {undocumented}"


def test_the_readmes_links_to_files_of_the_repository_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t}
    assert "docs/json.md" in targets
    missing = sorted(t for t in targets if t and not (ROOT / t).exists())
    assert not missing, f"README.md links to files that do not exist: {missing}"
    # in-page anchors, as GitHub makes them from the headings: lower case, punctuation dropped, - for spaces
    slugs = {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
             for heading in re.findall(r"^#+ (.*)$", readme, re.M)}
    anchors = {t[1:] for t in re.findall(r"\]\((#[^)\s]+)\)", readme)}
    assert anchors <= slugs, f"README.md links to headings it does not have: {sorted(anchors - slugs)}"


def test_every_command_and_option_says_what_it_does():
    """The command line reference (docs/cli.md) is each command's --help: a command or an option without
    its own help text would be a line of the reference that says nothing."""
    import click

    from gradaudit.cli import cli

    silent = [f"{name} {'/'.join(p.opts)}" for name, command in cli.commands.items() for p in command.params
              if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip()]
    silent += [name for name, command in cli.commands.items() if not (command.help or "").strip()]
    assert not silent, f"without help text: {silent}"
    assert len(cli.commands) >= 5
