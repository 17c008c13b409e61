"""Chunks compressed by the writer itself and stored with HDF5's direct chunk write.

The oracle is the netCDF library: the same variable written by netCDF4 the
ordinary way must read back identical, through netCDF4, h5py and xarray.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import h5py
import netCDF4
import numpy as np
import pytest
import xarray as xr

from gridsolve.stages.write.direct import DEFLATE, SHUFFLE, ChunkWriter, pipeline


def define(
    path: Path, dtype: str, shape: tuple[int, ...], chunks: tuple[int, ...], **kw: Any
) -> None:
    with netCDF4.Dataset(path, "w") as nc:
        for i, n in enumerate(shape):
            nc.createDimension(f"d{i}", n)
        fill = np.nan if np.dtype(dtype).kind == "f" else None
        nc.createVariable(
            "v",
            dtype,
            tuple(f"d{i}" for i in range(len(shape))),
            chunksizes=chunks,
            fill_value=fill,
            **kw,
        )


def blocks(shape: tuple[int, ...], tile: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """The writer's order: the last two dims in tiles, the others whole."""
    ny, nx = shape[-2:]
    lead = tuple(slice(0, n) for n in shape[:-2])
    return [
        (*lead, slice(y, min(y + tile[0], ny)), slice(x, min(x + tile[1], nx)))
        for y in range(0, ny, tile[0])
        for x in range(0, nx, tile[1])
    ]


def sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(7)
    if np.dtype(dtype).kind == "f":
        a = rng.standard_normal(shape).astype(dtype)
        a[rng.random(shape) < 0.1] = np.nan
        return a
    return rng.integers(-100, 100, shape).astype(dtype)


CASES = {
    "float32, shuffle + deflate, edge chunks": (
        "f4",
        (3, 70, 90),
        (1, 32, 32),
        (32, 64),
        {"zlib": True, "complevel": 1, "shuffle": True},
    ),
    "float64, deflate 6, no shuffle": (
        "f8",
        (2, 64, 64),
        (1, 32, 32),
        (32, 32),
        {"zlib": True, "complevel": 6, "shuffle": False},
    ),
    "int8, shuffle + deflate": (
        "i1",
        (40, 50),
        (16, 16),
        (16, 32),
        {"zlib": True, "complevel": 1, "shuffle": True},
    ),
    "int32, no filters": ("i4", (40, 50), (16, 16), (16, 16), {"zlib": False}),
    "tiles not on the chunk grid (written the ordinary way)": (
        "f4",
        (2, 50, 50),
        (1, 16, 16),
        (20, 20),
        {"zlib": True, "complevel": 1},
    ),
    "fletcher32 (a filter it lacks: the ordinary way)": (
        "f4",
        (2, 40, 40),
        (1, 16, 16),
        (16, 16),
        {"zlib": True, "complevel": 1, "fletcher32": True},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reads_back_as_the_netcdf_library_writes_it(tmp_path: Path, case: str) -> None:
    dtype, shape, chunks, tile, kw = CASES[case]
    data = sample(dtype, shape)
    ref, got = tmp_path / "ref.nc", tmp_path / "got.nc"
    define(ref, dtype, shape, chunks, **kw)
    with netCDF4.Dataset(ref, "a") as nc:
        nc["v"][:] = data
    define(got, dtype, shape, chunks, **kw)
    with ChunkWriter(got, threads=2) as out:
        for index in blocks(shape, tile):
            out.write("v", index, data[index])
    ordinary = "ordinary way" in case
    assert (out.direct, out.ordinary > 0) == (0 if ordinary else len(blocks(shape, tile)), ordinary)
    with netCDF4.Dataset(ref) as a, netCDF4.Dataset(got) as b:
        np.testing.assert_array_equal(
            b["v"][:].filled(np.nan if dtype[0] == "f" else 0),
            a["v"][:].filled(np.nan if dtype[0] == "f" else 0),
        )
    with h5py.File(got) as f:
        np.testing.assert_array_equal(f["v"][...], data)
    with xr.open_dataset(got, mask_and_scale=False) as ds:
        np.testing.assert_array_equal(ds["v"].values, data)


def test_supported_pipelines_are_told_apart(tmp_path: Path) -> None:
    assert (DEFLATE, SHUFFLE) == (h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_SHUFFLE)
    expect = {
        "a": ({"zlib": True, "complevel": 3, "shuffle": True}, (True, 3)),
        "b": ({"zlib": True, "complevel": 1, "shuffle": False}, (False, 1)),
        "c": ({"zlib": False}, (False, None)),
        "d": ({"zlib": True, "complevel": 1, "fletcher32": True}, None),
    }
    for name, (kw, how) in expect.items():
        path = tmp_path / f"{name}.nc"
        define(path, "f4", (8, 8), (4, 4), **kw)
        with h5py.File(path) as f:
            assert pipeline(f["v"]) == how, name


def test_the_file_is_the_same_whatever_the_threads(tmp_path: Path) -> None:
    shape, chunks = (4, 96, 96), (1, 32, 32)
    data = sample("f4", shape)
    digests = []
    for threads in (1, 2, 3):
        path = tmp_path / f"t{threads}.nc"
        define(path, "f4", shape, chunks, zlib=True, complevel=1, shuffle=True)
        with ChunkWriter(path, threads=threads) as out:
            for index in blocks(shape, (64, 64)):
                out.write("v", index, data[index])
        digests.append(hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(set(digests)) == 1


def test_a_block_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "v.nc"
    define(path, "f4", (32, 32), (16, 16), zlib=True, complevel=1)
    with ChunkWriter(path) as out, pytest.raises(ValueError, match="shape"):
        out.write("v", (slice(0, 16), slice(0, 32)), np.zeros((16, 16), np.float32))


def test_an_unlimited_dim_grows_to_what_is_written(tmp_path: Path) -> None:
    data = sample("f4", (3, 40, 40))
    path = tmp_path / "u.nc"
    with netCDF4.Dataset(path, "w") as nc:
        nc.createDimension("t", None)
        nc.createDimension("y", 40)
        nc.createDimension("x", 40)
        nc.createVariable(
            "v", "f4", ("t", "y", "x"), zlib=True, complevel=1, chunksizes=(1, 20, 20)
        )
    with ChunkWriter(path) as out:
        for index in blocks((3, 40, 40), (20, 20)):
            out.write("v", index, data[index])
    assert out.direct == 4
    with netCDF4.Dataset(path) as nc:
        assert len(nc.dimensions["t"]) == 3 and nc.dimensions["t"].isunlimited()
        np.testing.assert_array_equal(nc["v"][:].filled(np.nan), data)


@pytest.mark.parametrize("level", [1, 2, 3, 4, 9])
def test_deflate_levels_inflate_to_the_data(level: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import zlib

    from gridsolve.stages.write import direct

    has_isal = direct.isal_zlib is not None
    raw = np.frombuffer(sample("f4", (64, 64)).tobytes(), np.uint8).reshape(-1, 4).T.tobytes()
    fast = direct.deflate(raw, level)
    assert zlib.decompress(fast) == raw  # a standard zlib stream, as HDF5's filter reads it
    monkeypatch.setattr(direct, "isal_zlib", None)  # a platform without ISA-L's wheel
    plain = direct.deflate(raw, level)
    assert plain == zlib.compress(raw, level)
    # ISA-L for the fast levels (where its wheel is installed), zlib for the small ones
    assert (fast != plain) == (has_isal and level <= direct.ISAL_MAX_LEVEL)


def test_file_without_isal_reads_back_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gridsolve.stages.write import direct

    has_isal = direct.isal_zlib is not None
    data = sample("f4", (3, 40, 40))
    files = {}
    for name, isal in (("isal", direct.isal_zlib), ("zlib", None)):
        monkeypatch.setattr(direct, "isal_zlib", isal)
        files[name] = tmp_path / f"{name}.nc"
        define(files[name], "f4", data.shape, (1, 20, 20), zlib=True, complevel=1, shuffle=True)
        with ChunkWriter(files[name], threads=2) as out:
            out.write("v", (slice(0, 3), slice(0, 40), slice(0, 40)), data)
        assert out.direct == 1
    with netCDF4.Dataset(files["isal"]) as a, netCDF4.Dataset(files["zlib"]) as b:
        assert a["v"].filters()["zlib"] and a["v"].filters()["complevel"] == 1
        got, want = a["v"][:].filled(np.nan), b["v"][:].filled(np.nan)
    assert got.tobytes() == want.tobytes() == data.tobytes()
    if has_isal:  # other compressed bytes, the same data
        assert files["isal"].read_bytes() != files["zlib"].read_bytes()
