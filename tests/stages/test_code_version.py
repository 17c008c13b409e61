"""Keys cover the code that runs and the libraries that can change numbers (issue 9, part 2)."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gridsolve.schemas.artifacts import ArtifactRef
from gridsolve.schemas.errors import ConfigError
from gridsolve.schemas.kinds.design import PolynomialDesign
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.kinds.model import ModuleModel
from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.stages.engine import versions
from gridsolve.stages.engine.runner import whole_key
from gridsolve.stages.write.layout import provenance

from testkit import Chain, make_ds

REPO = Path(__file__).resolve().parents[2]

# Runs load → design → normal_equations → solve with the runner, no Prefect,
# with whatever `gridsolve` package PYTHONPATH points at; prints hits and coefficients.
PIPELINE = """
import json, sys
import numpy as np
import gridsolve.stages
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.kinds.design import PolynomialDesign
from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.store import Store
from testkit import Chain

chain = Chain(StageContext(store=Store(sys.argv[2])))
chain.whole("load", NetCDFLoad(path=sys.argv[1]))
chain.whole("design", PolynomialDesign(degree=2))
chain.whole("normal_equations", SVDNormalEquations())
[tile] = chain.tiled("solve", LstsqSolve(dtype="float64"))
hits = {k: chain.runs[k].hit for k in ("load", "design", "normal_equations")}
hits["solve"] = chain.runs["solve"][0].hit
print(json.dumps({
    "stages": gridsolve.stages.__file__,
    "hits": hits,
    "coefficients": np.asarray(tile.array("coefficients")).tolist(),
}))
"""


def _copy_package(dest: Path) -> Path:
    """A copy of gridsolve's packages (and the test kit) that a subprocess can import."""
    (dest / "gridsolve").mkdir(parents=True)
    shutil.copy(REPO / "gridsolve" / "__init__.py", dest / "gridsolve" / "__init__.py")
    for pkg in ("stages", "schemas", "flows"):
        shutil.copytree(
            REPO / pkg, dest / "gridsolve" / pkg, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(REPO / "tests" / "testkit.py", dest / "testkit.py")
    (dest / "pipeline.py").write_text(PIPELINE)
    return dest


def _run_copy(
    copy: Path, cube: Path, store: Path, cache_home: Path | None = None
) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    if cache_home is not None:  # where the digests of parsed sources are remembered
        env["XDG_CACHE_HOME"] = str(cache_home)
    res = subprocess.run(
        [sys.executable, str(copy / "pipeline.py"), str(cube), str(store)],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    ran = Path(out["stages"]).resolve().parent
    assert ran == (copy / "gridsolve" / "stages").resolve()  # ran the copy
    return out


SOLVE_CALL = "    out = solve_block(B, op, config, own_w, ctx.memory_budget, gaps, where)\n"


def _doubled(lstsq_source: str) -> str:
    """``stages/solve/lstsq.py`` edited so that its tiles' coefficients come out doubled."""
    assert lstsq_source.count(SOLVE_CALL) == 1
    return lstsq_source.replace(
        SOLVE_CALL, SOLVE_CALL + '    out.arrays["coefficients"] = out.arrays["coefficients"] * 2\n'
    )


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_editing_a_stage_source_misses_and_recomputes(tmp_path: Path) -> None:
    cube = tmp_path / "cube.nc"
    make_ds(n_obs=10, ny=3, nx=4).to_netcdf(cube)
    store = tmp_path / "store"
    original = _copy_package(tmp_path / "original")
    edited = _copy_package(tmp_path / "edited")
    # Edit the copy's solve implementation (which its declaration imports only when a
    # solve runs): coefficients come out doubled.
    solve = edited / "gridsolve" / "stages" / "solve" / "lstsq.py"
    solve.write_text(_doubled(solve.read_text()))

    first = _run_copy(original, cube, store)
    assert not any(first["hits"].values()), first["hits"]
    again = _run_copy(original, cube, store)  # another process, same code: same keys
    assert all(again["hits"].values()), again["hits"]
    assert again["coefficients"] == first["coefficients"]

    changed = _run_copy(edited, cube, store)
    # Only the edited stage misses: load, design and normal_equations do not import solve.py.
    assert changed["hits"] == {
        "load": True,
        "design": True,
        "normal_equations": True,
        "solve": False,
    }
    assert changed["coefficients"] != first["coefficients"]
    assert changed["coefficients"] == [
        [[2 * v for v in row] for row in c] for c in first["coefficients"]
    ]


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_an_edit_in_place_misses_though_digests_are_remembered_between_processes(
    tmp_path: Path,
) -> None:
    """The on-disk memo of parsed sources never hides an edit of the same file."""
    cube = tmp_path / "cube.nc"
    make_ds(n_obs=10, ny=3, nx=4).to_netcdf(cube)
    store, home = tmp_path / "store", tmp_path / "cache-home"
    copy = _copy_package(tmp_path / "copy")
    first = _run_copy(copy, cube, store, home)
    memo = list((home / "gridsolve").glob("code-digests-*.json"))
    assert len(memo) == 1
    solve = copy / "gridsolve" / "stages" / "solve" / "lstsq.py"
    assert any(k.startswith("gridsolve.stages.solve|") for k in json.loads(memo[0].read_text()))
    again = _run_copy(copy, cube, store, home)
    assert all(again["hits"].values()) and again["coefficients"] == first["coefficients"]
    inode = solve.stat().st_ino
    with open(solve, "r+") as f:  # the same file (inode), edited: doubled coefficients
        text = _doubled(f.read())
        f.seek(0)
        f.write(text)
    assert solve.stat().st_ino == inode
    edited = _run_copy(copy, cube, store, home)
    assert not edited["hits"]["solve"] and edited["hits"]["load"]
    assert edited["coefficients"] != first["coefficients"]
    # the same size, the same inode and the mtime put back (cp -p, rsync): still a miss
    before = solve.stat()
    tripled = solve.read_text().replace('"coefficients"] * 2\n', '"coefficients"] * 3\n')
    with open(solve, "r+") as f:
        f.write(tripled)
    os.utime(solve, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = solve.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    third = _run_copy(copy, cube, store, home)
    assert not third["hits"]["solve"]
    assert third["coefficients"] == [
        [[1.5 * v for v in row] for row in c] for c in edited["coefficients"]
    ]


def test_comments_and_docstrings_do_not_change_the_code_version(tmp_path: Path) -> None:
    pkg = tmp_path / f"gs_docs_{uuid.uuid4().hex[:8]}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    mod = pkg / "m.py"
    mod.write_text('"""Doc."""\n\ndef f(x):\n    """Twice x."""\n    return 2 * x\n')
    sys.path.insert(0, str(tmp_path))
    try:
        name = f"{pkg.name}.m"
        base = versions.code_digest([name])
        mod.write_text('"""Other doc."""\n\n\ndef f(x):  # a comment\n    return 2 * x  # same\n')
        assert versions.code_digest([name]) == base
        mod.write_text('"""Doc."""\n\ndef f(x):\n    """Twice x."""\n    return 3 * x\n')
        assert versions.code_digest([name]) != base
    finally:
        sys.path.remove(str(tmp_path))


@pytest.fixture
def fresh_versions() -> Iterator[None]:
    versions.forget_versions()
    yield
    versions.forget_versions()


def test_a_different_library_version_misses(
    ctx: Any, cube_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_versions: None
) -> None:
    def stages_run() -> dict[str, bool]:
        chain = Chain(ctx)
        chain.whole("load", NetCDFLoad(path=str(cube_path)))
        chain.whole("design", PolynomialDesign(degree=2))
        chain.whole("normal_equations", SVDNormalEquations())
        chain.tiled("solve", LstsqSolve(dtype="float64"))
        return {"load": chain.runs["load"].hit, "solve": chain.runs["solve"][0].hit}

    assert stages_run() == {"load": False, "solve": False}
    assert stages_run() == {"load": True, "solve": True}

    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: "9.9.9" if name == "torch" else real(name),
    )
    versions.forget_versions()
    assert versions.package_versions()["torch"] == "9.9.9"
    assert stages_run() == {"load": False, "solve": False}
    # The output attribute names the versions the keys covered: one function for both.
    attrs = provenance({}, {}, "0" * 32)
    assert json.loads(attrs["gridsolve_versions"]) == versions.package_versions()


def test_versions_cover_the_libraries_that_change_numbers(fresh_versions: None) -> None:
    got = versions.package_versions()
    assert {"python", "gridsolve", "numpy", "scipy", "torch", "xarray", "netCDF4"} <= set(got)
    assert got["torch"] == importlib.metadata.version("torch")


# ---------------------------------------------------------------- user model code
NET = """
import torch
from torch import nn

from {pkg}.helpers import scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale(x * self.w)
"""


def _model_key(config: ModuleModel, ctx: Any) -> str:
    refs = {
        k: ArtifactRef(kind=k, impl="x", key=digit * 32, root="")
        for k, digit in (("load", "1"), ("design", "2"), ("solve", "3"))
    }
    return whole_key(config, refs, ctx)


def test_editing_a_helper_module_of_a_user_model_misses(
    ctx: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"gs_user_{uuid.uuid4().hex[:8]}"
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(NET.format(pkg=name))
    helpers = pkg / "helpers.py"
    helpers.write_text("def scale(x):\n    return 2 * x\n")
    (pkg / "unrelated.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = ModuleModel(target=f"{name}.net:Net", input_shape=(3,))

    key = _model_key(config, ctx)
    assert _model_key(config, ctx) == key
    (pkg / "unrelated.py").write_text("X = 2\n")  # not imported by the model
    assert _model_key(config, ctx) == key
    helpers.write_text('"""Scaling."""\n\n\ndef scale(x):  # times two\n    return 2 * x\n')
    assert _model_key(config, ctx) == key  # docstrings and comments are not code
    helpers.write_text("def scale(x):\n    return 3.0 * x\n")
    # this process runs the old helpers: keyed with the new source it would store the old
    # code's results under the new code's key
    with pytest.raises(ConfigError, match="changed after this process imported it"):
        _model_key(config, ctx)
    for module in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[module]  # a fresh process: imports what the files hold
    assert _model_key(config, ctx) != key
    assert set(versions.module_digests([f"{name}.net"])) == {f"{name}.net", f"{name}.helpers"}


def test_the_c_kernels_are_part_of_the_solve_code_digest() -> None:
    import xxhash

    from gridsolve.stages.solve import kernel

    digests = versions.module_digests(["gridsolve.stages.solve.kernel"])
    for f in kernel.CODE_FILES:
        data = (Path(kernel.__file__).parent / f).read_bytes()
        assert digests[f"gridsolve.stages.solve.kernel/{f}"] == xxhash.xxh3_128_hexdigest(data)


def test_editing_a_code_file_a_module_names_changes_its_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / f"cfiles_{uuid.uuid4().hex[:8]}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text('CODE_FILES = ("k.c",)\n')
    (pkg / "k.c").write_text("int f(void) { return 1; }\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = versions.code_digest([f"{pkg.name}.mod"])
    assert versions.code_digest([f"{pkg.name}.mod"]) == before  # stable
    (pkg / "k.c").write_text("int f(void) { return 2; }\n")  # the .py file is unchanged
    assert versions.code_digest([f"{pkg.name}.mod"]) != before


def test_a_writers_key_covers_how_its_inputs_describe_their_outputs() -> None:
    from gridsolve.stages.engine.registry import get
    from gridsolve.stages.engine.runner import code_roots

    described = {
        "gridsolve.stages.solve.outputs",
        "gridsolve.stages.model.outputs",
        "gridsolve.stages.train.outputs",
    }
    for impl in ("netcdf", "zarr"):
        assert described <= code_roots(get("write", impl)), impl
    # the kinds' own keys do not: a new attribute text rewrites files, not solves
    for kind, impl in (("solve", "lstsq"), ("model", "multidim_linear")):
        assert not described & code_roots(get(kind, impl)), kind


#: modules of a kind's folder that are one implementation's alone (prefixes of their names)
OWN = {("solve", "curvefit"): ("curvefit", "levmar")}


@pytest.mark.parametrize(
    ("kind", "impl"),
    [("solve", "lstsq"), ("solve", "curvefit"), ("model", "multidim_linear"), ("train", "sgd")],
)
def test_every_module_of_a_kinds_numerics_is_part_of_its_code_version(kind: str, impl: str) -> None:
    # A module split out of an implementation (stages/solve/linalg.py's pieces, ...) must
    # still be imported at module level by the code the stage runs: an edit of it then
    # changes the key. The registration, the contract and the output descriptions are
    # not numerics (outputs.py is the writers', see above). The nonlinear fit's modules
    # are curvefit's only: an edit of them leaves lstsq's keys as they were.
    from gridsolve.stages.engine.registry import get
    from gridsolve.stages.engine.runner import code_roots

    folder = Path(versions.__file__).parent.parent / kind
    others = tuple(p for (k, i), ps in OWN.items() if k == kind and i != impl for p in ps)
    mine = OWN.get((kind, impl))
    stems = [
        p.stem
        for p in folder.glob("*.py")
        if p.stem not in ("__init__", "declare", "contract", "outputs")
    ]
    expected = {
        f"gridsolve.stages.{kind}.{stem}"
        for stem in stems
        if (mine is None or stem.startswith(mine)) and not stem.startswith(others or ("\0",))
    }
    got = set(versions.module_digests(code_roots(get(kind, impl))))
    assert expected <= got
    foreign = {f"gridsolve.stages.{kind}.{s}" for s in stems if s.startswith(others or ("\0",))}
    assert not foreign & got


def test_a_module_reimported_at_its_predecessors_address_is_taken_as_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CPython may give a module imported afresh the id of the one it replaced: keyed by
    # id, a fresh import of an edited file was refused as an edit of the old code
    import gc
    import types

    monkeypatch.setattr(versions, "_IMPORTED", {})
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no stale .pyc of a same-size edit
    monkeypatch.delitem(sys.modules, "readdressed", raising=False)
    one, two = types.ModuleType("m"), types.ModuleType("m")
    assert versions._same_import(versions._import_of(one), one)
    assert not versions._same_import(versions._import_of(one), two)
    (tmp_path / "readdressed.py").write_text("def f(t, p):\n    return p[0] * t\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import readdressed  # type: ignore[import-not-found]

    first = versions.user_code_digest(readdressed.f, "readdressed:f")
    (tmp_path / "readdressed.py").write_text("def f(t, p):\n    return p[0] * t + 1.0\n")
    with pytest.raises(ConfigError, match="changed after this process imported it"):
        versions.user_code_digest(readdressed.f, "readdressed:f")
    # dropped and freed: the record names no module any more, whatever address the next
    # import gets
    del readdressed
    sys.modules.pop("readdressed")
    gc.collect()
    assert versions._IMPORTED["readdressed"][0][0]() is None
    import readdressed  # type: ignore[import-not-found]

    again = versions.user_code_digest(readdressed.f, "readdressed:f")
    assert again != first
    (tmp_path / "readdressed.py").write_text("def f(t, p):\n    return p[0] * t - 10.0\n")
    with pytest.raises(ConfigError, match="changed after this process imported it"):
        versions.user_code_digest(readdressed.f, "readdressed:f")
    importlib.reload(readdressed)  # same module object, a fresh spec: the file's code runs
    assert readdressed.f(1.0, [1.0]) == -9.0
    third = versions.user_code_digest(readdressed.f, "readdressed:f")
    assert third not in (first, again)
    sys.modules.pop("readdressed")


def test_a_helper_reloaded_without_its_importer_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `from helper import g` keeps the old g in the target's module: a reload of the
    # helper alone leaves the target calling the old code under the new code's key
    monkeypatch.setattr(versions, "_IMPORTED", {})
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    for name in ("curve_helper", "curve_root"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    (tmp_path / "curve_helper.py").write_text("def g(t):\n    return t\n")
    (tmp_path / "curve_root.py").write_text(
        "from curve_helper import g\n\n\ndef f(t, p):\n    return p[0] * g(t)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import curve_helper  # type: ignore[import-not-found]
    import curve_root  # type: ignore[import-not-found]

    first = versions.user_code_digest(curve_root.f, "curve_root:f")
    (tmp_path / "curve_helper.py").write_text("def g(t):\n    return 2.0 * t\n")
    importlib.reload(curve_helper)
    assert curve_root.f(1.0, [1.0]) == 1.0  # still the old g
    with pytest.raises(ConfigError, match="curve_helper was imported again after an edit"):
        versions.user_code_digest(curve_root.f, "curve_root:f")
    importlib.reload(curve_root)  # now it binds the new g: keyed afresh
    assert curve_root.f(1.0, [1.0]) == 2.0
    assert versions.user_code_digest(curve_root.f, "curve_root:f") != first
    # a module never keyed before, imported before the helper's next edit and reload:
    # refused as well (it holds the old g; when it was imported is not known)
    (tmp_path / "curve_other.py").write_text(
        "from curve_helper import g\n\n\ndef f(t, p):\n    return p[0] * g(t) * 1.0\n"
    )
    monkeypatch.delitem(sys.modules, "curve_other", raising=False)
    import curve_other  # type: ignore[import-not-found]

    (tmp_path / "curve_helper.py").write_text("def g(t):\n    return 3.0 * t\n")
    importlib.reload(curve_helper)
    with pytest.raises(ConfigError, match="curve_helper was imported again after an edit"):
        versions.user_code_digest(curve_other.f, "curve_other:f")
    for name in ("curve_helper", "curve_root", "curve_other"):
        sys.modules.pop(name)
