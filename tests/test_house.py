"""The layout's rules, read from the source: each module imports what it needs at its top without a
circle, reads no other module's private names, stays short enough to read, and the independent
measurement the tests trust (``gradaudit.measure``) is imported by no module of the product."""

from __future__ import annotations

import ast
import pathlib

import gradaudit

_PACKAGE = pathlib.Path(gradaudit.__file__).parent
_MODULE_LINES, _FUNCTION_LINES = 800, 80


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(_PACKAGE.rglob("*.py")):
        parts = path.relative_to(_PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _top_level_imports(name: str, path: pathlib.Path) -> list[tuple[str, str]]:
    """(module imported, name taken from it or "") for each import a module runs when it is imported:
    those at its top level, not inside functions or ``if TYPE_CHECKING:``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.append((base, alias.name))
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
    return [(module, taken) for module, taken in found if module.split(".")[0] == "gradaudit"]


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        for module, taken in _top_level_imports(name, path):
            target = f"{module}.{taken}" if f"{module}.{taken}" in MODULES else module
            if target != name and target in MODULES:
                edges.setdefault(name, set()).add(target)
    return edges


def test_the_modules_import_one_another_without_a_circle():
    edges, state, circles = _edges(), {}, []

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(edges.get(name, ())):
            if state.get(target) == "open":
                circles.append(trail[trail.index(target):] + [target] if target in trail else [name, target])
            elif target not in state:
                visit(target, trail + [target])
        state[name] = "done"

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])
    assert len(edges) > 50
    assert not circles, circles


def test_no_module_takes_another_modules_private_names():
    offenders = [f"{name} <- {module}.{taken}" for name, path in MODULES.items()
                 for module, taken in _top_level_imports(name, path)
                 if taken.startswith("_") and not taken.startswith("__")]
    assert not offenders, offenders


def test_the_independent_measurement_is_apart_from_the_product():
    # tests compare gradaudit's figures with gradaudit.measure: a product module that used it would
    # make the comparison one of a measurement with itself
    importers = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and name != "gradaudit.measure":
                base = node.module or ""
                if base.endswith("measure") or any(alias.name == "measure" for alias in node.names):
                    importers.append(name)
    assert not importers, importers


def _lines(function: ast.AST) -> int:
    """A function's lines, its signature and docstring included."""
    return function.end_lineno - function.lineno + 1


def test_modules_and_functions_stay_short_enough_to_read():
    long_modules = [f"{name}: {n}" for name, path in MODULES.items()
                    if (n := len(path.read_text().splitlines())) > _MODULE_LINES]
    long_functions = [f"{name}.{node.name}: {_lines(node)}" for name, path in MODULES.items()
                      for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and _lines(node) > _FUNCTION_LINES]
    assert not long_modules, long_modules
    assert not long_functions, long_functions
