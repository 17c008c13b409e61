"""Inputs are cached by content, not path or mtime; a run reads, and records, its own paths.

Issue 9, part 3: a touched or copied input (or weights file) with the same
bytes is a hit; a real change during a run is still refused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
from safetensors.torch import save_file

from gridsolve.schemas.errors import InputError
from gridsolve.schemas.kinds.design import RandomDesign
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.kinds.model import MultidimLinearModel
from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.kinds.write import NetCDFWrite
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.runner import run_stage, with_sources
from gridsolve.stages.engine.store import Store
from gridsolve.stages.model.building import build_module

from testkit import Chain, make_ds

MODEL = {"input_dim": 3, "hidden_dim": 2, "output_dim": 4}


def build(ctx: Any, cube: Path, weights: Path, out: Path) -> Chain:
    chain = Chain(ctx)
    chain.whole("load", NetCDFLoad(path=str(cube)))
    chain.whole("design", RandomDesign(coef=6))
    chain.whole("normal_equations", SVDNormalEquations())
    chain.tiled("solve", LstsqSolve())
    chain.tiled("model", MultidimLinearModel(**MODEL, weights=str(weights)))
    chain.whole("write", NetCDFWrite(path=str(out)))
    return chain


def hits(chain: Chain) -> dict[str, bool]:
    return {
        k: all(r.hit for r in v) if isinstance(v, list) else v.hit for k, v in chain.runs.items()
    }


def touch(path: Path, seconds: int = 1000) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns + seconds * 10**9, st.st_mtime_ns + seconds * 10**9))


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    data = tmp_path / "data"
    data.mkdir()
    cube = data / "cube.nc"
    make_ds(n_obs=12, ny=5, nx=4, nan_fraction=0.1).to_netcdf(cube)
    weights = data / "w.safetensors"
    module = build_module(MultidimLinearModel(**MODEL, seed=3))
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(weights))
    return cube, weights


def test_touched_input_and_weights_hit_every_stage(
    ctx: Any, tmp_path: Path, files: tuple[Path, Path]
) -> None:
    cube, weights = files
    out = tmp_path / "out.nc"
    first = build(ctx, cube, weights, out)
    assert not any(hits(first).values())
    written = out.read_bytes()
    touch(cube)
    touch(weights)
    again = build(ctx, cube, weights, out)
    assert all(hits(again).values()), hits(again)
    assert out.read_bytes() == written
    assert again.refs["load"].meta["source"]["file"] != first.refs["load"].meta["source"]["file"]


def test_input_under_another_name_hits_and_the_output_names_it(
    ctx: Any, tmp_path: Path, files: tuple[Path, Path]
) -> None:
    cube, weights = files
    out = tmp_path / "out.nc"
    first = build(ctx, cube, weights, out)
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    cube2, weights2 = moved / "renamed.nc", moved / "renamed.safetensors"
    shutil.copy(cube, cube2)  # a copy: new inode and mtime, same bytes
    shutil.copy(weights, weights2)
    cube.unlink()  # nothing may still read the old path
    weights.unlink()
    second = build(ctx, cube2, weights2, out)
    # Every computing stage is a hit (by content). The output file records the
    # input paths it was computed from, so write (only) writes it again.
    assert hits(second) == {
        "load": True,
        "design": True,
        "normal_equations": True,
        "solve": True,
        "model": True,
        "write": False,
    }
    assert second.refs["load"].key == first.refs["load"].key
    assert second.refs["load"].meta["source"]["path"] == str(cube2)
    with xr.open_dataset(out) as ds:
        config = json.loads(ds.attrs["gridsolve_config"])
    assert config["load"]["path"] == str(cube2)
    assert config["model"]["weights"] == str(weights2)
    assert all(hits(build(ctx, cube2, weights2, out)).values())  # and then a hit


def test_stored_artifact_names_no_path_and_a_cached_ref_is_relocated(
    ctx: Any, tmp_path: Path, cube_path: Path
) -> None:
    run = run_stage(NetCDFLoad(path=str(cube_path)), {}, ctx)
    stored = ctx.store.get(run.ref.key)
    assert not {"path", "file", "source"} & set(stored.meta)
    assert run.ref.meta["source"]["path"] == str(cube_path)
    renamed = tmp_path / "renamed.nc"
    cube_path.rename(renamed)
    # What the flow does with a result Prefect returns from its cache.
    fresh = with_sources(NetCDFLoad(path=str(renamed)), run, ctx)
    assert fresh.ref.key == run.ref.key
    assert fresh.ref.meta["source"]["path"] == str(renamed)
    assert fresh.ref.meta["content_hash"] == run.ref.meta["content_hash"]


def _until_solve(ctx: Any, cube: Path) -> Chain:
    chain = Chain(ctx)
    chain.whole("load", NetCDFLoad(path=str(cube)))
    chain.whole("design", RandomDesign(coef=6))
    chain.whole("normal_equations", SVDNormalEquations())
    return chain


def test_a_touch_or_same_bytes_copied_over_during_a_run_is_not_a_change(
    ctx: Any, tmp_path: Path, files: tuple[Path, Path]
) -> None:
    cube, _ = files
    chain = _until_solve(ctx, cube)
    touch(cube)
    spare = tmp_path / "spare.nc"
    shutil.copy(cube, spare)
    os.replace(spare, cube)  # same bytes, another inode
    [tile] = chain.tiled("solve", LstsqSolve())  # reads the cube: identity differs, content not
    other = StageContext(store=Store(tmp_path / "other-store"), memory_budget=ctx.memory_budget)
    [ref_tile] = _until_solve(other, cube).tiled("solve", LstsqSolve())  # undisturbed
    np.testing.assert_array_equal(tile.array("coefficients"), ref_tile.array("coefficients"))


def test_a_content_change_during_a_run_is_refused_even_with_mtime_restored(
    ctx: Any, files: tuple[Path, Path]
) -> None:
    cube, _ = files
    chain = _until_solve(ctx, cube)
    st = cube.stat()
    make_ds(n_obs=12, ny=5, nx=4, nan_fraction=0.1, seed=7).to_netcdf(cube)
    os.utime(cube, ns=(st.st_atime_ns, st.st_mtime_ns))  # as `cp -p` would leave it
    with pytest.raises(InputError, match="changed or vanished while the run was using it"):
        chain.tiled("solve", LstsqSolve())
