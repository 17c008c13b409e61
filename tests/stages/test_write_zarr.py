"""``write.impl: zarr``: the NetCDF output's contract in a Zarr store, whole before it appears."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr

from gridsolve.schemas.errors import OutputError
from gridsolve.schemas.pipeline import build_config
from gridsolve.stages.engine.paths import atomic_folder

from testkit import make_ds, run_plan

PROVENANCE = {"history", "gridsolve_config", "gridsolve_keys"}  # name the write config


def cube(tmp_path: Path) -> Path:
    """A 4-D cube (time, member, y, x) with gaps and a target."""
    ds = make_ds(n_obs=16, ny=6, nx=5, nan_fraction=0.15, seed=3)
    ds = xr.concat([ds, ds * 2.0 + 1.0], dim="member").transpose("time", "member", "y", "x")
    ds = ds.assign_coords(member=("member", [1, 2], {"long_name": "ensemble member"}))
    ds["tgt"] = ds["signal"].mean("time") - 1.0
    path = tmp_path / "cube.nc"
    ds.to_netcdf(path)
    return path


def run(ctx: Any, tmp_path: Path, src: Path, write: dict[str, Any], **extra: Any) -> None:
    sections: dict[str, Any] = {
        "load": {"path": str(src), "variable": "signal", "target": "tgt"},
        "design": extra.pop("design", {"impl": "harmonic", "harmonics": 1}),
        "solve": {"dtype": "float64", "uncertainty": "cov"},
        "model": {
            "input_dim": 2,
            "hidden_dim": 2,
            "output_dim": 1,
            "objective": "mse",
            "jacobian": True,
        },
        "write": write,
        "cache": {"root": str(tmp_path / "cache")},
        **extra,
    }
    run_plan(build_config(sections).stage_configs(), ctx, tile_pixels=7)


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_zarr_equals_netcdf_variable_for_variable(ctx: Any, tmp_path: Path, layout: str) -> None:
    src = cube(tmp_path)
    train = {
        "train": {
            "impl": "adam",
            "epochs": 2,
            "batch_pixels": 8,
            "lr": 0.01,
            "validation_fraction": 0.0,  # one 8×8 block covers this 6×5 map
        }
    }
    run(ctx, tmp_path, src, {"path": str(tmp_path / "out.nc"), "layout": layout}, **train)
    store = tmp_path / "out.zarr"
    run(ctx, tmp_path, src, {"impl": "zarr", "path": str(store), "layout": layout}, **train)
    assert (store / ".zmetadata").is_file()  # consolidated metadata: the store is complete
    # every chunk is written, all-zero ones too (an int variable has no fill value: a
    # missing chunk would be made up by the reader)
    for array in (p for p in store.iterdir() if (p / ".zarray").is_file()):
        meta = json.loads((array / ".zarray").read_text())
        if meta["fill_value"] is not None:
            continue  # a missing chunk reads as the declared fill value (NaN): fine
        expected = int(
            np.prod([-(-n // c) for n, c in zip(meta["shape"], meta["chunks"], strict=True)])
        )
        chunks = [f for f in array.iterdir() if not f.name.startswith(".")]
        assert len(chunks) == expected, (array.name, len(chunks), expected)
    with xr.open_dataset(tmp_path / "out.nc") as nc, xr.open_zarr(store) as zr:
        assert set(nc.variables) == set(zr.variables)
        for name in nc.variables:
            xr.testing.assert_identical(nc[name].load(), zr[name].load())
        assert {k for k in nc.attrs if nc.attrs[k] != zr.attrs.get(k)} <= PROVENANCE
        assert nc["coefficients"].dims == ("coef", "member", "y", "x")
        assert int(np.isfinite(zr["coefficients"].values).sum()) > 0
    # trained weights beside the store, as beside the NetCDF file
    assert (tmp_path / "out.zarr.weights.safetensors").is_file()


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_rewrite_replaces_the_store_as_a_whole(ctx: Any, tmp_path: Path) -> None:
    src = cube(tmp_path)
    store = tmp_path / "out.zarr"
    run(ctx, tmp_path, src, {"impl": "zarr", "path": str(store)})
    (store / "stale-file").write_text("left by someone")
    polynomial = {"impl": "polynomial", "degree": 3}
    run(ctx, tmp_path, src, {"impl": "zarr", "path": str(store)}, design=polynomial)
    assert not (store / "stale-file").exists()
    with xr.open_zarr(store) as ds:
        assert [str(n) for n in ds["coef_name"].values] == ["t^0", "t^1", "t^2", "t^3"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.zarr")] == []


def test_a_failed_write_leaves_the_old_store_and_no_temporary(tmp_path: Path) -> None:
    final = tmp_path / "out.zarr"
    final.mkdir()
    (final / "marker").write_text("old")
    with pytest.raises(RuntimeError, match="boom"), atomic_folder(final) as tmp:
        (tmp / "half").write_text("partial")
        raise RuntimeError("boom")
    assert (final / "marker").read_text() == "old"
    assert os.listdir(tmp_path) == ["out.zarr"]


def test_a_file_in_the_way_is_one_clear_error(ctx: Any, tmp_path: Path) -> None:
    src = cube(tmp_path)
    (tmp_path / "out.zarr").write_text("not a store")
    with pytest.raises(OutputError, match="is a file, not a Zarr store"):
        run(ctx, tmp_path, src, {"impl": "zarr", "path": str(tmp_path / "out.zarr")})
    assert (tmp_path / "out.zarr").read_text() == "not a store"


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_store_gridsolve_did_not_write_is_left_alone(
    ctx: Any, tmp_path: Path, zarr_format: int
) -> None:
    """Replacing a store deletes it: a store without gridsolve's provenance is never replaced."""
    src = cube(tmp_path)
    theirs = tmp_path / "theirs.zarr"
    make_ds(n_obs=4, ny=2, nx=3).to_zarr(theirs, zarr_format=zarr_format, mode="w")
    files = {p: p.read_bytes() for p in theirs.rglob("*") if p.is_file()}
    with pytest.raises(OutputError, match=r"\[write/zarr\] .* Zarr store that gridsolve did not"):
        run(ctx, tmp_path, src, {"impl": "zarr", "path": str(theirs)})
    assert {p: p.read_bytes() for p in theirs.rglob("*") if p.is_file()} == files


def test_a_folder_that_is_not_a_store_is_left_alone(ctx: Any, tmp_path: Path) -> None:
    src = cube(tmp_path)
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="is a folder that is not a Zarr store"):
        run(ctx, tmp_path, src, {"impl": "zarr", "path": str(folder)})
    assert (folder / "notes.txt").read_text() == "mine"
