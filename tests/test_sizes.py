"""The house in rooms you can read (issue 28 item 5): no module over 800 lines, no function over 80.

No exceptions: a module that grows past the limit is split by concern, a function into
named helpers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the packages' folders (gridsolve/stages, flows and schemas link to the top-level ones)
FOLDERS = ("stages", "flows", "schemas", "gridsolve")
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    out = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            # skip what lies under a link (gridsolve/stages → stages: counted once)
            if any((ROOT / Path(*rel.parts[:i])).is_symlink() for i in range(1, len(rel.parts))):
                continue
            out.append(path)
    return out


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """Every function and method, nested ones too: qualified name and length in lines."""
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                out.append((name, node.end_lineno - node.lineno + 1))
            out += _functions(node, name + ".")
        else:
            out += _functions(node, prefix)
    return out


def _oversized() -> dict[str, int]:
    found = {}
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found[rel] = lines
        for name, n in _functions(ast.parse(text)):
            if n > MAX_FUNCTION_LINES:
                found[f"{rel}:{name}"] = n
    return found


def test_the_sources_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert "stages/solve/linalg.py" in names
    assert "gridsolve/api.py" in names
    assert not any(n.startswith(("gridsolve/stages/", "gridsolve/flows/")) for n in names)


def test_no_module_or_function_is_over_its_size() -> None:
    over = _oversized()
    assert not over, (
        f"modules over {MAX_MODULE_LINES} lines or functions over {MAX_FUNCTION_LINES}: "
        f"{over}; split them into modules by concern and named helpers"
    )


def test_the_limits_are_checked() -> None:
    # the measure finds what it looks for (a test that measures nothing proves nothing)
    long = "def f():\n" + "    x = 1\n" * 90
    assert _functions(ast.parse(long)) == [("f", 91)]
