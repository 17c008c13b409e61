"""Many files as one cube: globs, lists of NetCDF files and Zarr stores in ``load.path``.

Every output is checked against an independent oracle computed here from the
cube before it was split (``numpy.linalg.lstsq`` per series on its valid rows,
the cube's own values for tile reads, a hash count for the digest cache), or
against a single-file run that xarray itself wrote from the same dataset.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import yaml

from gridsolve.flows.cli import main as cli_main
from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.errors import ConfigError, ContractError, InputError
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.pipeline import build_config
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.hashing import hash_file as real_hash_file
from gridsolve.stages.engine.registry import SOURCE
from gridsolve.stages.engine.runner import run_stage
from gridsolve.stages.engine.store import Store
from gridsolve.stages.load import blocks, inputs, scan
from gridsolve.stages.load.blocks import read_block
from gridsolve.stages.load.inputs import check_opens
from gridsolve.stages.load.netcdf import fingerprint, locate, run
from gridsolve.stages.load.where import expand, is_zarr

from testkit import run_plan

N_T, N_M, N_Y, N_X = 24, 2, 5, 6
#: time positions where the 5 files of the base cube start (and the last ends)
SPLITS = (0, 5, 10, 15, 20, 24)
#: times of the full series: the base cube's 24 and 6 more for a 6th file
N_FULL = 30
DEGREE = 1
DIMS = ("member", "lat", "lon")

# xarray writes consolidated Zarr v3 metadata and zarr says so on every write and open
pytestmark = pytest.mark.filterwarnings("ignore:Consolidated metadata:UserWarning")


# ---------------------------------------------------------------- cubes
def full_cube(seed: int = 0, nan_fraction: float = 0.1) -> xr.Dataset:
    """A seeded ``sig (time=30, member, lat, lon)``: line + curvature + noise, ~10% gaps."""
    rng = np.random.default_rng(seed)
    t = np.linspace(-1, 1, N_FULL)[:, None, None, None]
    shape = (1, N_M, N_Y, N_X)
    data = (
        rng.normal(size=shape)
        + rng.normal(size=shape) * t
        + 0.5 * rng.normal(size=shape) * t**2
        + 0.2 * rng.standard_normal((N_FULL, N_M, N_Y, N_X))
        + 5.0 * np.arange(N_M)[None, :, None, None]
    )
    data[rng.random(data.shape) < nan_fraction] = np.nan
    return xr.Dataset(
        {"sig": (("time", *DIMS), data, {"units": "K", "long_name": "signal"})},
        coords={
            "time": ("time", pd.date_range("2020-01-01", periods=N_FULL, freq="D")),
            "member": ("member", np.array([10, 20]), {"long_name": "ensemble member"}),
            "lat": ("lat", np.arange(N_Y) * 1.5, {"units": "degrees_north"}),
            "lon": ("lon", np.arange(N_X) * 2.0, {"units": "degrees_east"}),
        },
    )


def cube(seed: int = 0) -> xr.Dataset:
    """The base cube: the first 24 times of :func:`full_cube`."""
    return full_cube(seed).isel(time=slice(0, N_T))


def write_parts(ds: xr.Dataset, folder: Path, splits: tuple[int, ...] = SPLITS) -> list[Path]:
    """``ds`` split along time at ``splits`` into ``folder/z-0.nc`` … (in time order)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (a, b) in enumerate(itertools.pairwise(splits)):
        path = folder / f"z-{i}.nc"
        ds.isel(time=slice(a, b)).to_netcdf(path)
        paths.append(path)
    return paths


def sixth_file(folder: Path) -> Path:
    """The 6 times after the base cube, as ``folder/z-5.nc``."""
    path = folder / "z-5.nc"
    full_cube().isel(time=slice(N_T, N_FULL)).to_netcdf(path)
    return path


def sections(path: str | list[str], out: Path, cache: Path) -> dict[str, Any]:
    return {
        "load": {"path": path, "variable": "sig"},
        "design": {"impl": "polynomial", "degree": DEGREE},
        "solve": {"dtype": "float64"},
        "model": {"input_dim": 2, "hidden_dim": 1, "output_dim": 1},
        "write": {"path": str(out)},
        "cache": {"root": str(cache)},
    }


def pipeline(ctx: Any, tmp_path: Path, path: str | list[str], name: str) -> xr.Dataset:
    """Run the whole pipeline in-process (the flow's plan, no Prefect); the output, loaded."""
    out = tmp_path / "out" / name
    out.parent.mkdir(exist_ok=True)
    run_plan(build_config(sections(path, out, tmp_path / "cache")).stage_configs(), ctx)
    with xr.open_dataset(out) as ds:
        return ds.load()


def fail_pipeline(ctx: Any, tmp_path: Path, path: str | list[str]) -> Path:
    """Run a pipeline that is expected to raise; the output path it was given."""
    out = tmp_path / "out-fail" / "out.nc"
    out.parent.mkdir(exist_ok=True)
    run_plan(build_config(sections(path, out, tmp_path / "cache")).stage_configs(), ctx)
    return out


def assert_same_output(a: xr.Dataset, b: xr.Dataset) -> None:
    assert set(a.data_vars) == set(b.data_vars)
    for name in a.data_vars:
        xr.testing.assert_equal(a[name], b[name])


# ---------------------------------------------------------------- oracles
def lstsq_oracle(A: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-series least squares on valid rows: (coef (k, *batch), n_valid (*batch))."""
    n_obs, k = A.shape
    batch = b.shape[1:]
    B = b.reshape(n_obs, -1)
    coef = np.full((k, B.shape[1]), np.nan)
    n_valid = np.zeros(B.shape[1], dtype=int)
    for j in range(B.shape[1]):
        m = np.isfinite(B[:, j])
        n_valid[j] = int(m.sum())
        if n_valid[j] >= k:
            coef[:, j] = np.linalg.lstsq(A[m], B[m, j], rcond=None)[0]
    return coef.reshape(k, *batch), n_valid.reshape(batch)


def check_against_lstsq(out: xr.Dataset, sig: xr.DataArray) -> None:
    A = np.asarray(out["design"].values, dtype=np.float64)
    t = np.linspace(-1.0, 1.0, sig.sizes["time"])
    np.testing.assert_allclose(A, np.stack([t**k for k in range(DEGREE + 1)], 1), atol=1e-12)
    coef, n_valid = lstsq_oracle(A, sig.transpose("time", *DIMS).values)
    got = out["coefficients"].transpose("coef", *DIMS).values
    np.testing.assert_allclose(got, coef, rtol=1e-9, atol=1e-9, equal_nan=True)
    np.testing.assert_array_equal(out["n_valid"].transpose(*DIMS).values, n_valid)


def fresh_process_state() -> None:
    """Forget what this process memoised about inputs, as a new run in a new process would."""
    inputs._file_set.cache_clear()
    scan._scan_or_refusal.cache_clear()
    blocks._REVALIDATED.clear()


# ---------------------------------------------------------------- 1.-3. one cube, many forms
@pytest.fixture
def data(tmp_path: Path) -> list[Path]:
    return write_parts(cube(), tmp_path / "data")


@pytest.fixture
def single(ctx: Any, tmp_path: Path) -> xr.Dataset:
    path = tmp_path / "single.nc"
    cube().to_netcdf(path)
    return pipeline(ctx, tmp_path, str(path), "single.nc")


def test_glob_equals_single_file_and_lstsq(
    ctx: Any, tmp_path: Path, data: list[Path], single: xr.Dataset
) -> None:
    out = pipeline(ctx, tmp_path, str(tmp_path / "data" / "z-*.nc"), "glob.nc")
    assert out.sizes["time"] == N_T
    np.testing.assert_array_equal(out["time"].values, cube()["time"].values)
    assert_same_output(out, single)
    check_against_lstsq(out, cube()["sig"])
    check_against_lstsq(single, cube()["sig"])


def test_shuffled_list_is_a_cache_hit_with_the_same_output(
    ctx: Any, tmp_path: Path, data: list[Path]
) -> None:
    glob_out = pipeline(ctx, tmp_path, str(tmp_path / "data" / "z-*.nc"), "glob.nc")
    shuffled = [str(p) for p in data]
    random.Random(3).shuffle(shuffled)
    assert shuffled != sorted(shuffled)
    configs = build_config(
        sections(shuffled, tmp_path / "out" / "list.nc", tmp_path / "cache")
    ).stage_configs()
    # The load stage alone, before the pipeline: already in the store.
    load_run = run_stage(configs["load"], {}, ctx)
    assert load_run.hit
    # This run's source lists the files in time order, whatever the list's order.
    assert load_run.ref.meta[SOURCE]["source"]["files"] == [str(p) for p in data]
    refs = run_plan(configs, ctx)
    assert refs["load"].key == load_run.ref.key
    with xr.open_dataset(tmp_path / "out" / "list.nc") as ds:
        out = ds.load()
    assert_same_output(out, glob_out)
    check_against_lstsq(out, cube()["sig"])


def test_zarr_store_equals_netcdf(ctx: Any, tmp_path: Path, single: xr.Dataset) -> None:
    store = tmp_path / "cube.zarr"
    cube().to_zarr(store)
    assert is_zarr(str(store))
    out = pipeline(ctx, tmp_path, str(store), "zarr.nc")
    assert_same_output(out, single)
    check_against_lstsq(out, cube()["sig"])


# ---------------------------------------------------------------- 4. keys and the digest cache
def test_load_key_and_per_file_digest_cache(
    tmp_path: Path, data: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed: list[str] = []

    def counting(path: str | Path, block: int = 16 * 2**20) -> str:
        hashed.append(str(path))
        return real_hash_file(path, block)

    monkeypatch.setattr("gridsolve.stages.load.files.hash_file", counting)
    # The files were written a moment ago: remember their digests at once (the guard
    # against coarse timestamps is tested on its own below).
    monkeypatch.setattr("gridsolve.stages.load.files.RACY_NS", 0)
    root = tmp_path / "store"

    def key(path: str | list[str]) -> str:
        fresh_process_state()
        hashed.clear()
        ctx = StageContext(store=Store(root), memory_budget=256 * 2**20)
        return str(fingerprint(NetCDFLoad(path=path, variable="sig"), ctx)["content"])

    pattern = str(tmp_path / "data" / "z-*.nc")
    first = key(pattern)
    assert sorted(hashed) == sorted(str(p) for p in data)
    assert len(list((root / "file-digests").glob("*.json"))) == len(data)

    # a second fingerprint in a fresh process state: every digest is reused
    assert key(pattern) == first
    assert hashed == []

    # the same files as a list in any order: same key, nothing hashed
    assert key([str(p) for p in reversed(data)]) == first
    assert hashed == []

    # touched (new mtime and ctime, same bytes): same key, that file hashed again only
    st = os.stat(data[2])
    os.utime(data[2], ns=(st.st_atime_ns, st.st_mtime_ns - 10**10))
    assert key(pattern) == first
    assert hashed == [str(data[2])]
    assert key(pattern) == first
    assert hashed == []

    # a 6th file matched by the glob: a new key, only that file hashed
    extra = sixth_file(tmp_path / "data")
    grown = key(pattern)
    assert grown != first
    assert hashed == [str(extra)]

    # the key does not depend on the digest cache: a fresh store hashes all and agrees
    fresh_process_state()
    ctx = StageContext(store=Store(tmp_path / "other-store"), memory_budget=256 * 2**20)
    assert fingerprint(NetCDFLoad(path=pattern, variable="sig"), ctx)["content"] == grown

    # the 6th file gone again: the first key, nothing hashed
    extra.unlink()
    assert key(pattern) == first
    assert hashed == []

    # one file's bytes changed (same name, same coords): a new key
    ds = cube(seed=7).isel(time=slice(SPLITS[1], SPLITS[2]))
    ds.to_netcdf(tmp_path / "tmp.nc")
    os.replace(tmp_path / "tmp.nc", data[1])
    assert key(pattern) not in (first, grown)
    assert hashed == [str(data[1])]


def test_a_file_changed_just_now_is_hashed_again(
    tmp_path: Path, data: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within the timestamp resolution of a change its digest is not remembered ("racy")."""
    hashed: list[str] = []

    def counting(path: str | Path, block: int = 16 * 2**20) -> str:
        hashed.append(str(path))
        return real_hash_file(path, block)

    monkeypatch.setattr("gridsolve.stages.load.files.hash_file", counting)
    root = tmp_path / "store"
    pattern = str(tmp_path / "data" / "z-*.nc")

    def key() -> str:
        fresh_process_state()
        hashed.clear()
        ctx = StageContext(store=Store(root), memory_budget=256 * 2**20)
        return str(fingerprint(NetCDFLoad(path=pattern, variable="sig"), ctx)["content"])

    monkeypatch.setattr("gridsolve.stages.load.files.RACY_NS", 10**12)  # all changed "now"
    first = key()
    assert key() == first
    assert sorted(hashed) == sorted(str(p) for p in data)  # hashed again: none remembered
    assert not list((root / "file-digests").glob("*.json"))
    monkeypatch.setattr("gridsolve.stages.load.files.RACY_NS", 0)
    assert key() == first
    assert key() == first and hashed == []


def test_zarr_key_covers_every_file_and_its_name(tmp_path: Path, ctx: Any) -> None:
    store = tmp_path / "cube.zarr"
    cube().to_zarr(store)
    cfg = NetCDFLoad(path=str(store), variable="sig")
    first = fingerprint(cfg, ctx)["content"]
    # a copy elsewhere: names are relative to the store, so the same key
    copy = tmp_path / "elsewhere.zarr"
    shutil.copytree(store, copy)
    fresh_process_state()
    assert fingerprint(NetCDFLoad(path=str(copy), variable="sig"), ctx)["content"] == first
    # one more (unused) file inside the store: a new key
    (copy / "notes.txt").write_text("x")
    fresh_process_state()
    assert fingerprint(NetCDFLoad(path=str(copy), variable="sig"), ctx)["content"] != first


# ---------------------------------------------------------------- 5. errors
def _message(exc: pytest.ExceptionInfo[Exception]) -> str:
    return str(exc.value)


def test_glob_matching_nothing(ctx: Any, tmp_path: Path, data: list[Path]) -> None:
    pattern = str(tmp_path / "data" / "q-*.nc")
    with pytest.raises(InputError) as err:
        fail_pipeline(ctx, tmp_path, pattern)
    assert type(err.value) is InputError
    assert f"load.path {pattern!r} matches no file" in _message(err)
    assert not (tmp_path / "out-fail" / "out.nc").exists()
    assert list((tmp_path / "out-fail").iterdir()) == []


def test_overlapping_files_are_refused(ctx: Any, tmp_path: Path) -> None:
    # z-1 holds times 4..9, z-0 ends at time 4: one date in both
    paths = write_parts(cube(), tmp_path / "data", (0, 5, 10))
    cube().isel(time=slice(4, 10)).to_netcdf(paths[1])
    with pytest.raises(ContractError) as err:
        fail_pipeline(ctx, tmp_path, str(tmp_path / "data" / "z-*.nc"))
    assert type(err.value) is ContractError
    text = _message(err)
    assert "overlap along 'time'" in text
    assert str(paths[0]) in text and str(paths[1]) in text
    assert "2020-01-05" in text
    assert list((tmp_path / "out-fail").iterdir()) == []


def test_interleaved_files_are_combined_in_observation_order(ctx: Any, tmp_path: Path) -> None:
    """Odd days in one file, even days in another: every observation once, so in time order."""
    base = cube()
    folder = tmp_path / "data"
    folder.mkdir()
    base.isel(time=slice(0, None, 2)).to_netcdf(folder / "even.nc")
    odd = base.isel(time=slice(1, None, 2))
    # the odd file counts its times from another date: raw numbers differ, times do not
    odd["time"].encoding.update(units="hours since 2019-12-25")
    odd.to_netcdf(folder / "odd.nc")
    out = pipeline(ctx, tmp_path, str(folder / "*.nc"), "interleaved.nc")
    np.testing.assert_array_equal(out["time"].values, base["time"].values)
    check_against_lstsq(out, base["sig"])
    cfg = NetCDFLoad(path=str(folder / "*.nc"), variable="sig")
    meta = {**run(cfg, {}, ctx).meta, SOURCE: locate(cfg, ctx)}
    block = read_block(meta, "cube", Tile(index=0, y0=0, y1=N_Y, x0=0, x1=N_X))
    want = base["sig"].isel(member=0).transpose("time", "lat", "lon").values
    np.testing.assert_array_equal(block, want)


def test_an_observation_in_two_interleaved_files_is_named(ctx: Any, tmp_path: Path) -> None:
    base = cube()
    folder = tmp_path / "data"
    folder.mkdir()
    base.isel(time=slice(0, None, 2)).to_netcdf(folder / "even.nc")
    base.isel(time=[1, 3, 6, 7]).to_netcdf(folder / "odd.nc")  # time 6 is in both
    with pytest.raises(ContractError) as err:
        fail_pipeline(ctx, tmp_path, str(folder / "*.nc"))
    text = _message(err)
    assert "overlap along 'time'" in text and "time = 2020-01-07" in text
    assert str(folder / "even.nc") in text and str(folder / "odd.nc") in text


def test_files_on_different_grids_are_refused(ctx: Any, tmp_path: Path) -> None:
    paths = write_parts(cube(), tmp_path / "data")
    shifted = cube().isel(time=slice(SPLITS[3], SPLITS[4]))
    shifted = shifted.assign_coords(lat=shifted["lat"] + 0.25)
    shifted.to_netcdf(tmp_path / "tmp.nc")
    os.replace(tmp_path / "tmp.nc", paths[3])
    with pytest.raises(ContractError) as err:
        fail_pipeline(ctx, tmp_path, str(tmp_path / "data" / "z-*.nc"))
    assert type(err.value) is ContractError
    text = _message(err)
    assert "different grids" in text and "'lat'" in text
    assert str(paths[3]) in text and str(paths[0]) in text
    assert list((tmp_path / "out-fail").iterdir()) == []


@pytest.mark.parametrize("which", [2, 0], ids=["middle-file", "first-file"])
def test_a_file_lacking_the_cube_is_named(ctx: Any, tmp_path: Path, which: int) -> None:
    paths = write_parts(cube(), tmp_path / "data")
    other = cube().isel(time=slice(SPLITS[which], SPLITS[which + 1])).rename(sig="other")
    other.to_netcdf(tmp_path / "tmp.nc")
    os.replace(tmp_path / "tmp.nc", paths[which])
    with pytest.raises(ContractError) as err:
        fail_pipeline(ctx, tmp_path, str(tmp_path / "data" / "z-*.nc"))
    assert type(err.value) is ContractError
    text = _message(err)
    assert str(paths[which]) in text, text
    assert "'sig'" in text
    assert list((tmp_path / "out-fail").iterdir()) == []


def test_zarr_mixed_with_netcdf_is_refused(ctx: Any, tmp_path: Path, data: list[Path]) -> None:
    store = tmp_path / "cube.zarr"
    cube().to_zarr(store)
    with pytest.raises(ContractError) as err:
        fail_pipeline(ctx, tmp_path, [str(store), str(data[0])])
    assert type(err.value) is ContractError
    assert f"load.path names 1 Zarr store(s) ({store}, …) and 1 other path(s)" in _message(err)
    assert list((tmp_path / "out-fail").iterdir()) == []


def test_empty_list(tmp_path: Path) -> None:
    # the config refuses it before anything runs
    with pytest.raises(ConfigError) as err:
        build_config(sections([], tmp_path / "out.nc", tmp_path / "cache"))
    assert "load.path: Value should have at least 1 item" in _message(err)
    # and the expansion itself, for a config built some other way
    with pytest.raises(InputError, match=r"load\.path is an empty list"):
        expand([])
    assert not (tmp_path / "out.nc").exists()


# ---------------------------------------------------------------- 6. the mid-run guard
def _runner_meta(cfg: NetCDFLoad, ctx: Any) -> dict[str, Any]:
    """The load artifact's meta plus this run's source, as the runner opens it."""
    return {**run(cfg, {}, ctx).meta, SOURCE: locate(cfg, ctx)}


TILE = Tile(index=0, y0=N_Y, y1=2 * N_Y, x0=1, x1=4)  # member 1, all lat, lon 1..3


def _oracle_block() -> np.ndarray:
    return cube()["sig"].isel(member=1, lon=slice(1, 4)).transpose("time", "lat", "lon").values


def test_guard_refuses_a_file_rewritten_in_place(
    ctx: Any, tmp_path: Path, data: list[Path]
) -> None:
    fresh_process_state()
    cfg = NetCDFLoad(path=str(tmp_path / "data" / "z-*.nc"), variable="sig")
    meta = _runner_meta(cfg, ctx)
    np.testing.assert_array_equal(read_block(meta, "cube", TILE), _oracle_block())
    # same name, inode and size, other values: the bytes of a file written elsewhere
    cube(seed=9).isel(time=slice(SPLITS[2], SPLITS[3])).to_netcdf(tmp_path / "other.nc")
    new = (tmp_path / "other.nc").read_bytes()
    assert len(new) == data[2].stat().st_size and new != data[2].read_bytes()
    inode = data[2].stat().st_ino
    with open(data[2], "r+b") as f:
        f.write(new)
    assert data[2].stat().st_ino == inode
    with pytest.raises(InputError, match="changed or vanished") as err:
        read_block(meta, "cube", TILE)
    assert f"input file {data[2]} changed" in str(err.value)  # the file that changed


def test_guard_refuses_a_file_replaced_and_a_file_removed(
    ctx: Any, tmp_path: Path, data: list[Path]
) -> None:
    fresh_process_state()
    cfg = NetCDFLoad(path=[str(p) for p in data], variable="sig")
    meta = _runner_meta(cfg, ctx)
    np.testing.assert_array_equal(read_block(meta, "cube", TILE), _oracle_block())
    cube(seed=9).isel(time=slice(SPLITS[4], SPLITS[5])).to_netcdf(tmp_path / "tmp.nc")
    os.replace(tmp_path / "tmp.nc", data[4])
    with pytest.raises(InputError, match=f"input file {data[4]} changed or vanished"):
        read_block(meta, "cube", TILE)

    meta = _runner_meta(cfg, ctx)  # a new run over the new bytes
    data[1].unlink()
    with pytest.raises(InputError, match=f"input file {data[1]} changed or vanished"):
        read_block(meta, "cube", TILE)


def test_guard_lets_a_touched_file_through(ctx: Any, tmp_path: Path, data: list[Path]) -> None:
    fresh_process_state()
    cfg = NetCDFLoad(path=str(tmp_path / "data" / "z-*.nc"), variable="sig")
    meta = _runner_meta(cfg, ctx)
    st = os.stat(data[3])
    os.utime(data[3], ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))
    np.testing.assert_array_equal(read_block(meta, "cube", TILE), _oracle_block())
    # mtime set back (ctime still moves): still the same bytes, still read
    os.utime(data[3], ns=(st.st_atime_ns, st.st_mtime_ns))
    np.testing.assert_array_equal(read_block(meta, "cube", TILE), _oracle_block())
    # copied over with the same bytes (new inode)
    shutil.copy(data[3], tmp_path / "copy.nc")
    os.replace(tmp_path / "copy.nc", data[3])
    np.testing.assert_array_equal(read_block(meta, "cube", TILE), _oracle_block())


def test_guard_on_a_zarr_store(ctx: Any, tmp_path: Path) -> None:
    fresh_process_state()
    store = tmp_path / "cube.zarr"
    cube().to_zarr(store)
    cfg = NetCDFLoad(path=str(store), variable="sig")
    meta = _runner_meta(cfg, ctx)
    np.testing.assert_array_equal(read_block(meta, "cube", TILE), _oracle_block())
    # rewritten with other values, same layout
    cube(seed=9).to_zarr(store, mode="w")
    with pytest.raises(InputError, match="changed or vanished"):
        read_block(meta, "cube", TILE)


# ---------------------------------------------------------------- 7. gridsolve validate
def test_check_opens_names_the_file_that_is_not_netcdf(tmp_path: Path, data: list[Path]) -> None:
    bad = tmp_path / "data" / "z-9.nc"
    bad.write_text("station,value\n1,2\n")
    with pytest.raises(InputError) as err:
        check_opens(NetCDFLoad(path=str(tmp_path / "data" / "z-*.nc")))
    assert f"input file {bad} is not NetCDF" in str(err.value)
    # the good files alone open
    check_opens(NetCDFLoad(path=str(tmp_path / "data" / "z-[0-4].nc")))


def test_validate_command_on_a_relative_glob(
    tmp_path: Path, data: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gridsolve.yaml"
    raw = sections("data/z-*.nc", tmp_path / "out.nc", tmp_path / "cache")
    config.write_text(yaml.safe_dump(raw))
    assert cli_main(["validate", str(config)]) == 0
    assert "config is valid" in capsys.readouterr().out
    bad = tmp_path / "data" / "z-7.nc"
    bad.write_bytes(b"")
    assert cli_main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"input file {bad} is not NetCDF" in err and "an empty file" in err


# ---------------------------------------------------------------- more: selection and packing
def test_glob_with_a_time_selection_across_files(
    ctx: Any, tmp_path: Path, data: list[Path]
) -> None:
    out_path = tmp_path / "out" / "sel.nc"
    out_path.parent.mkdir()
    raw = sections(str(tmp_path / "data" / "z-*.nc"), out_path, tmp_path / "cache")
    raw["load"]["select"] = {"time": {"start": "2020-01-04", "stop": "2020-01-17"}}
    run_plan(build_config(raw).stage_configs(), ctx)
    with xr.open_dataset(out_path) as ds:
        out = ds.load()
    want = cube()["sig"].sel(time=slice("2020-01-04", "2020-01-17"))
    assert want.sizes["time"] == 14
    np.testing.assert_array_equal(out["time"].values, want["time"].values)
    check_against_lstsq(out, want)


def _packed(ds: xr.Dataset, scale: float, offset: float, valid_pct: float | None) -> xr.Dataset:
    """``ds`` with ``sig`` stored as int16 ``round((sig - offset) / scale)``, -32768 missing.

    With ``valid_pct``, ``valid_min`` is that percentile of the stored values (so the file's
    own valid_min masks about that share of its values).
    """
    stored = np.round((ds["sig"].values - offset) / scale)
    attrs: dict[str, Any] = {}
    if valid_pct is not None:
        attrs["valid_min"] = np.int16(np.nanpercentile(stored, valid_pct))
    stored = np.where(np.isfinite(stored), stored, -32768).astype(np.int16)
    out = ds.copy()
    out["sig"] = (ds["sig"].dims, stored, {**ds["sig"].attrs, **attrs})
    out["sig"].attrs.update(scale_factor=np.float64(scale), add_offset=np.float64(offset))
    out["sig"].encoding = {"_FillValue": np.int16(-32768)}
    return out


def _netcdf4_cube(paths: list[Path]) -> np.ndarray:
    """The files' ``sig`` decoded by netCDF4 itself (its auto mask and scale), along time."""
    import netCDF4

    parts = []
    for p in paths:
        with netCDF4.Dataset(p) as nc:
            parts.append(np.ma.filled(nc["sig"][:].astype(np.float64), np.nan))
    return np.concatenate(parts, axis=0)


@pytest.mark.parametrize("valid", [False, True], ids=["scale-only", "valid-min-per-file"])
def test_packed_files_each_decoded_with_their_own_attributes(
    ctx: Any, tmp_path: Path, valid: bool
) -> None:
    """ERA5-style downloads: every file packed with its own scale_factor / add_offset."""
    base = cube()
    paths = []
    for i, (a, b) in enumerate(itertools.pairwise(SPLITS)):
        part = base.isel(time=slice(a, b))
        # file i: its own packing; with ``valid``, its own valid_min (stored units)
        path = tmp_path / "data" / f"z-{i}.nc"
        path.parent.mkdir(exist_ok=True)
        pct = (30.0 if i == 0 else 5.0) if valid else None
        _packed(part, 0.001 * (i + 1), 2.0 * i - 3.0, pct).to_netcdf(path)
        paths.append(path)
    oracle = _netcdf4_cube(paths)
    masked = np.isnan(oracle).sum() - np.isnan(base["sig"].values).sum()
    if valid:  # each file's own valid_min masks some of its values, not all
        assert 0.05 * oracle.size < masked < 0.3 * oracle.size
    else:
        assert masked == 0
    want = base["sig"].copy(data=oracle)
    out = pipeline(ctx, tmp_path, str(tmp_path / "data" / "z-*.nc"), "packed.nc")
    check_against_lstsq(out, want)


def test_a_file_sets_valid_range_masking_is_reported_once(
    ctx: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each file's own valid_min masks 30 % / 5 %: one warning for the set, with its count."""
    base = cube()
    paths = []
    for i, (a, b) in enumerate(itertools.pairwise(SPLITS[:3])):
        path = tmp_path / "data" / f"v-{i}.nc"
        path.parent.mkdir(exist_ok=True)
        _packed(base.isel(time=slice(a, b)), 0.001, 2.0, 30.0 if i == 0 else 5.0).to_netcdf(path)
        paths.append(path)
    nan_before = int(np.isnan(base["sig"].values[: SPLITS[2]]).sum())
    masked = int(np.isnan(_netcdf4_cube(paths)).sum()) - nan_before
    cfg = NetCDFLoad(path=str(tmp_path / "data" / "v-*.nc"))
    with caplog.at_level(logging.WARNING, logger="gridsolve.load"):
        out = run(cfg, {}, ctx)
        meta = {**out.meta, SOURCE: locate(cfg, ctx)}
        read_block(meta, "cube", Tile(index=0, y0=0, y1=N_Y, x0=0, x1=N_X))
    assert out.meta["nan_count"] == nan_before + masked
    warned = [r.getMessage() for r in caplog.records if "marks" in r.getMessage()]
    assert len(warned) == 1, warned
    size = SPLITS[2] * N_M * N_Y * N_X
    assert f"({masked} of {size})" in warned[0] and "1 other file(s) declare" in warned[0]


def test_first_file_lacking_the_cube_without_load_variable(ctx: Any, tmp_path: Path) -> None:
    """load.variable unset: the cube is inferred; a stray first file must still be named."""
    paths = write_parts(cube(), tmp_path / "data")
    stray = tmp_path / "data" / "a-stray.nc"
    xr.Dataset({"mask": (("lat", "lon"), np.ones((N_Y, N_X)))}).to_netcdf(stray)
    out = tmp_path / "out-fail" / "out.nc"
    out.parent.mkdir()
    raw = sections(str(tmp_path / "data" / "*.nc"), out, tmp_path / "cache")
    del raw["load"]["variable"]
    with pytest.raises(ContractError) as err:
        run_plan(build_config(raw).stage_configs(), ctx)
    assert str(stray) in str(err.value), str(err.value)
    assert not out.exists()
    assert len(paths) == 5


def test_files_in_different_calendars_are_refused(ctx: Any, tmp_path: Path) -> None:
    paths = write_parts(cube(), tmp_path / "data", (0, 5, 10))
    part = cube().isel(time=slice(5, 10))
    part["time"].encoding.update(units="hours since 2000-01-01", dtype="float64")
    part["time"].encoding.update(calendar="julian")
    part.to_netcdf(paths[1])
    with pytest.raises(ContractError) as err:
        fail_pipeline(ctx, tmp_path, str(tmp_path / "data" / "z-*.nc"))
    text = _message(err)
    assert "store 'time' in different calendars" in text and str(paths[1]) in text


def test_a_folder_named_like_a_glob_is_a_folder(ctx: Any, tmp_path: Path) -> None:
    folder = tmp_path / "exp[2]"
    folder.mkdir()
    path = folder / "cube.nc"
    cube().to_netcdf(path)
    assert expand(str(path)) == [str(path)]


def test_files_without_an_obs_coordinate_are_named(ctx: Any, tmp_path: Path) -> None:
    paths = write_parts(cube().drop_vars("time"), tmp_path / "data", (0, 5, 10))
    with pytest.raises(ContractError) as err:
        fail_pipeline(ctx, tmp_path, str(tmp_path / "data" / "z-*.nc"))
    text = _message(err)
    assert "without a 'time' coordinate cannot be put in order" in text
    assert all(str(p) in text for p in paths)
