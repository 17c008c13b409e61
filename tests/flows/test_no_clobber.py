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


def test_output_inside_the_cache_or_holding_an_input_is_refused(tmp_path: Path) -> None:
    cube = tmp_path / "data" / "cube.nc"
    cube.parent.mkdir()
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(cube)
    cfg = config(tmp_path, "data/cube.nc", {"path": "cache/out.nc"})
    refused_by_run_and_validate(cfg, cube, "lies inside cache.root")
    # a Zarr output replaces its folder as a whole: one that holds the input is refused
    cfg = config(tmp_path, "data/cube.nc", {"impl": "zarr", "path": "data"})
    refused_by_run_and_validate(cfg, cube, f"write.path {cube.parent} contains load.path {cube}")


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
    from gridsolve.stages.engine.paths import refuse_destructive_outputs

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
