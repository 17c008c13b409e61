"""What a user times: a linear trend with gaps, file to file, against what they would run instead.

One cube (default 50 × 500 × 500 float32, 20 % of the values missing, a CF time axis),
each way of getting its per-pixel linear trend into a NetCDF file, every one a fresh
process timed from start to exit, the rows alternated over ``--repeats`` rounds (this
machine is shared: a ratio then compares the same moment):

floor      python: read the input with netCDF4, write two float32 (y, x) maps with
           netCDF4, no compute (the I/O any tool must do, plus Python's start)
cdo        ``cdo -P 2 trend in.nc a.nc b.nc`` (Debian's cdo), when installed
xarray     python: open_dataset, polyfit(deg=1, skipna=True), to_netcdf
run-cold   ``gridsolve run`` with a Prefect server up, an empty cache each round
run-warm   the same config again: every stage but the writer cached
api        python: ``gridsolve.fit`` on the opened DataArray, ``to_netcdf``

Each row prints its median and its range over the rounds, and its ratio to the floor and
to cdo. The verdict lines (for benchmarks/run.py) hold the issue's aim — end to end near
the I/O floor — as targets; a NOT met says how far a run is from it.

Then the small runs (issue 28): the same trend on a 50 × 24 × 24 cube, alternated over
the rounds beside the imports every run pays:

imports      python -c "import gridsolve.flows.pipeline" (interpreter start and the imports
             of a run's process, Prefect's included)
small-cold   ``gridsolve run``, server up, an empty cache and no output
small-cached the same config again: every stage a hit, the quick look reused

Every process runs with Python's default of caching bytecode (this project's machines set
PYTHONDONTWRITEBYTECODE, which users do not: it would recompile every module per run).

Usage: python benchmarks/bench_e2e.py [--size 500] [--obs 50] [--repeats 3] [--workdir D]
       [--small-only]
A Prefect server is started for the run unless PREFECT_API_URL is set.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gridsolve.flows.localserver import LocalServer

from common import machine, print_verdicts

GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")

MAKE_CUBE = """
import sys
import numpy as np, pandas as pd, xarray as xr
n, side, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(0)
t = pd.date_range("1990-01-01", periods=n, freq="YS")
k = np.arange(n, dtype="f4")[:, None, None]
data = (10 + 0.02 * k + rng.normal(0, 0.5, (n, side, side))).astype("f4")
data[rng.random(data.shape) < 0.2] = np.nan
xr.Dataset(
    {"v": (("time", "lat", "lon"), data, {"units": "K"})},
    coords={"time": t,
            "lat": ("lat", np.linspace(-60, 60, side), {"units": "degrees_north"}),
            "lon": ("lon", np.linspace(0, 359, side), {"units": "degrees_east"})},
).to_netcdf(path)
"""

FLOOR = """
import sys, numpy as np, netCDF4
with netCDF4.Dataset(sys.argv[1]) as src:
    v = src["v"][:]
    ny, nx = v.shape[1:]
with netCDF4.Dataset(sys.argv[2], "w") as dst:
    dst.createDimension("lat", ny); dst.createDimension("lon", nx)
    for name in ("intercept", "trend"):
        dst.createVariable(name, "f4", ("lat", "lon"))[:] = np.zeros((ny, nx), "f4")
"""

XARRAY = """
import sys, xarray as xr
with xr.open_dataset(sys.argv[1]) as ds:
    fit = ds["v"].polyfit("time", deg=1, skipna=True)
fit.to_netcdf(sys.argv[2])
"""

API = """
import sys, xarray as xr, gridsolve
with xr.open_dataset(sys.argv[1]) as ds:
    out = gridsolve.fit(ds["v"], design={"impl": "polynomial", "degree": 1}, progress=False)
out.to_netcdf(sys.argv[2])
"""


#: Small runs: observations and grid side (issue 28: ≤ 6 s cold, ≤ 3 s fully cached).
SMALL_OBS, SMALL_SIDE = 50, 24
#: What users' Python does: cache bytecode (see the module docstring).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def wall(cmd: list[str], log: Path) -> float:
    """Seconds from start to exit of ``cmd``; RuntimeError (with its log) if it fails."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, check=False, env=ENV
        ).returncode
    seconds = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {code}); see {log}")
    return seconds


def config(root: Path, cube: Path, cache: Path, out: Path) -> Path:
    path = root / f"{out.stem}.yaml"
    path.write_text(
        f"load: {{path: {cube}, variable: v}}\n"
        "design: {impl: polynomial, degree: 1}\n"
        f"write: {{path: {out}}}\n"
        f"cache: {{root: {cache}}}\n"
    )
    return path


def make_cube(obs: int, side: int, path: Path) -> Path:
    """The cube (written once per work folder)."""
    if not path.exists():
        subprocess.run(
            [sys.executable, "-c", MAKE_CUBE, str(obs), str(side), str(path)], check=True
        )
    return path


def print_rows(times: dict[str, list[float]], names: Sequence[str], ref: str | None) -> None:
    """Median and range of each row, and its ratio to row ``ref``."""
    med = {name: statistics.median(ts) for name, ts in times.items()}
    head = f"× {ref}" if ref else ""
    print(f"  {'':<13}{'median s':>10}  {'range s':<15}{head:>9}")
    for name in names:
        ts = times[name]
        ratio = f"{med[name] / med[ref]:9.1f}" if ref else ""
        print(f"  {name:<13}{med[name]:10.2f}  {min(ts):.2f}–{max(ts):<10.2f}{ratio}")


def trend_rows(root: Path, obs: int, size: int, repeats: int) -> list[tuple[Any, ...]]:
    """The big cube's rows, alternated over ``repeats`` rounds; their verdicts."""
    cube = make_cube(obs, size, root / "cube.nc")
    mb = cube.stat().st_size / 2**20
    print(
        f"\n## a linear trend with 20 % gaps, {obs} × {size} × {size} float32 "
        f"({mb:.0f} MiB), file to file, {repeats} rounds"
    )
    cdo = shutil.which("cdo")
    times: dict[str, list[float]] = {}
    for r in range(repeats):
        rows = {
            "floor": [sys.executable, "-c", FLOOR, str(cube), str(root / f"floor{r}.nc")],
            "xarray": [sys.executable, "-c", XARRAY, str(cube), str(root / f"xr{r}.nc")],
            "api": [sys.executable, "-c", API, str(cube), str(root / f"api{r}.nc")],
        }
        if cdo:
            a, b = str(root / f"a{r}.nc"), str(root / f"b{r}.nc")
            rows["cdo"] = [cdo, "-s", "-P", "2", "trend", str(cube), a, b]
        cache = root / f"cache{r}"
        cold = config(root, cube, cache, root / f"cold{r}.nc")
        warm = config(root, cube, cache, root / f"warm{r}.nc")
        rows["run-cold"] = [GRIDSOLVE, "run", str(cold)]
        rows["run-warm"] = [GRIDSOLVE, "run", str(warm)]  # after run-cold: its cache
        for name, cmd in rows.items():
            times.setdefault(name, []).append(wall(cmd, root / f"{name}{r}.log"))
        shutil.rmtree(cache, ignore_errors=True)
    if not cdo:
        print("  cdo: not run (cdo not installed)")
    names = [n for n in ("floor", "cdo", "xarray", "run-cold", "run-warm", "api") if n in times]
    print_rows(times, names, "floor")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    if "cdo" in med:
        print("  × cdo: " + ", ".join(f"{n} {med[n] / med['cdo']:.1f}" for n in names))
    return [
        ("gridsolve run, cold cache / the I/O floor", med["run-cold"] / med["floor"], 3.0, "≤"),
        ("gridsolve.fit / the I/O floor", med["api"] / med["floor"], 2.0, "≤"),
        ("gridsolve run, cold cache / xarray polyfit", med["run-cold"] / med["xarray"], 0.5, "≤"),
    ]


def small_rows(root: Path, repeats: int) -> list[tuple[Any, ...]]:
    """A small cube through the CLI, cold and fully cached, beside the imports; verdicts."""
    cube = make_cube(SMALL_OBS, SMALL_SIDE, root / "small-cube.nc")
    print(
        f"\n## small runs: the same trend on {SMALL_OBS} × {SMALL_SIDE} × {SMALL_SIDE}, "
        f"server up, {repeats} rounds"
    )
    cache, out = root / "small-cache", root / "small-out.nc"
    cfg = config(root, cube, cache, out)
    times: dict[str, list[float]] = {}
    for r in range(repeats):
        shutil.rmtree(cache, ignore_errors=True)
        for f in root.glob("small-out.nc*"):
            f.unlink()
        rows = {
            "imports": [sys.executable, "-c", "import gridsolve.flows.pipeline"],
            "small-cold": [GRIDSOLVE, "run", str(cfg)],
            "small-cached": [GRIDSOLVE, "run", str(cfg)],  # after small-cold: every stage hits
        }
        for name, cmd in rows.items():
            times.setdefault(name, []).append(wall(cmd, root / f"{name}{r}.log"))
    print_rows(times, ["imports", "small-cold", "small-cached"], "imports")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return [
        ("gridsolve run 50×24×24, cold cache, wall", med["small-cold"], 6.0, "≤", " s"),
        ("gridsolve run 50×24×24, fully cached rerun, wall", med["small-cached"], 3.0, "≤", " s"),
    ]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", type=int, default=500, help="grid side (default 500)")
    p.add_argument("--obs", type=int, default=50, help="observations per pixel")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=None)
    p.add_argument("--small-only", action="store_true", help="only the small runs")
    args = p.parse_args()
    print(machine())
    root = Path(args.workdir or tempfile.mkdtemp(prefix="gridsolve-e2e-"))
    root.mkdir(parents=True, exist_ok=True)
    server = None
    if not os.environ.get("PREFECT_API_URL"):
        server = LocalServer(root / "prefect-home").start()
        os.environ["PREFECT_API_URL"] = ENV["PREFECT_API_URL"] = server.api
    verdicts: list[tuple[Any, ...]] = []
    try:
        if not args.small_only:
            verdicts += trend_rows(root, args.obs, args.size, args.repeats)
        verdicts += small_rows(root, args.repeats)
    finally:
        if server is not None:
            server.stop()
    print_verdicts(verdicts)
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
