"""The load package stays small enough to read: module and function sizes, and key coverage.

Issue 28: no module over 800 lines, no function over 80 (no exceptions). Every
module of the package that the stage runs is part of its code version, so an
edit of any of them changes the load key.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gridsolve.stages.engine import registry, runner, versions

LOAD = Path(__file__).resolve().parents[2] / "stages" / "load"
MODULES = sorted(LOAD.glob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_modules_and_functions_are_small(path: Path) -> None:
    source = path.read_text()
    assert len(source.splitlines()) <= 800, f"{path.name} has {len(source.splitlines())} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long, f"{path.name}: functions over 80 lines: {long}"


@pytest.mark.parametrize("impl", ["netcdf", "demo"])
def test_every_load_module_is_in_the_code_version(impl: str) -> None:
    covered = versions.module_digests(runner.code_roots(registry.get("load", impl)))
    expected = {f"gridsolve.stages.load.{p.stem}" for p in MODULES if p.stem != "__init__"}
    expected.discard("gridsolve.stages.load.contract")  # the kind's Protocol: not run
    assert expected <= set(covered), sorted(expected - set(covered))
