"""Only the storage layer asks whether a path is a URL (issue 28: one storage interface).

Outside it, code asks a location to do things; the few places that still ask
whether a location is on this host's disk (read ``Location.local``) are listed
with why. An output is staged and published by one operation whatever the
location: the same tests run on a local folder and a bucket.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest
import xarray as xr

from gridsolve.schemas.errors import OutputError
from gridsolve.stages.engine import storage
from gridsolve.stages.engine.paths import atomic_file

from testkit import make_ds

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


#: where code outside the layer reads ``Location.local`` (is this on this host's disk?), and why
LOCAL_READS = {
    # a single object is keyed by its ETag, as a file set of one; a local file by its bytes
    # (the load key's form differs by design: changing it would change every cache key)
    "stages/load/where.py": 1,
    "stages/load/inputs.py": 1,
    # a file set's objects are revalidated by one listing of their ETags, files by stat
    # and a rehash on a new identity (the same split as the load key)
    "stages/load/blocks.py": 1,
    # refusing a foreign output before any work reads a local file's attributes; a bucket
    # output is refused before any work by check_write_target (a probe write)
    "stages/engine/overlap.py": 1,
    # write.keep_last lists and deletes local outputs only (a documented limit)
    "stages/write/retention.py": 1,
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


def _local_reads() -> dict[str, int]:
    """Reads of an attribute ``local`` per module of the packages (and gridsolve/*.py)."""
    paths = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    out = {}
    own = [  # gridsolve's own modules (api.py, report/), not the links to the packages
        p
        for p in sorted((ROOT / "gridsolve").rglob("*.py"))
        if not any((ROOT / q).is_symlink() for q in p.relative_to(ROOT).parents)
    ]
    for path in paths + own:
        tree = ast.parse(path.read_text(), str(path))
        n = sum(isinstance(node, ast.Attribute) and node.attr == "local" for node in ast.walk(tree))
        if n:
            out[path.relative_to(ROOT).as_posix()] = n
    return out


def test_only_the_listed_places_ask_whether_a_location_is_local() -> None:
    # the writers, the output checks and the pictures never do: they call the layer
    outside = {f: n for f, n in _local_reads().items() if f not in LAYER}
    assert outside == LOCAL_READS


def test_the_local_reads_are_found() -> None:
    assert _local_reads().get("stages/engine/storage.py", 0) >= 1


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


# ---------------------------------------------------------------- one output operation
@pytest.fixture(params=["folder", "bucket"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], storage.Location]:
    """A location named ``name`` in a local folder, or in a fresh bucket."""
    if request.param == "folder":
        return lambda name: storage.at(str(tmp_path / "out" / name))
    s3 = request.getfixturevalue("s3")
    return lambda name: storage.at(s3.url(name))


def _bytes(where: storage.Location) -> bytes:
    return Path(where.readable()).read_bytes()


def _names(where: storage.Location) -> list[str]:
    """Everything in the folder or bucket ``where`` lies in (temporaries included)."""
    folder = storage.at(where.text.rsplit("/", 1)[0])
    return [folder.relative(f) for f in folder.files_under(("test", OutputError, None))]


def test_a_file_is_published_with_the_file_beside_it(
    place: Callable[[str], storage.Location],
) -> None:
    where = place("o.nc")
    with where.staged_file([".side"], lambda: {"size": where.facts()["size"]}) as staged:
        with atomic_file(staged.path) as tmp:  # as the writer writes it
            tmp.write_bytes(b"new output")
        Path(f"{staged.path}.side").write_bytes(b"side")
    assert _bytes(where) == b"new output" and staged.facts == {"size": 10}
    assert _bytes(storage.at(f"{where}.side")) == b"side"
    assert _names(where) == ["o.nc", "o.nc.side"]


def test_a_file_that_fails_leaves_the_previous_one_and_nothing_else(
    place: Callable[[str], storage.Location],
) -> None:
    where = place("o.nc")
    where.write_bytes(b"old")
    with (
        pytest.raises(RuntimeError, match="boom"),
        where.staged_file([".side"], dict) as staged,
        atomic_file(staged.path) as tmp,
    ):
        tmp.write_bytes(b"new")
        raise RuntimeError("boom")
    assert _bytes(where) == b"old" and _names(where) == ["o.nc"]


def _write_store(where: storage.Location, ds: xr.Dataset, fails: bool) -> None:
    def side(path: Path) -> None:
        path.write_bytes(b"side")

    with where.staged_store({".side": side}, "write/zarr") as store:
        # mode "w", as the writer: a bucket's store holds gridsolve's mark while it is written
        options = where.open_options()
        ds.to_zarr(store, mode="w", storage_options=options, zarr_format=2, consolidated=True)
        if fails:
            raise RuntimeError("boom")


def test_a_store_appears_whole_with_the_file_beside_it(
    place: Callable[[str], storage.Location],
) -> None:
    where, ds = place("o.zarr"), make_ds(n_obs=3, ny=2, nx=2)
    _write_store(where, ds, fails=False)
    with xr.open_zarr(where.text, storage_options=where.open_options()) as got:
        xr.testing.assert_equal(got.load(), ds)
    assert _bytes(storage.at(f"{where}.side")) == b"side"
    recorded = {**where.folder_facts(), "side_files": {}}  # as the writer records it
    assert where.folder_unchanged(recorded)
    storage.at(f"{where}/extra").write_bytes(b"x")
    assert not where.folder_unchanged(recorded)


def test_a_store_that_fails_leaves_nothing_under_its_name(
    place: Callable[[str], storage.Location],
) -> None:
    where = place("o.zarr")
    with pytest.raises(OutputError) as err:
        _write_store(where, make_ds(n_obs=3, ny=2, nx=2), fails=True)
    assert "RuntimeError: boom" in str(err.value)
    assert not where.exists() and _names(where) == []
