"""No run destroys data: outputs that resolve to what a run reads are refused before any work.

Through the command line, as a user meets it: `gridsolve run` and `gridsolve
validate` exit 2 with one message naming both paths, and the input's bytes
(a file, or every file of a Zarr store) are what they were.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xarray as xr
import yaml

from gridsolve.schemas.errors import ConfigError
from gridsolve.schemas.reading import load_config

from testkit import make_ds

GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")


def gridsolve(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GRIDSOLVE, *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=os.environ
    )


def assert_clean_failure(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    for n in needles:
        assert n in res.stderr, res.stderr


def tree_digest(path: Path) -> str:
    """sha256 over every file's relative name and bytes (a file: its bytes)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def config(folder: Path, load: str, write: dict[str, Any], **extra: Any) -> Path:
    raw = {
        "load": {"path": load, "variable": "signal"},
        "design": {"impl": "polynomial", "degree": 1},
        "model": {"input_dim": 2, "hidden_dim": 1},
        "write": write,
        "cache": {"root": "cache"},
        **extra,
    }
    p = folder / "gridsolve.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def refused_by_run_and_validate(cfg: Path, protected: Path, *needles: str) -> None:
    """Both commands exit 2 naming ``needles``; ``protected`` unchanged, no cache made."""
    before = tree_digest(protected)
    for command in ("validate", "run"):
        res = gridsolve(command, str(cfg), cwd=cfg.parent)
        assert_clean_failure(res, "write.path must differ from", *needles)
        assert res.stderr.count("error:") == 1, res.stderr  # one message
        assert tree_digest(protected) == before, command
    assert not (cfg.parent / "cache").exists()  # nothing was written, not even the cache


def _same(cube: Path) -> Path:
    return cube


def _symlink(cube: Path) -> Path:
    link = cube.with_name("link.nc")
    link.symlink_to(cube.name)
    return link


def _hard_link(cube: Path) -> Path:
    hard = cube.with_name("hard.nc")
    os.link(cube, hard)
    return hard


def _dotted(cube: Path) -> Path:
    (cube.parent / "sub").mkdir()
    return cube.parent / "sub" / ".." / cube.name


@pytest.mark.parametrize(
    "name_of", [_same, _symlink, _hard_link, _dotted], ids=["same", "symlink", "hardlink", "dotdot"]
)
def test_output_that_is_the_input_file_is_refused(
    tmp_path: Path, name_of: Callable[[Path], Path]
) -> None:
    cube = tmp_path / "cube.nc"
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(cube)
    out = name_of(cube)
    cfg = config(tmp_path, "cube.nc", {"path": str(out)})
    refused_by_run_and_validate(
        cfg, cube, f"write.path {os.path.normpath(out)}", f"load.path {cube}"
    )


def test_output_that_is_the_config_file_is_refused(tmp_path: Path) -> None:
    cube = tmp_path / "cube.nc"
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(cube)
    cfg = config(tmp_path, "cube.nc", {"path": "gridsolve.yaml"})
    refused_by_run_and_validate(cfg, cfg, f"the config file {cfg}")


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_output_matching_an_input_glob_or_template_is_refused(tmp_path: Path) -> None:
    """Globs and lists are checked against the files they match; templates filled as a run."""
    for i in range(2):
        make_ds(n_obs=4, ny=3, nx=4, seed=i).to_netcdf(tmp_path / f"part-{i}.nc")
    cfg = config(tmp_path, "part-*.nc", {"path": "part-1.nc"})
    refused_by_run_and_validate(cfg, tmp_path / "part-1.nc", f"load.path {tmp_path / 'part-1.nc'}")
    from datetime import UTC, datetime

    today = datetime.now(UTC).strftime("%Y-%m-%d")
    dated = tmp_path / f"sst-{today}.nc"
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(dated)
    cfg = config(tmp_path, "sst-{date}.nc", {"path": f"sst-{today}.nc"})
    refused_by_run_and_validate(cfg, dated, str(dated))


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_output_inside_the_cache_or_holding_an_input_is_refused(tmp_path: Path) -> None:
    cube = tmp_path / "data" / "cube.nc"
    cube.parent.mkdir()
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(cube)
    cfg = config(tmp_path, "data/cube.nc", {"path": "cache/out.nc"})
    refused_by_run_and_validate(cfg, cube, "lies inside cache.root")
    # a Zarr output replaces its folder as a whole: one that holds the input is refused
    cfg = config(tmp_path, "data/cube.nc", {"impl": "zarr", "path": "data"})
    refused_by_run_and_validate(cfg, cube, f"write.path {cube.parent} contains load.path {cube}")


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("impl", ["zarr", "netcdf"])
def test_output_that_is_an_input_zarr_store_is_refused(
    tmp_path: Path, zarr_format: int, impl: str
) -> None:
    store = tmp_path / "input.zarr"
    make_ds(n_obs=8, ny=3, nx=4).to_zarr(store, zarr_format=zarr_format, mode="w")
    cfg = config(tmp_path, "input.zarr", {"impl": impl, "path": "input.zarr"})
    refused_by_run_and_validate(cfg, store, f"[write/{impl}]", f"load.path {store}")
    # and a path inside the store, too
    cfg = config(tmp_path, "input.zarr", {"impl": impl, "path": "input.zarr/signal/out"})
    refused_by_run_and_validate(cfg, store, "lies inside load.path")


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_trained_weights_over_the_weights_read_are_refused(tmp_path: Path) -> None:
    """With training on, ``<write.path>.weights.safetensors`` is written: never the one read."""
    cube = tmp_path / "cube.nc"
    ds = make_ds(n_obs=8, ny=3, nx=4)
    ds["tgt"] = ds["signal"].mean("time")
    ds.to_netcdf(cube)
    weights = tmp_path / "out.nc.weights.safetensors"
    weights.write_bytes(b"weights a user trained elsewhere")
    cfg = config(
        tmp_path,
        "cube.nc",
        {"path": "out.nc"},
        train={"impl": "adam", "epochs": 1},
        model={
            "input_dim": 2,
            "hidden_dim": 1,
            "objective": "mse",
            "weights": weights.name,
        },
    )
    raw = yaml.safe_load(cfg.read_text())
    raw["load"]["target"] = "tgt"
    cfg.write_text(yaml.safe_dump(raw))
    refused_by_run_and_validate(cfg, weights, "the trained weights", f"model.weights {weights}")


def test_object_store_urls_are_compared_normalised(tmp_path: Path) -> None:
    from gridsolve.stages.engine.overlap import refuse_destructive_outputs

    cfg = config(tmp_path, "s3://Bucket/data/cube.nc", {"path": "s3://bucket//data/x/../cube.nc"})
    with pytest.raises(
        ConfigError, match=re.escape("resolves to load.path s3://Bucket/data/cube.nc")
    ):
        refuse_destructive_outputs(load_config(cfg))
    cfg = config(tmp_path, "s3://bucket/data/*.nc", {"path": "s3://bucket/data/out.nc"})
    with pytest.raises(ConfigError, match=r"is matched by load\.path"):
        refuse_destructive_outputs(load_config(cfg))
    cfg = config(tmp_path, "s3://bucket/data/cube.nc", {"path": "s3://bucket/out/cube.nc"})
    refuse_destructive_outputs(load_config(cfg))  # another key: fine


def test_a_separate_output_still_validates(tmp_path: Path) -> None:
    cube = tmp_path / "cube.nc"
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(cube)
    cfg = config(tmp_path, "cube.nc", {"path": "out.nc"})
    res = gridsolve("validate", str(cfg))
    assert res.returncode == 0 and "config is valid" in res.stdout, res.stderr


@pytest.mark.usefixtures("prefect_server")
def test_the_flow_itself_refuses(tmp_path: Path) -> None:
    """A run triggered in the Prefect UI starts at the flow: it refuses as the CLI does."""
    from gridsolve.flows.pipeline import run_config

    cube = tmp_path / "cube.nc"
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(cube)
    os.link(cube, tmp_path / "hard.nc")
    before = tree_digest(cube)
    cfg = load_config(config(tmp_path, "cube.nc", {"path": "hard.nc"}))
    with pytest.raises(ConfigError, match=r"is the same file as load\.path"):
        run_config(cfg)
    assert tree_digest(cube) == before
    with xr.open_dataset(cube) as ds:
        assert "gridsolve_config" not in ds.attrs


MODEL = {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 1, "output_dim": 1}


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.usefixtures("prefect_server")
def test_keep_last_never_deletes_an_old_output_the_run_reads(tmp_path: Path) -> None:
    """An older output that is the run's load.path, or whose weights are model.weights, stays.

    Both are kept without counting toward keep_last: the one older output the
    run does not read is still removed (the log line: tests/stages/test_retention.py).
    """
    ko = tmp_path / "ko"
    ko.mkdir()
    cube = tmp_path / "cube.nc"
    ds = make_ds(n_obs=8, ny=3, nx=4)
    ds["tgt"] = ds["signal"].mean("time")
    ds.to_netcdf(cube)
    trained = config(
        tmp_path,
        "cube.nc",
        {"path": "ko/x-2020-01-02.nc"},
        train={"impl": "adam", "epochs": 1, "validation_fraction": 0, "early_stopping": None},
        model={**MODEL, "objective": "mse"},
    )
    raw = yaml.safe_load(trained.read_text())
    raw["load"]["target"] = "tgt"
    trained.write_text(yaml.safe_dump(raw))
    res = gridsolve("run", str(trained), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    weights = ko / "x-2020-01-02.nc.weights.safetensors"
    assert weights.exists()
    read_cube = ko / "x-2020-01-01.nc"  # an older output, now the run's input
    ds.assign_attrs(source="gridsolve").to_netcdf(read_cube)
    unread = ko / "x-2020-01-03.nc"
    unread.write_bytes((ko / "x-2020-01-02.nc").read_bytes())
    for i, p in enumerate([read_cube, ko / "x-2020-01-02.nc", unread]):
        t = 1_600_000_000 + 60 * i
        os.utime(p, (t, t))
    before = {p: tree_digest(p) for p in (read_cube, weights)}
    # as if earlier runs of the template had written them (keep_last deletes only those)
    from gridsolve.stages.write.retention import record_output

    for p in (read_cube, ko / "x-2020-01-02.nc", unread):
        record_output(str(ko / "x-{date}.nc"), str(p), "local")
    cfg = config(
        tmp_path,
        "ko/x-2020-01-01.nc",
        {"path": "ko/x-{date}.nc", "keep_last": 1},
        model={**MODEL, "weights": str(weights.relative_to(tmp_path))},
    )
    res = gridsolve("run", str(cfg), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert {p: tree_digest(p) for p in before} == before
    assert (ko / "x-2020-01-02.nc").exists()
    assert not unread.exists()  # keep_last 1 still applies to what the run does not read


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.parametrize(
    ("load", "root", "needle"),
    [
        ("input.zarr", "input.zarr/cache", "lies inside load.path"),
        ("cube.nc", "cube.nc", "resolves to load.path"),
        ("cube.nc", "gridsolve.yaml", "resolves to the config file"),
    ],
    ids=["inside-store", "input-file", "config-file"],
)
def test_a_cache_root_in_what_the_run_reads_is_refused(
    tmp_path: Path, load: str, root: str, needle: str
) -> None:
    """The cache never writes into an input store, nor is an input or the config file."""
    ds = make_ds(n_obs=8, ny=3, nx=4)
    ds.to_zarr(tmp_path / "input.zarr", mode="w")
    ds.to_netcdf(tmp_path / "cube.nc")
    cfg = config(tmp_path, load, {"path": "out.nc"}, cache={"root": root})
    before = tree_digest(tmp_path / load)
    for command in ("validate", "run"):
        res = gridsolve(command, str(cfg), cwd=tmp_path)
        assert_clean_failure(res, f"cache.root {tmp_path / root} {needle}", "set cache.root to")
        assert res.stderr.count("error:") == 1, res.stderr
        assert tree_digest(tmp_path / load) == before, command
    assert not (tmp_path / "out.nc").exists()


def test_a_cache_root_holding_the_input_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(tmp_path / "data" / "cube.nc")
    cfg = config(tmp_path, "data/cube.nc", {"path": "out.nc"}, cache={"root": "data"})
    res = gridsolve("validate", str(cfg))
    assert res.returncode == 0 and "config is valid" in res.stdout, res.stderr


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_an_output_an_input_glob_would_match_is_refused_on_the_first_run(tmp_path: Path) -> None:
    """``cub*.nc`` matches ``cubeout.nc`` once it exists: refused before, naming the pattern."""
    cube = tmp_path / "cube.nc"
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(cube)
    cfg = config(tmp_path, "cub*.nc", {"path": "cubeout.nc"})
    refused_by_run_and_validate(
        cfg,
        cube,
        f"write.path {tmp_path / 'cubeout.nc'} is matched by load.path {tmp_path}/cub*.nc",
    )
    assert not (tmp_path / "cubeout.nc").exists()
    # a side file the pattern matches is refused too; one it cannot match is not
    cfg = config(tmp_path, "cub*.png", {"path": "cubeout.nc"})
    res = gridsolve("validate", str(cfg), cwd=tmp_path)
    assert_clean_failure(res, "the quick-look picture", "is matched by load.path")
    cfg = config(tmp_path, "cub?.nc", {"path": "cubeout.nc"})
    res = gridsolve("validate", str(cfg), cwd=tmp_path)
    assert res.returncode == 0 and "config is valid" in res.stdout, res.stderr


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.usefixtures("prefect_server")
def test_keep_last_never_deletes_an_old_store_holding_the_config_file(tmp_path: Path) -> None:
    ko = tmp_path / "ko"
    ds = make_ds(n_obs=8, ny=3, nx=4)
    ds.to_netcdf(tmp_path / "cube.nc")
    holder, unread = ko / "x-2020-01-01.zarr", ko / "x-2020-01-02.zarr"
    for store in (holder, unread):
        ds.assign_attrs(source="gridsolve").to_zarr(store, mode="w")
    cfg = config(
        holder,
        str(tmp_path / "cube.nc"),
        {"impl": "zarr", "path": str(ko / "x-{date}.zarr"), "keep_last": 1},
        cache={"root": str(tmp_path / "cache")},
    )
    for i, p in enumerate([holder, unread]):
        os.utime(p, (1_600_000_000 + 60 * i,) * 2)
    from gridsolve.stages.write.retention import record_output

    for p in (holder, unread):  # as if earlier runs of the template had written them
        record_output(str(ko / "x-{date}.zarr"), str(p), "local")
    before = cfg.read_bytes()
    res = gridsolve("run", str(cfg), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert cfg.read_bytes() == before
    assert not unread.exists()


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_a_foreign_file_at_the_output_is_refused_before_any_work(tmp_path: Path) -> None:
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(tmp_path / "cube.nc")
    theirs = tmp_path / "theirs.nc"
    make_ds(n_obs=4, ny=2, nx=2, seed=9).to_netcdf(theirs)  # a NetCDF file gridsolve did not write
    cfg = config(tmp_path, "cube.nc", {"path": "theirs.nc"})
    before = tree_digest(theirs)
    for command in ("validate", "run"):
        res = gridsolve(command, str(cfg), cwd=tmp_path)
        assert_clean_failure(res, f"write.path {theirs} exists and is not a gridsolve output")
        assert res.stderr.count("error:") == 1, res.stderr
        assert tree_digest(theirs) == before, command
    assert not (tmp_path / "cache").exists()  # refused before any stage ran


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_a_foreign_file_beside_the_output_is_refused(tmp_path: Path) -> None:
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(tmp_path / "cube.nc")
    mine = tmp_path / "mine.nc.quicklook.png"
    mine.write_bytes(b"\x89PNG not gridsolve's picture")
    cfg = config(tmp_path, "cube.nc", {"path": "mine.nc"})
    before = tree_digest(mine)
    for command in ("validate", "run"):
        res = gridsolve(command, str(cfg), cwd=tmp_path)
        assert_clean_failure(
            res,
            f"the quick-look picture (write.path + .quicklook.png) {mine} exists and gridsolve "
            "did not write it",
            "move that file away",
        )
        assert res.stderr.count("error:") == 1, res.stderr
        assert tree_digest(mine) == before, command
    assert not (tmp_path / "mine.nc").exists() and not (tmp_path / "cache").exists()


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.usefixtures("prefect_server")
def test_gridsolve_s_own_picture_is_replaced_after_the_output_is_deleted(tmp_path: Path) -> None:
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(tmp_path / "cube.nc")
    cfg = config(tmp_path, "cube.nc", {"path": "out.nc"})
    assert gridsolve("run", str(cfg), cwd=tmp_path).returncode == 0
    picture = tmp_path / "out.nc.quicklook.png"
    first = picture.read_bytes()
    (tmp_path / "out.nc").unlink()  # the user deletes the output, keeps the picture, reruns
    res = gridsolve("run", str(cfg), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "out.nc").exists()
    assert picture.read_bytes() != first  # drawn again: stamped with the new file
