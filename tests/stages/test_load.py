"""The load stage: dims inference, every contract violation, content hashing, tile reads."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from schemas.artifacts import Tile
from schemas.config import NetCDFLoad
from schemas.errors import ContractError, InputError
from stages.load import fingerprint, infer_dims, read_block, run

from testkit import make_ds


@pytest.mark.parametrize(
    ("dims", "expected"),
    [
        (("time", "y", "x"), ("time", "y", "x")),
        (("time", "lat", "lon"), ("time", "lat", "lon")),
        (("lat", "lon", "band"), ("band", "lat", "lon")),
        (("row", "time", "col"), ("time", "row", "col")),
        (("a", "b", "c"), ("a", "b", "c")),
    ],
)
def test_infer_dims(dims: tuple[str, str, str], expected: tuple[str, str, str]) -> None:
    obs, y, x, problems = infer_dims(dims, None, None, None)
    assert problems == []
    assert (obs, y, x) == expected


def test_configured_dim_that_does_not_exist_is_named_with_suggestion() -> None:
    *_, problems = infer_dims(("time", "y", "x"), "tme", None, "xx")
    assert len(problems) == 2
    assert "load.obs_dim 'tme'" in problems[0] and "Did you mean 'time'?" in problems[0]


def test_load_reads_coords_attrs_and_hash(ctx: Any, cube_path: Path) -> None:
    out = run(NetCDFLoad(path=str(cube_path)), {}, ctx)
    m = out.meta
    assert (m["obs_dim"], m["y_dim"], m["x_dim"]) == ("time", "y", "x")
    assert (m["n_obs"], m["ny"], m["nx"]) == (12, 6, 5)
    assert m["attrs"]["units"] == "K"
    assert np.issubdtype(out.arrays["obs"].dtype, np.datetime64)
    np.testing.assert_array_equal(out.arrays["y"], np.arange(6) * 10.0)
    assert len(m["content_hash"]) == 32


def test_content_hash_ignores_path_and_mtime_but_sees_one_value(
    ctx: Any, tmp_path: Path, cube_path: Path
) -> None:
    key = fingerprint(NetCDFLoad(path=str(cube_path)), ctx)["content"]
    copy = tmp_path / "elsewhere.nc"
    shutil.copy(cube_path, copy)
    os.utime(copy, (1_000_000, 1_000_000))
    assert fingerprint(NetCDFLoad(path=str(copy)), ctx)["content"] == key
    ds = make_ds()
    ds["signal"][3, 2, 1] += 1e-9
    changed = tmp_path / "changed.nc"
    ds.to_netcdf(changed)
    assert fingerprint(NetCDFLoad(path=str(changed)), ctx)["content"] != key


def test_tile_read_transposes_to_obs_y_x(ctx: Any, write_cube: Any) -> None:
    ds = make_ds(n_obs=7, ny=4, nx=3)
    path = write_cube(ds.transpose("y", "x", "time"), "yxt.nc")
    meta = run(NetCDFLoad(path=str(path)), {}, ctx).meta
    assert meta["dims"] == ["y", "x", "time"] and meta["obs_dim"] == "time"
    block = read_block(meta, "cube", Tile(index=0, y0=1, y1=3, x0=0, x1=2))
    np.testing.assert_array_equal(block, ds["signal"].values[:, 1:3, 0:2])


def test_tile_read_refuses_a_file_changed_after_hashing(ctx: Any, write_cube: Any) -> None:
    path = write_cube(make_ds(), "c.nc")
    meta = run(NetCDFLoad(path=str(path)), {}, ctx).meta
    make_ds(seed=5).to_netcdf(path)
    with pytest.raises(InputError, match="changed or vanished"):
        read_block(meta, "cube", Tile(index=0, y0=0, y1=1, x0=0, x1=1))


def test_missing_variable_has_did_you_mean(ctx: Any, cube_path: Path) -> None:
    with pytest.raises(ContractError) as err:
        run(NetCDFLoad(path=str(cube_path), variable="signl", weights="w"), {}, ctx)
    text = str(err.value)
    assert "'signl' is not in the file (variables: signal). Did you mean 'signal'?" in text
    assert "load.weights: variable 'w'" in text


def test_wrong_number_of_dims(ctx: Any, write_cube: Any) -> None:
    ds = make_ds().isel(x=0)
    path = write_cube(ds, "2d.nc")
    with pytest.raises(ContractError, match="must have 3 dims"):
        run(NetCDFLoad(path=str(path), variable="signal"), {}, ctx)


def test_non_numeric_variable(ctx: Any, write_cube: Any) -> None:
    ds = make_ds()
    ds["signal"] = ds["signal"].astype(str)
    path = write_cube(ds, "str.nc")
    with pytest.raises(ContractError, match="expected numbers"):
        run(NetCDFLoad(path=str(path), variable="signal"), {}, ctx)


def test_inf_is_refused_with_position(ctx: Any, write_cube: Any) -> None:
    ds = make_ds()
    ds["signal"][2, 3, 4] = np.inf
    ds["signal"][5, 0, 0] = -np.inf
    path = write_cube(ds, "inf.nc")
    with pytest.raises(ContractError) as err:
        run(NetCDFLoad(path=str(path)), {}, ctx)
    assert "2 infinite value(s) (first at time=2, y=3, x=4)" in str(err.value)
    assert "replace infinite" in str(err.value)


def test_all_nan_cube_is_refused(ctx: Any, write_cube: Any) -> None:
    ds = make_ds()
    ds["signal"][:] = np.nan
    path = write_cube(ds, "nan.nc")
    with pytest.raises(ContractError, match="entirely NaN"):
        run(NetCDFLoad(path=str(path)), {}, ctx)


def test_design_variable_with_wrong_rows(ctx: Any, write_cube: Any) -> None:
    ds = make_ds()
    ds["A"] = (("t2", "coef"), np.ones((5, 3)))
    path = write_cube(ds, "d.nc")
    with pytest.raises(ContractError, match=r"expected dims \(time, coef\) with 12 rows"):
        run(NetCDFLoad(path=str(path), variable="signal", design="A"), {}, ctx)


def test_negative_weights_are_refused(ctx: Any, write_cube: Any) -> None:
    ds = make_ds()
    ds["w"] = ("time", -np.ones(12))
    path = write_cube(ds, "w.nc")
    with pytest.raises(ContractError, match="must be finite and ≥ 0"):
        run(NetCDFLoad(path=str(path), variable="signal", weights="w"), {}, ctx)


def test_missing_file_not_netcdf_and_truncated(ctx: Any, tmp_path: Path, cube_path: Path) -> None:
    with pytest.raises(InputError, match="input file not found"):
        run(NetCDFLoad(path=str(tmp_path / "nope.nc")), {}, ctx)
    text = tmp_path / "notes.nc"
    text.write_text("hello, I am not NetCDF")
    with pytest.raises(InputError, match="is not NetCDF") as err:
        run(NetCDFLoad(path=str(text)), {}, ctx)
    assert "b'hello, I'" in str(err.value)
    cut = tmp_path / "cut.nc"
    cut.write_bytes(cube_path.read_bytes()[: cube_path.stat().st_size // 2])
    with pytest.raises(InputError, match="corrupt or truncated"):
        run(NetCDFLoad(path=str(cut)), {}, ctx)
