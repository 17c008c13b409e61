"""The write stage: the output contract, CF metadata, provenance, atomicity, determinism."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import netCDF4
import numpy as np
import pytest
import xarray as xr

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.contracts import STATUS_FLAGS
from gridsolve.schemas.errors import ContractError, OutputError
from gridsolve.schemas.kinds.design import RandomDesign
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.kinds.model import MultidimLinearModel
from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.kinds.write import NetCDFWrite

from testkit import CONTRACT, Chain, make_ds


def build(chain: Chain, path: Path, tiles: list[Tile] | None = None, **model: Any) -> None:
    chain.whole("load", NetCDFLoad(path=str(path)))
    chain.whole("design", RandomDesign(coef=6))
    chain.whole("normal_equations", SVDNormalEquations())
    chain.tiled("solve", LstsqSolve(), tiles)
    chain.tiled(
        "model", MultidimLinearModel(input_dim=3, hidden_dim=2, output_dim=4, **model), tiles
    )


@pytest.fixture
def built(chain: Chain, write_cube: Any) -> Chain:
    build(chain, write_cube(make_ds(n_obs=12, ny=5, nx=4, nan_fraction=0.1)))
    return chain


def test_output_contract(built: Chain, tmp_path: Path) -> None:
    out = tmp_path / "out.nc"
    built.whole("write", NetCDFWrite(path=str(out)))
    ds = xr.open_dataset(out)
    assert set(ds.data_vars) == CONTRACT
    assert ds["coefficients"].dims == ("coef", "y", "x")
    assert ds["prediction"].dims == ("output", "y", "x")
    assert ds["grad_weight"].dims == ("input_dim", "hidden_dim", "output", "y", "x")
    assert ds["design"].dims == ("time", "coef")
    np.testing.assert_array_equal(ds["y"].values, np.arange(5) * 10.0)
    assert ds["y"].attrs["units"] == "m" and np.issubdtype(ds["time"].dtype, np.datetime64)
    assert ds["residual_rms"].attrs["units"] == "K"
    for v in ds.data_vars.values():
        assert v.attrs.get("long_name"), v.name
    raw = netCDF4.Dataset(out)
    status = raw.variables["status"]
    assert list(status.flag_values) == sorted(STATUS_FLAGS)
    assert status.flag_meanings.split() == [STATUS_FLAGS[k] for k in sorted(STATUS_FLAGS)]
    assert raw.variables["coefficients"].filters()["zlib"] is True
    raw.close()
    cfg = json.loads(ds.attrs["gridsolve_config"])
    keys = json.loads(ds.attrs["gridsolve_keys"])
    assert cfg["solve"]["policy"] == "minnorm" and "device" not in cfg["solve"]
    assert set(keys) == {"load", "design", "normal_equations", "solve", "model", "write"}
    assert ds.attrs["gridsolve_input_hash"] == built.refs["load"].meta["content_hash"]
    assert "torch" in json.loads(ds.attrs["gridsolve_versions"])


def test_tiled_and_whole_outputs_are_identical(
    chain: Chain, ctx: Any, write_cube: Any, tmp_path: Path
) -> None:
    path = write_cube(make_ds(n_obs=12, ny=5, nx=4, nan_fraction=0.1))
    build(chain, path)
    chain.whole("write", NetCDFWrite(path=str(tmp_path / "a.nc")))
    other = Chain(ctx)
    tiles = [Tile(index=0, y0=0, y1=2, x0=0, x1=4), Tile(index=1, y0=2, y1=5, x0=0, x1=4)]
    build(other, path, tiles)
    other.whole("write", NetCDFWrite(path=str(tmp_path / "b.nc")))
    a, b = xr.open_dataset(tmp_path / "a.nc"), xr.open_dataset(tmp_path / "b.nc")
    for name in a.data_vars:
        np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)


def test_rewrite_is_bit_identical(built: Chain, tmp_path: Path) -> None:
    out = tmp_path / "out.nc"
    built.whole("write", NetCDFWrite(path=str(out)))
    first = out.read_bytes()
    out.unlink()
    built.whole("write", NetCDFWrite(path=str(out)))  # cache hit is refused: the file is gone
    assert not built.runs["write"].hit
    assert out.read_bytes() == first


def test_output_folder_created_or_refused(built: Chain, tmp_path: Path) -> None:
    built.whole("write", NetCDFWrite(path=str(tmp_path / "new" / "day" / "out.nc")))
    assert (tmp_path / "new" / "day" / "out.nc").is_file()  # folders are created
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file"):
        built.whole("write", NetCDFWrite(path=str(tmp_path / "file" / "out.nc")))
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    if os.geteuid() != 0:
        with pytest.raises(OutputError, match="not writable"):
            built.whole("write", NetCDFWrite(path=str(ro / "out.nc")))


def test_existing_output_is_kept_without_overwrite(built: Chain, tmp_path: Path) -> None:
    out = tmp_path / "out.nc"
    out.write_text("precious")
    with pytest.raises(OutputError, match=r"exists and write\.overwrite is false"):
        built.whole("write", NetCDFWrite(path=str(out), overwrite=False))
    assert out.read_text() == "precious"


def test_a_file_gridsolve_did_not_write_is_never_replaced(built: Chain, tmp_path: Path) -> None:
    """Replacing a NetCDF file that is not a gridsolve output would destroy someone's data."""
    theirs = tmp_path / "theirs.nc"
    make_ds(n_obs=4, ny=2, nx=3).to_netcdf(theirs)
    before = theirs.read_bytes()
    with pytest.raises(OutputError, match="is not a gridsolve output"):
        built.whole("write", NetCDFWrite(path=str(theirs)))
    assert theirs.read_bytes() == before
    empty = tmp_path / "empty.nc"
    empty.touch()  # nothing to lose: replaced
    built.whole("write", NetCDFWrite(path=str(empty)))
    built.whole("write", NetCDFWrite(path=str(empty), zlib=False))  # our own: replaced
    with xr.open_dataset(empty) as ds:
        assert "gridsolve_config" in ds.attrs


def test_failure_mid_write_leaves_nothing(chain: Chain, write_cube: Any, tmp_path: Path) -> None:
    # A model whose output dim clashes with a grid dim is only detected while writing.
    from my_models import TinyMLP

    TinyMLP.gridsolve_dims = {"layer1.weight": ("y", "in")}  # 'y' has another size in the grid
    try:
        chain.whole("load", NetCDFLoad(path=str(write_cube(make_ds(n_obs=12, ny=3, nx=3)))))
        chain.whole("design", RandomDesign(coef=6))
        chain.whole("normal_equations", SVDNormalEquations())
        chain.tiled("solve", LstsqSolve())
        from gridsolve.schemas.kinds.model import ModuleModel

        chain.tiled(
            "model", ModuleModel(target="my_models:TinyMLP", kwargs={"n_in": 6}, input_shape=(6,))
        )
        out = tmp_path / "out.nc"
        with pytest.raises(ContractError, match="would have two sizes"):
            chain.whole("write", NetCDFWrite(path=str(out)))
    finally:
        del TinyMLP.gridsolve_dims
    assert sorted(
        p.name for p in tmp_path.iterdir() if p.suffix == ".nc" or p.name.endswith(".tmp")
    ) == ["cube.nc"]


def test_provenance_names_the_files_a_glob_matched_and_the_dims_it_resolved(
    tmp_path: Path, ctx: Any
) -> None:
    import gridsolve

    from testkit import run_plan

    ds = make_ds(n_obs=12, ny=3, nx=4).rename({"y": "lat", "x": "lon"})
    for i, part in enumerate((slice(0, 4), slice(4, 8), slice(8, 12))):
        ds.isel(time=part).to_netcdf(tmp_path / f"part-{i}.nc")
    cfg = gridsolve.config(
        load={"impl": "netcdf", "path": str(tmp_path / "part-*.nc")},  # dims left to infer
        design={"impl": "polynomial", "degree": 1},
        write={"impl": "netcdf", "path": str(tmp_path / "out.nc")},
    )
    refs = run_plan(cfg.stage_configs(), ctx)
    with xr.open_dataset(refs["write"].meta["path"]) as out:
        said = json.loads(out.attrs["gridsolve_config"])["load"]
    assert said["path"] == str(tmp_path / "part-*.nc")  # what the config said …
    assert said["matched_files"] == [str(tmp_path / f"part-{i}.nc") for i in range(3)]
    assert said["resolved_dims"] == {"obs": "time", "y": "lat", "x": "lon"}  # … and what it read
