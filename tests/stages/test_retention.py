"""write.keep_last: the newest N outputs of a templated path stay; older ones go, files too."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr

from gridsolve.schemas.kinds.write import NetCDFWrite
from gridsolve.schemas.pipeline import build_config
from gridsolve.stages.engine.provenance import is_gridsolve_output
from gridsolve.stages.write.retention import (
    SIBLINGS,
    apply_keep_last,
    keep_last,
    ledger_path,
    record_output,
)

from testkit import make_ds, run_plan

UUIDS = [f"{i:08x}-0000-4000-8000-{i:012x}" for i in range(1, 7)]


def real_output(tmp_path: Path, ctx: Any, write: dict[str, Any]) -> Path:
    """One output the pipeline wrote (seeded cube), checked against numpy's lstsq."""
    cube = tmp_path / "cube.nc"
    make_ds(n_obs=10, ny=4, nx=3, seed=3).to_netcdf(cube)
    cfg = build_config(
        {
            "load": {"path": str(cube)},
            "design": {"impl": "polynomial", "degree": 2},
            "model": {"impl": "multidim_linear", "input_dim": 3, "hidden_dim": 1},
            "write": write,
        }
    )
    refs = run_plan(cfg.stage_configs(), ctx)
    out = Path(refs["write"].meta["path"])
    engine = "zarr" if out.suffix == ".zarr" else None
    with xr.open_dataset(out, engine=engine) as ds, xr.open_dataset(cube) as src:
        A, coef, data = ds["design"].values, ds["coefficients"].values, src["signal"].values
    expected = np.linalg.lstsq(A, data.reshape(len(A), -1), rcond=None)[0]
    np.testing.assert_allclose(coef.reshape(len(coef), -1), expected, rtol=1e-4, atol=1e-5)
    return out


def copies(src: Path, names: list[str], start: float) -> list[Path]:
    """Copies of ``src`` named ``names``, a minute apart from ``start``, with their siblings."""
    made = []
    for i, name in enumerate(names):
        dst = src.with_name(name)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy(src, dst)
        for suffix in SIBLINGS:
            Path(f"{dst}{suffix}").write_bytes(b"picture or weights of " + name.encode())
        t = start + 60 * i
        os.utime(dst, (t, t))
        made.append(dst)
    return made


def siblings_of(path: Path) -> list[Path]:
    return [Path(f"{path}{s}") for s in SIBLINGS]


def test_keep_last_deletes_the_oldest_outputs_and_their_files(tmp_path: Path, ctx: Any) -> None:
    outs = tmp_path / "outs"
    first = real_output(tmp_path, ctx, {"path": str(outs / f"out-{UUIDS[0]}.nc")})
    assert is_gridsolve_output(first)
    old = time.time() - 3600
    made = [first, *copies(first, [f"out-{u}.nc" for u in UUIDS[1:5]], old + 60)]
    os.utime(first, (old, old))
    for p in siblings_of(first):
        p.write_bytes(b"first run's picture")
    # a file of the same pattern that gridsolve did not write, and one the placeholder
    # could not have rendered to: never touched
    foreign = outs / f"out-{UUIDS[5]}.nc"
    xr.Dataset({"v": ("x", np.arange(3.0))}).to_netcdf(foreign)
    os.utime(foreign, (old - 60, old - 60))
    not_a_uuid = outs / "out-notes.nc"
    shutil.copy(first, not_a_uuid)
    os.utime(not_a_uuid, (old - 60, old - 60))

    written = made[-1]  # this run's output, the newest
    for p in made:  # what the runs that wrote them recorded
        record_output(str(outs / "out-{flow_run_id}.nc"), str(p), "local")
    removed = keep_last(
        str(outs / "out-{flow_run_id}.nc"), str(written), 3, started_ns=time.time_ns()
    )
    assert sorted(removed) == sorted(made[:2])  # the two oldest
    for gone in made[:2]:
        assert not gone.exists() and not any(p.exists() for p in siblings_of(gone))
    for kept in made[2:]:
        assert kept.exists() and all(p.exists() for p in siblings_of(kept))
    assert foreign.exists() and not_a_uuid.exists()
    # a second pass finds nothing more to do
    assert keep_last(str(outs / "out-{flow_run_id}.nc"), str(written), 3, time.time_ns()) == []


def test_the_one_just_written_and_a_concurrent_runs_output_are_never_deleted(
    tmp_path: Path, ctx: Any
) -> None:
    outs = tmp_path / "outs"
    src = real_output(tmp_path, ctx, {"path": str(outs / "src" / "o.nc")})
    old = time.time() - 3600
    a, b, c, d = copies(src, ["run-a.nc", "run-b.nc", "run-c.nc", "run-d.nc"], old)
    # this run wrote `a` (its mtime the oldest: say, restored from a backup); `d` was
    # written by a concurrent run after this one started
    started = time.time_ns()
    later = time.time() + 5
    os.utime(d, (later, later))
    template = str(src.parent / "run-{flow_run_name}.nc")
    for p in (a, b, c, d):
        record_output(template, str(p), "local")
    removed = keep_last(template, str(a), 1, started_ns=started)
    assert sorted(removed) == sorted([b, c])
    assert a.exists() and d.exists() and not b.exists() and not c.exists()


def test_zarr_stores_are_kept_last_as_folders(tmp_path: Path, ctx: Any) -> None:
    outs = tmp_path / "outs"
    store = real_output(tmp_path, ctx, {"impl": "zarr", "path": str(outs / "s-x.zarr")})
    assert store.is_dir() and is_gridsolve_output(store)
    old = time.time() - 3600
    made = copies(store, ["s-2024-01-01.zarr", "s-2024-01-02.zarr", "s-2024-01-03.zarr"], old)
    shutil.rmtree(store)
    folder_not_ours = outs / "s-2024-01-04.zarr"
    folder_not_ours.mkdir()
    (folder_not_ours / "notes.txt").write_text("mine")
    os.utime(folder_not_ours, (old - 600, old - 600))
    for p in made:
        record_output(str(outs / "s-{scheduled_date}.zarr"), str(p), "local")
    removed = keep_last(str(outs / "s-{scheduled_date}.zarr"), str(made[-1]), 2, time.time_ns())
    assert removed == [made[0]]
    assert not made[0].exists() and not any(p.exists() for p in siblings_of(made[0]))
    assert made[1].is_dir() and made[2].is_dir() and folder_not_ours.is_dir()


def test_urls_and_plain_paths_are_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger("gridsolve.test")
    plain = tmp_path / "out.nc"
    plain.write_bytes(b"x")
    cfg = NetCDFWrite(path=str(plain), keep_last=1)
    assert apply_keep_last(cfg, str(plain), time.time_ns(), logger) == []
    url = NetCDFWrite(path="s3://bucket/out-{date}.nc", keep_last=1)
    with caplog.at_level(logging.INFO, logger="gridsolve.test"):
        assert apply_keep_last(url, "s3://bucket/out-2024-01-01.nc", time.time_ns(), logger) == []
    assert "not applied to s3://bucket/out-{date}.nc: local paths only" in caplog.text
    unset = NetCDFWrite(path=str(tmp_path / "o-{date}.nc"))
    assert apply_keep_last(unset, str(tmp_path / "o-2024-01-01.nc"), time.time_ns(), logger) == []
    assert plain.exists()


@pytest.mark.parametrize(("zarr_format", "consolidated"), [(2, True), (2, False), (3, False)])
def test_a_store_is_ours_by_its_provenance_whatever_its_format(
    tmp_path: Path, zarr_format: int, consolidated: bool
) -> None:
    ds = make_ds(n_obs=4, ny=2, nx=3)
    theirs, ours = tmp_path / "theirs.zarr", tmp_path / "ours.zarr"
    ds.to_zarr(theirs, zarr_format=zarr_format, consolidated=consolidated)
    ds.assign_attrs(gridsolve_config="{}").to_zarr(
        ours, zarr_format=zarr_format, consolidated=consolidated
    )
    assert not is_gridsolve_output(theirs)
    assert is_gridsolve_output(ours)


def test_an_output_the_run_reads_is_kept_said_and_not_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gridsolve.stages.engine.overlap import Place

    old = time.time() - 3600
    names = ["o-2024-01-01.nc", "o-2024-01-02.nc", "o-2024-01-03.nc", "o-2024-01-04.nc"]
    made = []
    for i, name in enumerate(names):
        made.append(tmp_path / name)
        make_ds(n_obs=4, ny=2, nx=3).assign_attrs(source="gridsolve").to_netcdf(made[-1])
        os.utime(made[-1], (old + 60 * i, old + 60 * i))
    weights = Path(f"{made[1]}.weights.safetensors")
    weights.write_bytes(b"weights")
    reads = [Place("load.path", str(made[0])), Place("model.weights", str(weights))]
    logger = logging.getLogger("gridsolve.test")
    cfg = NetCDFWrite(path=str(tmp_path / "o-{date}.nc"), keep_last=2)
    for p in made[:3]:
        record_output(cfg.path, str(p), "local")
    with caplog.at_level(logging.INFO, logger="gridsolve.test"):
        removed = apply_keep_last(cfg, str(made[3]), time.time_ns(), logger, reads)
    assert removed == []  # made[2] is the one older output kept; the two read are not counted
    assert all(p.exists() for p in made) and weights.exists()
    assert f"kept the old output {made[0]} because the run reads it (load.path" in caplog.text
    assert f"{made[1]} because the run reads it (model.weights {weights})" in caplog.text
    assert apply_keep_last(
        cfg.model_copy(update={"keep_last": 1}), str(made[3]), time.time_ns(), logger, reads
    ) == [made[2]]


def test_only_outputs_the_same_deployment_recorded_for_the_template_are_deleted(
    tmp_path: Path,
) -> None:
    # A custom run of on-demand given the nightly's naming pattern and keep_last deletes
    # none of the nightly's outputs, nor outputs no run recorded (older ones, copies).
    old = time.time() - 3600
    template = str(tmp_path / "out" / "g-{scheduled_date}.nc")
    (tmp_path / "out").mkdir()
    made = []
    for i in range(5):
        made.append(tmp_path / "out" / f"g-2024-01-0{i + 1}.nc")
        make_ds(n_obs=4, ny=2, nx=3).assign_attrs(source="gridsolve").to_netcdf(made[-1])
        os.utime(made[-1], (old + 60 * i, old + 60 * i))
    for p in made[:3]:
        record_output(template, str(p), "nightly")  # made[3] was never recorded
    record_output(template, str(made[4]), "on-demand")
    logger = logging.getLogger("gridsolve.test")
    cfg = NetCDFWrite(path=template, keep_last=1)
    assert apply_keep_last(cfg, str(made[4]), time.time_ns(), logger, owner="on-demand") == []
    assert all(p.exists() for p in made)
    # the nightly's own run with keep_last 1 removes its two older ones, and nothing else
    removed = apply_keep_last(cfg, str(made[2]), time.time_ns(), logger, owner="nightly")
    assert sorted(removed) == made[:2]
    assert made[2].exists() and made[3].exists() and made[4].exists()
    # the ledger forgot what was removed; different owners keep different ledgers
    ledger = ledger_path(template, "nightly")
    assert ledger.name.startswith(".gridsolve-keep-") and ledger.parent == tmp_path / "out"
    assert ledger.read_text().split() == [str(made[2].resolve())]
    assert ledger_path(template, "on-demand") != ledger
