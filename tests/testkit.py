"""Test helpers shared by the suites: seeded cubes and a Prefect-free stage chain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr
import yaml

#: The output variables of the default model (multidim_linear, wrt params).
CONTRACT = {
    "design",
    "coefficients",
    "residual_rms",
    "n_valid",
    "status",
    "prediction",
    "model_status",
    "grad_weight",
    "grad_bias",
}


# ---------------------------------------------------------------- cubes
def make_ds(
    n_obs: int = 12,
    ny: int = 6,
    nx: int = 5,
    *,
    seed: int = 0,
    nan_fraction: float = 0.0,
    dtype: str = "float64",
    dims: tuple[str, str, str] = ("time", "y", "x"),
    datetime_obs: bool = True,
) -> xr.Dataset:
    """A seeded cube ``signal (obs, y, x)`` (dims named by ``dims``): smooth part, noise, gaps."""
    rng = np.random.default_rng(seed)
    t = np.linspace(-1, 1, n_obs)
    base = 2.0 + 0.5 * t[:, None, None] + np.cos(3 * t)[:, None, None] * rng.random((1, ny, nx))
    data = (base + 0.1 * rng.standard_normal((n_obs, ny, nx))).astype(dtype)
    if nan_fraction:
        data[rng.random(data.shape) < nan_fraction] = np.nan
    obs = (
        pd.date_range("2021-01-01", periods=n_obs, freq="D")
        if datetime_obs
        else np.arange(n_obs) * 0.5
    )
    return xr.Dataset(
        {"signal": (dims, data, {"units": "K", "long_name": "test signal"})},
        coords={
            dims[0]: (dims[0], obs),
            dims[1]: (dims[1], np.arange(ny) * 10.0, {"units": "m"}),
            dims[2]: (dims[2], np.arange(nx) * 10.0, {"units": "m"}),
        },
    )


# ---------------------------------------------------------------- stages without Prefect
class Chain:
    """Runs stages in order through the generic runner (no Prefect), keeping the refs."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.refs: dict[str, Any] = {}
        self.runs: dict[str, Any] = {}

    def whole(self, kind: str, config: Any) -> Any:
        from gridsolve.stages.engine.registry import decl_for
        from gridsolve.stages.engine.runner import reads, run_stage

        decl = decl_for(config)
        run = run_stage(config, {k: self.refs[k] for k in reads(decl, self.refs)}, self.ctx)
        self.refs[kind] = run.ref
        self.runs[kind] = run
        return self.ctx.store.get(run.ref.key)

    def tiled(self, kind: str, config: Any, tiles: list[Any] | None = None) -> list[Any]:
        from gridsolve.schemas.artifacts import Tile, TiledRef
        from gridsolve.stages.engine.plan import Step, tile_inputs, tiled_ref
        from gridsolve.stages.engine.registry import decl_for
        from gridsolve.stages.engine.runner import prepare_stage, reads, run_tile

        decl = decl_for(config)
        step = Step(kind, config, decl, reads(decl, self.refs))
        prep = prepare_stage(
            config, {k: self.refs[k] for k in reads(step.decl, self.refs)}, self.ctx
        )
        self.refs[kind] = tiled_ref(step, prep.ref)
        load = self.refs["load"].meta
        tiles = tiles or [Tile(index=0, y0=0, y1=load["ny"], x0=0, x1=load["nx"])]
        tile_refs = {
            k: {r.tile.index: r for r in ref.tiles}
            for k, ref in self.refs.items()
            if isinstance(ref, TiledRef) and ref.tiles
        }
        runs = [
            run_tile(config, tile_inputs(step, self.refs, tile_refs, t), prep.ref, t, self.ctx)
            for t in tiles
        ]
        self.refs[kind] = tiled_ref(step, prep.ref, [r.ref for r in runs])
        self.runs[kind] = runs
        return [self.ctx.store.get(r.ref.key) for r in runs]


def run_plan(configs: dict[str, Any], ctx: Any, **kwargs: Any) -> dict[str, Any]:
    """The whole pipeline of ``configs`` (by kind) through the same plan the flow runs."""
    from gridsolve.stages.engine.plan import build_plan, run_locally

    return run_locally(build_plan(configs), ctx, **kwargs)


def tiles_stored(cache: Path, kind: str) -> int:
    """How many tiles of stage ``kind`` the cache folder holds (read while runs write it)."""
    n = 0
    for manifest in (cache / "objects").glob("*/*/manifest.json"):
        try:
            info = json.loads(manifest.read_text())
        except (OSError, ValueError):  # removed or replaced while we looked
            continue
        n += info.get("kind") == kind and info.get("part") == "tile"
    return n


def run_yaml(cfg: Path, raw: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """Write ``raw`` to ``cfg`` and ``gridsolve run`` it in its folder, as a user would."""
    cfg.write_text(yaml.safe_dump(raw))
    return subprocess.run(
        [str(Path(sys.executable).parent / "gridsolve"), "run", str(cfg)],
        cwd=cfg.parent,
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ),
    )


# ---------------------------------------------------------------- nonlinear fits
def season_np(t: np.ndarray, *p: float) -> np.ndarray:
    """Double logistic NDVI season (my_curves.season in numpy): green-up p[3], senescence p[5]."""
    up = 1 / (1 + np.exp(-p[2] * (t - p[3])))
    down = 1 / (1 + np.exp(-p[4] * (t - p[5])))
    out: np.ndarray = p[0] + p[1] * (up - down)
    return out


def season_jac(t: np.ndarray, *p: float) -> np.ndarray:
    """The exact Jacobian of :func:`season_np` (obs, 6)."""
    _, b, c, d, e, g = p
    up = 1 / (1 + np.exp(-c * (t - d)))
    down = 1 / (1 + np.exp(-e * (t - g)))
    dup, ddown = up * (1 - up), down * (1 - down)
    cols = [np.ones_like(t), up - down, b * dup * (t - d), -b * dup * c]
    return np.stack([*cols, -b * ddown * (t - g), b * ddown * e], axis=1)


def ndvi_cube(ny: int = 6, nx: int = 8, seed: int = 0) -> xr.DataArray:
    """(time, lat, lon) NDVI: a year of 8-day composites, 20 % gaps, two flat pixels, one empty."""
    rng = np.random.default_rng(seed)
    time = pd.date_range("2021-01-01", periods=46, freq="8D")
    t = np.arange(46) * 8.0
    lo, hi = np.array([0.1, 0.3, 0.05, 100, 0.04, 250]), np.array([0.3, 0.6, 0.12, 140, 0.1, 300])
    truth = rng.uniform(lo, hi, (ny, nx, 6))
    truth[0, :2, 1] = 0.0  # no season: amplitude and timing are not identifiable
    y = np.stack([[season_np(t, *truth[i, j]) for j in range(nx)] for i in range(ny)])
    y = y + rng.normal(0, 0.03, y.shape)
    y[rng.random(y.shape) < 0.2] = np.nan
    y[1, 1, :] = np.nan  # a pixel with nothing observed
    return xr.DataArray(
        np.moveaxis(y, -1, 0),
        dims=("time", "lat", "lon"),
        coords={"time": time, "lat": np.linspace(50, 45, ny), "lon": np.linspace(5, 12, nx)},
        name="ndvi",
        attrs={"units": "1", "long_name": "NDVI"},
    )


def settled_task_runs(flow_run_id: Any, settle: float = 60.0) -> list[Any]:
    """A flow run's task runs as the server shows them once every state is final.

    Task states reach the server as events that it records a moment later: just after a
    flow returned, a loaded server may still show a task Running (seen in CI).
    """
    import time
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + settle
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(flow_run_id))]))
            )
        if all(r.state is None or r.state.is_final() for r in runs) or time.monotonic() > deadline:
            return list(runs)
        time.sleep(0.5)
