"""Write the documentation pages generated from the code, so they cannot drift from it:
- ``docs/cli.md``: every command's ``--help``, as click prints it;
- ``docs/api.md``: every public name of ``gradaudit.__all__``, its signature and docstring, a class's
  public methods and properties too;
- ``docs/rules/CODE.md``: one page per rule, what ``gradaudit explain`` prints, from the rule registry,
  and their entries in mkdocs.yml's navigation;
- ``docs/json.md``'s tables of fields and ``docs/schemas/``, from ``gradaudit.schemas``;
- in any page, each ``<!-- output (torch V): gradaudit ... -->`` block: what that command prints;
- in README.md, between its ``scan-output`` markers: what ``gradaudit scan
  examples/resnet_surgical.py:build`` prints.
Command outputs name the torch they ran on, and their figures are that release's CPU kernels':
``--check`` compares them only where that torch is installed.

    python docs/generate.py           # rewrite the pages
    python docs/generate.py --check   # exit 1, naming the pages, when one differs from what the code says

tests/test_docs.py runs ``--check``: change a command's options or a rule's docstring, then run this.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
COMMANDS = ((), ("scan",), ("plan",), ("fit",), ("rules",), ("explain",))
WIDTH = 100  # the help's width, fixed so the page does not depend on the terminal that ran this


def cli_page() -> str:
    from click.testing import CliRunner

    from gradaudit.cli import cli

    parts = ["# Command line reference", "",
             "Every command's `--help`, generated from the code by `python docs/generate.py`.", ""]
    for command in COMMANDS:
        result = CliRunner().invoke(cli, [*command, "--help"], terminal_width=WIDTH, prog_name="gradaudit")
        assert result.exit_code == 0, result.output
        parts += [f"## `gradaudit{''.join(' ' + c for c in command)}`", "", "```text",
                  result.output.rstrip("\n"), "```", ""]
    return "\n".join(parts)


def between(text: str, start: str, end: str, lines: list[str]) -> str:
    """``text`` with what lies between its markers ``start`` and ``end`` replaced by ``lines``, one a line."""
    before, rest = text.split(start, 1)
    _, after = rest.split(end, 1)
    return "\n".join([before + start, *lines, end]) + after


SECTIONS_AS_CODE = {"Example": "python"}  # the rest of a rule's sections are prose


def rule_page(rule) -> str:
    """One rule's page: what ``gradaudit explain CODE`` prints (its sections, its example as Python), its
    fix and how to select or ignore it."""
    parts = [f"# {rule.code} {rule.name}", "",
             f"Severity: **{rule.severity}**. {rule.summary}", ""]
    for title, body in rule.sections().items():
        body = body.rstrip("\n")
        parts += [f"## {title}", ""]
        parts += ([f"```{SECTIONS_AS_CODE[title]}", body, "```", ""] if title in SECTIONS_AS_CODE
                  else [body, ""])
    if rule.fix_code:
        safety = "gradients stay bit-identical" if rule.fix_safe else "changes numerics"
        parts += ["## The fix, as code", "", f"{rule.fix} ({safety})", "", "```python", rule.fix_code.rstrip("\n"),
                  "```", ""]
    parts += ["## On the command line", "",
              f"`gradaudit explain {rule.code}` prints this page's sections; `gradaudit scan ... --ignore {rule.code}` "
              f"leaves the rule out (`--select {rule.code[:3]}` keeps only its family). The example above runs in "
              "the test suite and must make the rule fire (`tests/test_rule_examples.py`).", ""]
    return "\n".join(parts)


def rule_pages() -> dict[str, str]:
    """``rules/CODE.md`` for every rule of the registry, generated from it."""
    from gradaudit.rules import all_rules

    return {f"rules/{rule.code}.md": rule_page(rule) for rule in all_rules()}


MKDOCS = DOCS.parent / "mkdocs.yml"
NAV_START, NAV_END = "      # rule pages: start (python docs/generate.py)", "      # rule pages: end"


def mkdocs_with_rule_pages() -> str:
    """mkdocs.yml with the navigation listing every rule page, between its markers."""
    from gradaudit.rules import all_rules

    entries = [f"      - {rule.code} {rule.name}: rules/{rule.code}.md" for rule in all_rules()]
    return between(MKDOCS.read_text(encoding="utf-8"), NAV_START, NAV_END, entries)


def _entry(title: str, obj: object, level: str) -> list[str]:
    """A heading, the signature where it has one, and the docstring (or says it has none)."""
    import inspect

    try:
        signature = f"{title.rsplit('.', 1)[-1]}{inspect.signature(obj)}"  # type: ignore[arg-type]
    except (TypeError, ValueError):
        signature = None
    doc = inspect.getdoc(obj) or "(no docstring)"
    lines = [f"{level} `{title}`", ""]
    if signature is not None:
        lines += ["```python", signature, "```", ""]
    return lines + ["```text", doc, "```", ""]


def api_page() -> str:
    import enum
    import inspect

    import gradaudit

    parts = ["# Python API reference", "",
             "Every public name of `gradaudit` (`gradaudit.__all__`), its signature and docstring, generated "
             "by `python docs/generate.py`.", ""]
    for name in gradaudit.__all__:
        obj = getattr(gradaudit, name)
        if isinstance(obj, (str, int)):
            parts += [f"## `gradaudit.{name}`", "", f"`{obj!r}`", ""]
            continue
        parts += _entry(f"gradaudit.{name}", obj, "##")
        if inspect.isclass(obj) and not issubclass(obj, (BaseException, enum.Enum)):
            for member, value in vars(obj).items():
                if member.startswith("_") or not (inspect.isfunction(value) or isinstance(value, property)):
                    continue
                target = value.fget if isinstance(value, property) else value
                parts += _entry(f"{name}.{member}", target, "###")
    return "\n".join(parts)


def _field_rows(fields: dict, prefix: str = "") -> list[str]:
    """A table row per field, its nested fields after it (``findings[].code``)."""
    rows = []
    for name, spec in fields.items():
        kind = " or ".join(spec.type) if isinstance(spec.type, tuple) else spec.type
        if "array" in spec.type and spec.fields is None:
            kind += f" of {' or '.join(spec.items) if isinstance(spec.items, tuple) else spec.items}"
        when = " (not always present)" if spec.optional else ""
        rows.append(f"| `{prefix}{name}` | {kind} | {spec.description}{when} |")
        if spec.fields is not None:
            rows += _field_rows(spec.fields, f"{prefix}{name}{'[]' if 'array' in spec.type else ''}.")
    return rows


def json_page() -> str:
    """docs/json.md with each document's table of fields, from ``gradaudit.schemas``, between its markers."""
    from gradaudit.schemas import DOCUMENTS

    text = (DOCS / "json.md").read_text(encoding="utf-8")
    for kind, fields in DOCUMENTS.items():
        table = ["| field | type | meaning |", "|---|---|---|", *_field_rows(fields)]
        text = between(text, f"<!-- fields:{kind}:start -->", f"<!-- fields:{kind}:end -->", table)
    return text


def schema_files() -> dict[str, str]:
    """docs/schemas/KIND.schema.json, the JSON Schema of each document, from ``gradaudit.schemas``."""
    import json

    from gradaudit.schemas import DOCUMENTS, json_schema

    return {f"schemas/{kind}.schema.json": json.dumps(json_schema(kind), indent=2) for kind in DOCUMENTS}


PAGES = {"cli.md": cli_page, "api.md": api_page, "json.md": json_page}
README = DOCS.parent / "README.md"
START, END = "<!-- scan-output:start -->", "<!-- scan-output:end -->"


def scan_output() -> str:
    """What ``gradaudit scan examples/resnet_surgical.py:build`` prints, as a terminal 106 columns wide
    would show it (run in a folder of its own, where it writes its HTML report)."""
    import os
    import subprocess
    import tempfile

    example = DOCS.parent / "examples" / "resnet_surgical.py"
    with tempfile.TemporaryDirectory() as folder:
        result = subprocess.run([sys.executable, "-m", "gradaudit", "scan", f"{example}:build"], cwd=folder,
                                capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "106"})
    if result.returncode != 0:
        raise SystemExit(f"docs/generate.py: the scan failed: {result.stderr.strip()}")
    return result.stdout.rstrip("\n")


def readme_with(output: str) -> str:
    return between(README.read_text(encoding="utf-8"), START, END, ["```text", output, "```"])


def readme_check() -> bool:
    """Whether README.md's scan output is what the scan prints; True where the torch it names is not
    the one installed (its figures are that release's)."""
    import torch

    text = README.read_text(encoding="utf-8")
    shown = text.split(START, 1)[1].split(END, 1)[0]
    if f"(torch {torch.__version__}," not in shown:
        return True
    return text == readme_with(scan_output())


OUTPUT = re.compile(r"<!-- output \(torch (?P<torch>[^)]+)\): (?P<command>gradaudit [^\n]*?) -->\n"
                    r"```text\n(?:.*?\n)?```\n", re.S)


def command_output(command: str) -> str:
    """What ``command`` (a ``gradaudit ...`` line, run from the repository's root as a user would, in a
    terminal 106 columns wide) prints on stdout; exit 0 or 1 (a verdict) expected."""
    import os
    import shlex
    import subprocess

    result = subprocess.run([sys.executable, "-m", "gradaudit", *shlex.split(command)[1:]], cwd=DOCS.parent,
                            capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "106"})
    if result.returncode not in (0, 1):
        raise SystemExit(f"docs/generate.py: {command!r} failed: {result.stderr.strip()}")
    return result.stdout.rstrip("\n")


def with_outputs(text: str, check: bool) -> str:
    """``text`` with each ``<!-- output (torch V): gradaudit ... -->`` block holding what the command
    prints, the torch installed named in its marker. Checking, a block made on another torch is left as it
    is (its figures are that release's kernels')."""
    import torch

    def block(match: re.Match) -> str:
        if check and match["torch"] != torch.__version__:
            return match[0]
        command = match["command"]
        return (f"<!-- output (torch {torch.__version__}): {command} -->\n```text\n$ {command}\n"
                f"{command_output(command)}\n```\n")

    return OUTPUT.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = parser.parse_args(argv)
    stale = []
    pages = {name: make() for name, make in PAGES.items()} | rule_pages() | schema_files()
    for path in sorted(DOCS.glob("*.md")):  # the pages with command outputs
        text = pages.get(path.name, path.read_text(encoding="utf-8"))
        if OUTPUT.search(text):
            pages[path.name] = with_outputs(text, args.check)
    written = {DOCS / name: text for name, text in pages.items()} | {MKDOCS: mkdocs_with_rule_pages()}
    for path, text in written.items():
        text = text.rstrip("\n") + "\n"
        name = str(path.relative_to(DOCS.parent))
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text, encoding="utf-8")
    orphans = sorted(set((DOCS / "rules").glob("*.md")) - set(written))
    if args.check:
        stale += [f"{path.relative_to(DOCS.parent)} (no such rule)" for path in orphans]
        if not readme_check():
            stale.append("README.md's scan output")
    else:
        for path in orphans:
            path.unlink()
        README.write_text(readme_with(scan_output()), encoding="utf-8")
    if stale:
        print(f"docs/generate.py --check: {', '.join(stale)} differ from the code: run python docs/generate.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
