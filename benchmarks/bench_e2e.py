"""What a user times: a linear trend with gaps, file to file, against what they would run instead.

One cube (default 50 × 500 × 500 float32, 20 % of the values missing, a CF time axis),
each way of getting its per-pixel linear trend into a NetCDF file, every one a fresh
process timed from start to exit, the rows alternated over ``--repeats`` rounds (this
machine is shared: a ratio then compares the same moment):

floor      python: read the input with netCDF4, write two float32 (y, x) maps with
           netCDF4, no compute (the I/O any tool must do, plus Python's start)
cdo        ``cdo -P 2 trend in.nc a.nc b.nc`` (Debian's cdo), when installed
xarray     python: open_dataset, polyfit(deg=1, skipna=True), to_netcdf
imports    python -c "import <every top-level module a cold run imports>" (the list read
           once from ``python -X importtime gridsolve run``): the interpreter's start and
           the imports that the run's process pays, Prefect and torch included
run-cold   ``gridsolve run`` with a Prefect server up, an empty cache each round
run-warm   the same config again: every stage but the writer cached
api        python: ``gridsolve.fit`` on the opened DataArray, ``to_netcdf``
api-warm   the same in a warm process (a notebook's next cell): after one fit, 3 timed
           fits per round, each from the file to a new output file

Then the masked case (issue 29): a degree-9 polynomial on the same grid in float64,
xarray's script (open, polyfit(deg=9, skipna=True), to_netcdf) against ``gridsolve run``
(less its imports) and the warm API.

Each row prints its median and its range over the rounds. The verdict lines (for
benchmarks/run.py) are issue 29's targets: the trend's cold run at most 1.5 s beyond its
imports, the warm API within 2× cdo; the masked case 10× xarray's script both ways.

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
n, side, path, dtype = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
rng = np.random.default_rng(0)
t = pd.date_range("1990-01-01", periods=n, freq="YS")
k = np.arange(n, dtype="f4")[:, None, None]
data = (10 + 0.02 * k + rng.normal(0, 0.5, (n, side, side))).astype(dtype)
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

#: The API in a warm process (a notebook's second cell): one fit to warm it up, then each
#: repeat opens the file, fits, writes a new output; prints one line of seconds.
API_WARM = """
import sys, time, statistics, xarray as xr, gridsolve
cube, out, degree, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def once(i):
    t0 = time.perf_counter()
    with xr.open_dataset(cube) as ds:
        fit = gridsolve.fit(ds["v"], design={"impl": "polynomial", "degree": degree},
                            progress=False)
    fit.to_netcdf(f"{out}{i}.nc")
    return time.perf_counter() - t0
once(0)
print(" ".join(f"{once(i + 1):.4f}" for i in range(repeats)))
"""

XARRAY_DEG = """
import sys, xarray as xr
with xr.open_dataset(sys.argv[1]) as ds:
    fit = ds["v"].polyfit("time", deg=int(sys.argv[3]), skipna=True)
fit.to_netcdf(sys.argv[2])
"""


#: The top-level modules a process imported, from ``python -X importtime``'s report.
def imported_modules(stderr: str) -> list[str]:
    """Top-level modules in a ``-X importtime`` report, in the order they were imported."""
    names = []
    for line in stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        name = line.rsplit("|", 1)[-1]
        if (
            name.startswith(" ")
            and not name.startswith("  ")
            and name.strip() != "imported package"
        ):
            names.append(name.strip())
    return [n for n in dict.fromkeys(names) if not n.startswith("_")]


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


def config(root: Path, cube: Path, cache: Path, out: Path, degree: int = 1) -> Path:
    path = root / f"{out.stem}.yaml"
    path.write_text(
        f"load: {{path: {cube}, variable: v}}\n"
        f"design: {{impl: polynomial, degree: {degree}}}\n"
        f"write: {{path: {out}}}\n"
        f"cache: {{root: {cache}}}\n"
    )
    return path


def run_imports(cube: Path, root: Path, degree: int = 1) -> list[str]:
    """The python command importing what a cold ``gridsolve run`` of ``cfg`` imports.

    One run under ``-X importtime`` (outside the timed rounds) names the top-level
    modules; the row then imports exactly those in a fresh process: the interpreter's
    start and the imports that run pays, as the issue counts them.
    """
    shutil.rmtree(root / "imports-cache", ignore_errors=True)
    probe = config(root, cube, root / "imports-cache", root / "imports-out.nc", degree)
    text = subprocess.run(
        [sys.executable, "-X", "importtime", GRIDSOLVE, "run", str(probe)],
        capture_output=True,
        text=True,
        check=True,
        env=ENV,
    ).stderr
    shutil.rmtree(root / "imports-cache", ignore_errors=True)
    modules = ", ".join(imported_modules(text))
    return [sys.executable, "-c", f"import {modules}"]


def warm_api(cube: Path, out: Path, degree: int, repeats: int) -> list[float]:
    """Seconds of each repeat of file → ``gridsolve.fit`` → file in one warm process."""
    res = subprocess.run(
        [sys.executable, "-c", API_WARM, str(cube), str(out), str(degree), str(repeats)],
        capture_output=True,
        text=True,
        env=ENV,
    )
    if res.returncode != 0:
        raise RuntimeError(f"the warm API run failed: {res.stderr[-2000:]}")
    return [float(x) for x in res.stdout.split()]


def make_cube(obs: int, side: int, path: Path, dtype: str = "f4") -> Path:
    """The cube (written once per work folder)."""
    if not path.exists():
        subprocess.run(
            [sys.executable, "-c", MAKE_CUBE, str(obs), str(side), str(path), dtype], check=True
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
    imports = run_imports(cube, root)
    times: dict[str, list[float]] = {}
    for r in range(repeats):
        rows = {
            "floor": [sys.executable, "-c", FLOOR, str(cube), str(root / f"floor{r}.nc")],
            "xarray": [sys.executable, "-c", XARRAY, str(cube), str(root / f"xr{r}.nc")],
            "api": [sys.executable, "-c", API, str(cube), str(root / f"api{r}.nc")],
            "imports": imports,
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
        times.setdefault("api-warm", []).extend(warm_api(cube, root / f"apiw{r}-", 1, 3))
        shutil.rmtree(cache, ignore_errors=True)
    if not cdo:
        print("  cdo: not run (cdo not installed)")
    names = [
        n
        for n in ("floor", "cdo", "xarray", "imports", "run-cold", "run-warm", "api", "api-warm")
        if n in times
    ]
    print_rows(times, names, "floor")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(
        "  imports: a fresh process importing what a cold run imports (python -X importtime);"
        " api-warm: gridsolve.fit after one fit in the same process (3 per round)"
    )
    if "cdo" in med:
        print("  × cdo: " + ", ".join(f"{n} {med[n] / med['cdo']:.1f}" for n in names))
    verdicts: list[tuple[Any, ...]] = [
        (
            "trend: gridsolve run, cold cache, beyond its imports",
            med["run-cold"] - med["imports"],
            1.5,
            "≤",
            " s",
        ),
    ]
    if "cdo" in med:
        verdicts.append(
            ("trend: gridsolve.fit, warm process / cdo", med["api-warm"] / med["cdo"], 2.0, "≤")
        )
    return verdicts


def masked_rows(root: Path, obs: int, size: int, repeats: int) -> list[tuple[Any, ...]]:
    """The masked degree-9 case (float64, 20 % gaps) end to end: xarray's script vs ours."""
    degree = 9
    cube = make_cube(obs, size, root / "cube64.nc", "f8")
    mb = cube.stat().st_size / 2**20
    print(
        f"\n## polynomial degree {degree} with 20 % gaps, {obs} × {size} × {size} float64 "
        f"({mb:.0f} MiB), file to file, {repeats} rounds"
    )
    imports = run_imports(cube, root, degree)
    times: dict[str, list[float]] = {}
    for r in range(repeats):
        cache = root / f"cache9-{r}"
        cold = config(root, cube, cache, root / f"cold9-{r}.nc", degree)
        rows = {
            "xarray": [
                sys.executable,
                "-c",
                XARRAY_DEG,
                str(cube),
                str(root / f"xr9-{r}.nc"),
                str(degree),
            ],
            "imports": imports,
            "run-cold": [GRIDSOLVE, "run", str(cold)],
        }
        for name, cmd in rows.items():
            times.setdefault(name, []).append(wall(cmd, root / f"{name}9-{r}.log"))
        times.setdefault("api-warm", []).extend(warm_api(cube, root / f"apiw9-{r}-", degree, 3))
        shutil.rmtree(cache, ignore_errors=True)
    names = ["xarray", "imports", "run-cold", "api-warm"]
    print_rows(times, names, "xarray")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    beyond = med["run-cold"] - med["imports"]
    print(f"  run-cold beyond its imports: {beyond:.2f} s")
    return [
        (
            "masked deg 9: xarray script / gridsolve run less imports",
            med["xarray"] / beyond,
            10.0,
            "≥",
        ),
        (
            "masked deg 9: xarray script / gridsolve.fit, warm process",
            med["xarray"] / med["api-warm"],
            10.0,
            "≥",
        ),
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
            verdicts += masked_rows(root, args.obs, args.size, args.repeats)
        verdicts += small_rows(root, args.repeats)
    finally:
        if server is not None:
            server.stop()
    print_verdicts(verdicts)
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
