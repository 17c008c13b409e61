"""Only the storage layer asks whether a path is a URL (issue 28: one storage interface)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gridsolve.stages.engine import storage

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("stages", "flows", "schemas")

#: the storage layer: the only module that turns a path into a local or an object location
LAYER = {"stages/engine/storage.py"}
#: where else the question is asked, and why
EXCEPTIONS = {
    # the config edge: refuses an unsupported scheme while a config is validated, and makes
    # content-keyed paths absolute; schemas import nothing of the stages (is_url is defined here)
    "schemas/base.py": 2,
    # the config edge too: a relative path in a config file is made relative to that file
    "schemas/reading.py": 1,
    # confinement (GRIDSOLVE_ALLOWED_INPUTS): compares by the setting's text, where a file://
    # entry is a prefix too; moving it would change which inputs a confined worker accepts
    "stages/engine/paths.py": 2,
}


def _questions(tree: ast.AST) -> int:
    """Calls of ``is_url`` and ``"://" in …`` tests in ``tree``."""
    found = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
            found += name in ("is_url", "_is_url")
        elif isinstance(node, ast.Compare):
            left = node.left
            found += (
                isinstance(left, ast.Constant)
                and left.value == "://"
                and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
            )
    return found


def _counts() -> dict[str, int]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            n = _questions(ast.parse(path.read_text(), str(path)))
            if n:
                out[path.relative_to(ROOT).as_posix()] = n
    return out


def test_only_the_storage_layer_asks_whether_a_path_is_a_url() -> None:
    outside = {f: n for f, n in _counts().items() if f not in LAYER}
    assert outside == EXCEPTIONS


def test_the_layer_does_ask() -> None:
    # the walk finds what it looks for (a test that counts nothing proves nothing)
    assert _counts().get("stages/engine/storage.py", 0) >= 1


@pytest.mark.parametrize(
    ("path", "kind", "noun"),
    [
        ("s3://bucket/a.nc", storage.ObjectPath, "object"),
        ("/data/a.nc", storage.LocalPath, "file"),
        ("file:///data/a.nc", storage.LocalPath, "file"),
        ("data/s3:/x.nc", storage.LocalPath, "file"),
    ],
)
def test_a_path_is_one_kind_of_location(path: str, kind: type, noun: str) -> None:
    where = storage.at(path)
    assert type(where) is kind and where.noun == noun
    assert (where.local is None) == (kind is storage.ObjectPath)


def test_locations_compare_only_within_their_kind(tmp_path: Path) -> None:
    inner, outer = storage.at("s3://B/x/../y/z"), storage.at("s3://b/y")
    assert inner.normal() == "s3://b/y/z" and inner.inside(outer)
    assert not storage.at(str(tmp_path)).inside(outer)
    assert storage.at(str(tmp_path / "a")).inside(storage.at(str(tmp_path)))
    assert inner.matched_by(storage.at("s3://b/y/*"))
    assert not storage.at(str(tmp_path / "a.nc")).matched_by(storage.at("s3://b/*"))
