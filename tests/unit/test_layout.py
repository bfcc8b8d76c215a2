"""The code's layout rules that no linter checks for us, read from the source with `ast`: no module
reaches into another's private names (the import-linter contract in pyproject.toml guards which
modules may import which; this guards what they take), and no function grows past 60 lines."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"ravnest": ROOT / "worker" / "ravnest",
           "ravnest_operator": ROOT / "operator" / "ravnest_operator"}
MAX_FUNCTION_LINES = 60


def _modules() -> Iterator[tuple[str, Path]]:
    """Every module of ours (dotted name, file), less the generated protobuf code."""
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            if "_pb2" in path.name:
                continue
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


MODULES = dict(_modules())
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The dotted module a `from ... import` in `module` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if module in PACKAGES else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _private_uses(module: str, where: str, text: str) -> Iterator[str]:
    """`where:line: what` for each private name of another of our modules that `module` (whose
    source is `text`) takes: `from x import _name`, or `x._name` where `x` is bound to one of
    our modules."""
    tree = ast.parse(text, filename=where)
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in SOURCES:
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        first = alias.name.split(".")[0]
                        bound[first] = first
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source.split(".")[0] not in SOURCES or source == module:
                continue
            for alias in node.names:
                if _private(alias.name):
                    yield f"{where}:{node.lineno}: from {source} import {alias.name}"
                elif f"{source}.{alias.name}" in MODULES:
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        chain = _dotted(node.value)
        if chain is None or chain.split(".")[0] not in bound:
            continue
        target = ".".join([bound[chain.split(".")[0]], *chain.split(".")[1:]])
        if target in MODULES and target != module:
            yield f"{where}:{node.lineno}: {target}.{node.attr}"


def test_no_module_takes_another_modules_private_names() -> None:
    found = [use for module, path in MODULES.items()
             for use in _private_uses(module, str(path.relative_to(ROOT)), path.read_text())]
    assert not found, "private names of another module (make them public or move the code):\n" \
        + "\n".join(found)


def _functions(text: str) -> Iterator[tuple[str, int, int]]:
    """(qualified name, first line, length in lines) of every function in a module's source,
    nested ones and methods included; the length runs from the `def` line to the last line of
    the body."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                assert child.end_lineno is not None
                yield name, child.lineno, child.end_lineno - child.lineno + 1
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(text), "")


def test_no_function_is_longer_than_60_lines() -> None:
    too_long = sorted(((length, f"{path.relative_to(ROOT)}:{line}: {name}")
                       for path in MODULES.values()
                       for name, line, length in _functions(path.read_text())
                       if length > MAX_FUNCTION_LINES), reverse=True)
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(
        f"{where} ({length} lines)" for length, where in too_long)


def test_the_checks_see_what_they_look_for() -> None:
    """Each rule finds a planted offence, so that a passing run means something."""
    planted = (
        "from ravnest.comm.framing import _aligned, __doc__\n"
        "from . import framing\n"
        "from .framing import Frame\n"
        "import ravnest.comm.transport as transport\n"
        "import ravnest\n"
        "def f():\n"
        "    return framing._aligned, transport._Auth, ravnest.comm.dataplane._mac, Frame._x\n"
        "def g():\n" + "    pass\n" * MAX_FUNCTION_LINES)
    uses = list(_private_uses("ravnest.comm.planted", "planted.py", planted))
    assert uses == ["planted.py:1: from ravnest.comm.framing import _aligned",
                    "planted.py:7: ravnest.comm.framing._aligned",
                    "planted.py:7: ravnest.comm.transport._Auth",
                    "planted.py:7: ravnest.comm.dataplane._mac"]
    assert {name: length for name, _, length in _functions(planted)} == {
        "f": 2, "g": MAX_FUNCTION_LINES + 1}
