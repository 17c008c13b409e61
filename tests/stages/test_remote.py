"""Object storage through s3fs against a real S3 server (moto, authentication enforced).

Inputs (a NetCDF object, a glob of objects, a Zarr store), outputs (NetCDF
and Zarr) and the cache in a bucket give what the same run gives on local
disk, and the failures a user meets (no bucket, wrong credentials, an output
that may not be replaced) each get one message and leave nothing behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr

from gridsolve.report.maps import open_output
from gridsolve.schemas.errors import ConfigError, GridsolveError, InputError, OutputError
from gridsolve.schemas.pipeline import build_config
from gridsolve.stages.engine import remote
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.store import StageOutput, open_store

from testkit import make_ds, run_plan

#: Attributes that name where the output and inputs are (they differ by design).
WHERE = {"history", "gridsolve_config", "gridsolve_keys"}


def sections(load_path: str, out: str, cache: str, **load: Any) -> dict[str, Any]:
    return {
        "load": {"path": load_path, **load},
        "design": {"impl": "harmonic", "harmonics": 1},
        "solve": {"dtype": "float64", "uncertainty": "cov"},
        "model": {"input_dim": 2, "hidden_dim": 2, "output_dim": 1},
        "write": {"impl": "zarr" if out.endswith(".zarr") else "netcdf", "path": out},
        "cache": {"root": cache},
    }


def run(sect: dict[str, Any]) -> None:
    cfg = build_config(sect)
    store = open_store(cfg.cache.root, cfg.cache.storage_options)
    run_plan(cfg.stage_configs(), StageContext(store=store, memory_budget=2**28), tile_pixels=11)


def load(path: str) -> xr.Dataset:
    with open_output(path) as ds:
        out = ds.load()
    out.attrs = {k: v for k, v in out.attrs.items() if k not in WHERE}
    return out


@pytest.fixture
def cube() -> xr.Dataset:
    return make_ds(n_obs=24, ny=7, nx=6, nan_fraction=0.1, seed=5)


@pytest.fixture
def local_out(tmp_path: Path, cube: xr.Dataset) -> xr.Dataset:
    cube.to_netcdf(tmp_path / "cube.nc")
    out = str(tmp_path / "local.nc")
    run(sections(str(tmp_path / "cube.nc"), out, str(tmp_path / "cache-local")))
    return load(out)


def test_lstsq_oracle_on_the_local_run(local_out: xr.Dataset, cube: xr.Dataset) -> None:
    """The reference every bucket run is compared with is itself right (numpy lstsq)."""
    a = local_out["design"].values
    y = cube["signal"].values
    coef = local_out["coefficients"].values
    for i in range(y.shape[1]):
        for j in range(y.shape[2]):
            ok = np.isfinite(y[:, i, j])
            if ok.sum() < a.shape[1]:
                continue
            expected = np.linalg.lstsq(a[ok], y[ok, i, j], rcond=None)[0]
            np.testing.assert_allclose(coef[:, i, j], expected, rtol=1e-8, atol=1e-10)


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.parametrize("layout", ["file", "glob", "zarr"])
def test_inputs_in_a_bucket_give_the_local_output(
    s3: Any, tmp_path: Path, cube: xr.Dataset, local_out: xr.Dataset, layout: str
) -> None:
    fs = s3.fs
    if layout == "file":
        cube.to_netcdf(tmp_path / "up.nc")
        fs.put_file(str(tmp_path / "up.nc"), f"{s3.bucket}/in/cube.nc")
        src = s3.url("in/cube.nc")
    elif layout == "glob":
        for i, (a, b) in enumerate(((0, 9), (9, 17), (17, 24))):
            cube.isel(time=slice(a, b)).to_netcdf(tmp_path / f"part-{i}.nc")
            fs.put_file(str(tmp_path / f"part-{i}.nc"), f"{s3.bucket}/in/part-{i}.nc")
        src = s3.url("in/part-*.nc")
    else:
        cube.to_zarr(tmp_path / "cube.zarr", zarr_format=2)
        fs.put(str(tmp_path / "cube.zarr"), f"{s3.bucket}/in/cube.zarr", recursive=True)
        src = s3.url("in/cube.zarr")
    out = str(tmp_path / "from-bucket.nc")
    run(sections(src, out, str(tmp_path / "cache")))
    got = load(out)
    for name in ("coefficients", "residual_rms", "n_valid", "status", "prediction"):
        np.testing.assert_allclose(got[name].values, local_out[name].values, rtol=1e-12)
    # The key covers the objects' ETags: a second object version is a new input.
    cube2 = cube.copy(deep=True)
    cube2["signal"][:] = cube2["signal"] + 1.0
    if layout == "file":
        cube2.to_netcdf(tmp_path / "up2.nc")
        fs.put_file(str(tmp_path / "up2.nc"), f"{s3.bucket}/in/cube.nc")
        run(sections(src, out, str(tmp_path / "cache")))
        np.testing.assert_allclose(
            load(out)["coefficients"].isel(coef=0).values,
            local_out["coefficients"].isel(coef=0).values + 1.0,
            rtol=1e-10,
        )


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_outputs_in_a_bucket_equal_the_local_output(
    s3: Any, tmp_path: Path, cube: xr.Dataset, local_out: xr.Dataset
) -> None:
    src = str(tmp_path / "cube.nc")
    for name in ("out.nc", "out.zarr"):
        run(sections(src, s3.url(name), str(tmp_path / "cache")))
        got = load(s3.url(name))
        xr.testing.assert_allclose(got, local_out, rtol=1e-12)
        assert got.attrs == local_out.attrs
    keys = s3.objects()
    assert "out.nc" in keys and "out.zarr/.zmetadata" in keys
    assert not [k for k in keys if "gridsolve~" in k or "probe" in k], keys
    assert not list((tmp_path / "mirror" / "outputs").rglob("*.nc")), "local staging left"
    # write.overwrite false: refused before anything changes.
    before = s3.fs.info(f"{s3.bucket}/out.nc")["ETag"]
    sect = sections(src, s3.url("out.nc"), str(tmp_path / "cache"))
    sect["write"]["overwrite"] = False
    with pytest.raises(OutputError, match=r"exists and write\.overwrite is false"):
        run(sect)
    assert s3.fs.info(f"{s3.bucket}/out.nc")["ETag"] == before


def test_the_cache_in_a_bucket_serves_a_host_with_an_empty_disk(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arrays = {"a": np.arange(12.0).reshape(3, 4), "b": np.array([1, 2, 3], dtype=np.int8)}
    key = "0123456789abcdef0123456789abcdef"
    monkeypatch.setenv(remote.MIRROR_ENV, str(tmp_path / "host-a"))
    a = open_store(s3.url("cache"))
    assert a.location == s3.url("cache")  # one Store class; the bucket is where it lives
    assert a.check(key)[0] == "miss"
    a.put(key, StageOutput(arrays=arrays, meta={"m": 1}), {"kind": "test"})
    objects = [k for k in s3.objects() if k.startswith("cache/objects/")]
    assert objects[-1].endswith("manifest.json") and len(objects) == 3
    # Another host: nothing on its disk, the artifact comes from the bucket, checked.
    monkeypatch.setenv(remote.MIRROR_ENV, str(tmp_path / "host-b"))
    b = open_store(s3.url("cache"))
    assert b.root != a.root
    assert b.lookup(key) == ("hit", "")
    got = b.get(key)
    assert got.meta == {"m": 1}
    for name, arr in arrays.items():
        np.testing.assert_array_equal(got.array(name), arr)
    assert (b.root / "objects" / key[:2] / key).is_dir()
    # An array damaged in the bucket: a third host finds it corrupt; it is deleted there.
    damaged = next(k for k in objects if k.endswith(".npy"))
    s3.fs.pipe_file(f"{s3.bucket}/{damaged}", b"not the array")
    monkeypatch.setenv(remote.MIRROR_ENV, str(tmp_path / "host-c"))
    c = open_store(s3.url("cache"))
    status, why = c.lookup(key)
    assert status == "corrupt" and "checksum" in why
    assert not [k for k in s3.objects() if key in k]
    assert c.check(key)[0] == "miss"


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_a_whole_run_with_the_cache_in_a_bucket(
    s3: Any,
    tmp_path: Path,
    cube: xr.Dataset,
    local_out: xr.Dataset,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = str(tmp_path / "cube.nc")
    out = s3.url("out.zarr")
    run(sections(src, out, s3.url("cache")))
    xr.testing.assert_allclose(load(out), local_out, rtol=1e-12)
    n = len(s3.objects())
    # A host with an empty disk reuses every stage from the bucket: nothing is uploaded.
    monkeypatch.setenv(remote.MIRROR_ENV, str(tmp_path / "other-host"))
    run(sections(src, out, s3.url("cache")))
    assert len(s3.objects()) == n
    xr.testing.assert_allclose(load(out), local_out, rtol=1e-12)


# ---------------------------------------------------------------- what users get wrong
def test_a_bucket_that_does_not_exist(s3: Any, tmp_path: Path, cube: xr.Dataset) -> None:
    cube.to_netcdf(tmp_path / "cube.nc")
    src = str(tmp_path / "cube.nc")
    cases = [
        (
            sections("s3://no-such-bucket-x/cube.nc", str(tmp_path / "o.nc"), str(tmp_path / "c")),
            InputError,
        ),
        (sections(src, "s3://no-such-bucket-x/o.nc", str(tmp_path / "c")), OutputError),
        (sections(src, str(tmp_path / "o.nc"), "s3://no-such-bucket-x/cache"), GridsolveError),
    ]
    for sect, cls in cases:
        with pytest.raises(cls) as err:
            run(sect)
        text = str(err.value)
        assert "bucket 'no-such-bucket-x'" in text and "does not exist" in text, text
        assert "fix:" in text
    assert not (tmp_path / "o.nc").exists()


def test_wrong_credentials_name_the_fix_and_never_show_the_secret(
    s3: Any, tmp_path: Path, cube: xr.Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    cube.to_netcdf(tmp_path / "cube.nc")
    s3.fs.put_file(str(tmp_path / "cube.nc"), f"{s3.bucket}/cube.nc")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    from s3server import forget_filesystems

    forget_filesystems()
    cases = [
        (sections(s3.url("cube.nc"), str(tmp_path / "o.nc"), str(tmp_path / "c")), InputError),
        (sections(str(tmp_path / "cube.nc"), s3.url("o.zarr"), str(tmp_path / "c")), OutputError),
        (sections(str(tmp_path / "cube.nc"), str(tmp_path / "o.nc"), s3.url("cache")), Exception),
    ]
    for sect, cls in cases:
        with pytest.raises(cls) as err:
            run(sect)
        text = str(err.value)
        assert "refused access" in text and "AWS_SECRET_ACCESS_KEY" in text, text
        assert "wrong-secret-value" not in text and s3.server.secret not in text
    assert not (tmp_path / "o.nc").exists()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.server.secret)
    assert s3.objects() == ["cube.nc"]  # nothing written by the refused runs


def test_credentials_in_the_config_are_refused() -> None:
    sect = sections("s3://b/cube.nc", "out.nc", "cache")
    sect["load"]["storage_options"] = {"key": "AKIA", "secret": "s3cr3t-value"}
    with pytest.raises(ConfigError) as err:
        build_config(sect)
    assert "may not hold credentials" in str(err.value)
    assert "s3cr3t-value" not in str(err.value)


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_a_failed_zarr_write_leaves_nothing_in_the_bucket(
    s3: Any, tmp_path: Path, cube: xr.Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    cube.to_netcdf(tmp_path / "cube.nc")
    from gridsolve.stages.write import zarr as zarr_writer

    def boom(*args: Any, **kwargs: Any) -> None:
        raise OSError("connection reset while writing chunks")

    monkeypatch.setattr(zarr_writer, "_write_tiles", boom)
    with pytest.raises(GridsolveError):
        run(sections(str(tmp_path / "cube.nc"), s3.url("out.zarr"), str(tmp_path / "c")))
    assert not [k for k in s3.objects() if k.startswith("out.zarr")], s3.objects()


def test_a_local_path_is_not_a_url() -> None:
    assert remote.is_url("s3://b/k") and remote.is_url("gs://b/k")
    assert not remote.is_url("/data/x.nc") and not remote.is_url("file:///data/x.nc")
    assert not remote.is_url("data/s3:/x.nc")
    assert os.environ.get(remote.MIRROR_ENV) is None or True


def test_a_missing_object_whose_name_holds_403_is_not_found(s3: Any, tmp_path: Path) -> None:
    sect = sections(s3.url("sst/sst-20240403.nc"), str(tmp_path / "o.nc"), str(tmp_path / "c"))
    with pytest.raises(InputError) as err:
        run(sect)
    assert "input file not found: s3://" in str(err.value), str(err.value)
    assert "refused access" not in str(err.value)


def test_writes_confined_to_allowed_roots_and_urls(
    s3: Any, tmp_path: Path, cube: xr.Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    cube.to_netcdf(tmp_path / "cube.nc")
    (tmp_path / "allowed").mkdir()
    monkeypatch.setenv("GRIDSOLVE_ALLOWED_ROOTS", str(tmp_path / "allowed"))
    monkeypatch.setenv("GRIDSOLVE_ALLOWED_URLS", s3.url("results"))
    cache = str(tmp_path / "allowed" / "cache")
    # the local copy staged for the upload lives in the mirror, outside the roots: allowed
    run(sections(str(tmp_path / "cube.nc"), s3.url("results/out.nc"), cache))
    assert "results/out.nc" in s3.objects()
    with pytest.raises(OutputError, match="outside the places this worker may write to"):
        run(sections(str(tmp_path / "cube.nc"), s3.url("elsewhere/out.nc"), cache))
    assert not [k for k in s3.objects() if k.startswith("elsewhere")]


def test_only_s3_urls_are_accepted() -> None:
    for section, field, url in (
        ("load", "path", "http://example.org/cube.nc"),
        ("write", "path", "gs://bucket/out.nc"),
        ("cache", "root", "https://example.org/cache"),
    ):
        sect = sections("cube.nc", "out.nc", "cache")
        sect[section][field] = url
        with pytest.raises(ConfigError, match="only s3:// URLs are supported"):
            build_config(sect)


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_zarr_output_replaces_what_a_killed_writer_left_but_not_other_data(
    s3: Any, tmp_path: Path, cube: xr.Dataset, local_out: xr.Dataset
) -> None:
    src = str(tmp_path / "cube.nc")
    s3.fs.pipe_file(f"{s3.bucket}/out.zarr/.gridsolve-writing", b"gridsolve")
    s3.fs.pipe_file(f"{s3.bucket}/out.zarr/coefficients/0.0.0", b"half")
    run(sections(src, s3.url("out.zarr"), str(tmp_path / "cache")))
    xr.testing.assert_allclose(load(s3.url("out.zarr")), local_out, rtol=1e-12)
    assert "out.zarr/.gridsolve-writing" not in s3.objects()
    s3.fs.pipe_file(f"{s3.bucket}/theirs.zarr/notes.txt", b"someone's data")
    with pytest.raises(OutputError, match="not a gridsolve Zarr store"):
        run(sections(src, s3.url("theirs.zarr"), str(tmp_path / "cache")))
    assert s3.fs.cat_file(f"{s3.bucket}/theirs.zarr/notes.txt") == b"someone's data"
    # gridsolve's own complete store is replaced; a consolidated store xarray wrote is not
    run(sections(src, s3.url("out.zarr"), str(tmp_path / "cache-2")))
    xr.testing.assert_allclose(load(s3.url("out.zarr")), local_out, rtol=1e-12)
    cube.to_zarr(tmp_path / "xr.zarr", zarr_format=2, consolidated=True)
    s3.fs.put(str(tmp_path / "xr.zarr"), f"{s3.bucket}/xr.zarr", recursive=True)
    before = s3.fs.cat_file(f"{s3.bucket}/xr.zarr/.zmetadata")
    with pytest.raises(OutputError, match=r"\[write/zarr\] .* not a gridsolve Zarr store"):
        run(sections(src, s3.url("xr.zarr"), str(tmp_path / "cache")))
    assert s3.fs.cat_file(f"{s3.bucket}/xr.zarr/.zmetadata") == before


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_quick_look_of_a_bucket_output_uses_the_write_storage_options(
    s3: Any, tmp_path: Path, cube: xr.Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gridsolve.report.pictures import write_quicklook

    cube.to_netcdf(tmp_path / "cube.nc")
    src = str(tmp_path / "cube.nc")
    run(sections(src, s3.url("out.zarr"), str(tmp_path / "cache")))
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    from s3server import forget_filesystems

    forget_filesystems()
    picture, png, _ = write_quicklook(s3.url("out.zarr"), {"endpoint_url": endpoint})
    assert picture == s3.url("out.zarr.quicklook.png") and png.startswith(b"\x89PNG")
    assert "out.zarr.quicklook.png" in s3.objects()


def test_an_artifact_the_bucket_did_not_take_is_not_kept_here(
    s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(s3.url("cache"))
    assert store.location == s3.url("cache")
    key = "fedcba9876543210fedcba9876543210"

    def refused(*args: Any) -> None:
        raise PermissionError("AccessDenied")

    with monkeypatch.context() as m:
        m.setattr(store, "_upload", refused)
        with pytest.raises(PermissionError):
            store.put(key, StageOutput(arrays={"a": np.zeros(3)}), {"kind": "test"})
    assert not store.path(key).exists()
    assert store.check(key)[0] == "miss"
