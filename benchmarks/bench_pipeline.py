"""End-to-end pipeline benchmarks, each measured side by side in one run.

memory   peak RSS (measured from outside: os.wait4 on the `gridsolve run` child)
         of the full pipeline with per-sample gradients on the seed cube
         (50 × 500 × 500) and on a cube 16× larger (50 × 2000 × 2000), at the same
         memory budget. Targets: larger ≤ 1.3× the smaller's peak RSS; wall time no
         worse than linear in pixels.
floor    the pipeline on the seed cube (stages only, Prefect server already
         running) vs reading the input NetCDF once and writing the same output
         variables with the same encoding, no compute. Target: ≤ 1.2× that floor.
dask     Dask LocalCluster (2 workers) vs threads, on the masked case (20% NaN,
         10 coefficients), both from a cold cache. Reported as measured.
overhead what a run costs beyond its work, on the seed cube with every stage cached:
         `gridsolve run` (server up) vs `python -c 'import prefect, torch, xarray'`,
         side by side (target ≤ 1 s beyond the imports), and trigger → Completed
         of the same cached run as the on-demand deployment through `gridsolve
         worker` (target ≤ 4 s): created with the API, timed until the server
         reports the run Completed.

Usage: python benchmarks/bench_pipeline.py [--case memory|floor|dask|overhead|all] [--large N]
A Prefect server is started for the run unless PREFECT_API_URL is set.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import xarray as xr
import yaml

from gridsolve.flows.localserver import LocalServer
from gridsolve.schemas.pipeline import DEMO_DEFAULTS

from common import machine

GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")
STAGE_ROW = re.compile(
    r"^(load|design|normal_equations|solve|model|write)\s+\S+\s+\S+\s+(\S+)\s+([\d.]+)"
)


def write_cube(path: Path, n: int, nan_fraction: float = 0.0) -> Path:
    """The demo cube (50 × n × n), made in a child process.

    Not in this one: a `gridsolve run` child starts as a copy of this process, and
    its peak RSS (os.wait4) would count a 2000 × 2000 cube held here (3.6 GB
    instead of 1.2 GB in an earlier version of this benchmark).
    """
    if not path.exists():
        code = (
            "import sys; from pathlib import Path\n"
            "from gridsolve.stages.load.demo import make_cube, write_atomic\n"
            "n, frac = int(sys.argv[2]), float(sys.argv[3])\n"
            "write_atomic(make_cube(50, n, n, seed=0, nan_fraction=frac), Path(sys.argv[1]))\n"
        )
        subprocess.run(
            [sys.executable, "-c", code, str(path), str(n), str(nan_fraction)], check=True
        )
    return path


def config(folder: Path, cube: Path, budget: str, **over: Any) -> Path:
    raw: dict[str, Any] = {
        "load": {"path": str(cube), "variable": "signal"},
        "design": DEMO_DEFAULTS["design"],
        "model": DEMO_DEFAULTS["model"],
        "write": {"path": str(folder / "out.nc")},
        "cache": {"root": str(folder / "cache")},
        "execution": {"memory_budget": budget},
    }
    for k, v in over.items():
        same_impl = v.get("impl", raw.get(k, {}).get("impl")) == raw.get(k, {}).get("impl")
        raw[k] = {**raw.get(k, {}), **v} if same_impl else v
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "gridsolve.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_child(cfg: Path) -> dict[str, Any]:
    """Run `gridsolve run cfg` as a child; its wall time, peak RSS and stage seconds."""
    t0 = time.perf_counter()
    with open(cfg.parent / "run.log", "w") as log:
        proc = subprocess.Popen(
            [GRIDSOLVE, "run", str(cfg)], stdout=subprocess.PIPE, stderr=log, text=True
        )
        out = proc.stdout.read() if proc.stdout else ""
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"gridsolve run failed; see {cfg.parent / 'run.log'}")
    stages = {
        m.group(1): (m.group(2), float(m.group(3)))
        for m in map(STAGE_ROW.match, out.splitlines())
        if m
    }
    return {
        "wall": wall,
        "rss_mb": usage.ru_maxrss / 1024,
        "stages": stages,
        "stage_seconds": sum(s for _, s in stages.values()),
        "tiles": int(m.group(1)) if (m := re.search(r"^tiles: (\d+)", out, re.M)) else 0,
    }


def case_memory(root: Path, large: int, budget: str) -> None:
    rows = []
    for n in (500, large):
        cube = write_cube(root / f"cube-{n}.nc", n)
        res = run_child(config(root / f"mem-{n}", cube, budget))
        rows.append((n, res))
        shutil.rmtree(root / f"mem-{n}" / "cache", ignore_errors=True)
        (root / f"mem-{n}" / "out.nc").unlink(missing_ok=True)
    (n0, a), (n1, b) = rows
    px = (n1 / n0) ** 2
    print(f"\n## memory: full pipeline with per-sample gradients, memory_budget {budget}")
    print(
        f"{'grid':<14}{'pixels':>12}{'tiles':>7}{'peak RSS MB':>14}{'wall s':>10}{'stages s':>10}"
    )
    for n, r in rows:
        print(
            f"{n}×{n:<10}{n * n:>12,}{r['tiles']:>7}{r['rss_mb']:>14.0f}"
            f"{r['wall']:>10.1f}{r['stage_seconds']:>10.1f}"
        )
    print(
        f"stage time ratio {b['stage_seconds'] / a['stage_seconds']:.1f} for {px:.0f}× the "
        f"pixels ({'≤ linear' if b['stage_seconds'] <= px * a['stage_seconds'] else 'worse'})"
    )
    ratio = b["rss_mb"] / a["rss_mb"]
    print(
        f"peak RSS {n1}² / {n0}² = {ratio:.2f}× "
        f"(target ≤ 1.3×: {'met' if ratio <= 1.3 else 'NOT met'})"
    )


def floor_seconds(cube: Path, output: Path, scratch: Path) -> float:
    """Read the input once, write the same output variables with the same encoding."""
    with xr.open_dataset(output) as ds:
        mem = ds.load()
    encoding = {}
    with xr.open_dataset(output) as ds:
        for name, var in ds.variables.items():
            enc = {
                k: var.encoding[k]
                for k in ("zlib", "complevel", "shuffle", "chunksizes")
                if k in var.encoding
            }
            encoding[name] = enc
    t0 = time.perf_counter()
    with xr.open_dataset(cube) as ds:
        ds.load()
    mem.to_netcdf(scratch, engine="netcdf4", encoding=encoding)
    seconds = time.perf_counter() - t0
    scratch.unlink()
    return seconds


def case_floor(root: Path, budget: str) -> None:
    cube = write_cube(root / "cube-500.nc", 500)
    folder = root / "floor"
    res = run_child(config(folder, cube, budget))
    floor = floor_seconds(cube, folder / "out.nc", folder / "floor.nc")
    print(
        "\n## floor: seed cube, pipeline (stages only) vs read input + write outputs, same encoding"
    )
    for stage, (cache, sec) in res["stages"].items():
        print(f"  {stage:<18}{cache:<8}{sec:>8.2f} s")
    ratio = res["stage_seconds"] / floor
    print(
        f"pipeline stages {res['stage_seconds']:.2f} s (process wall {res['wall']:.1f} s, "
        f"incl. imports and Prefect), floor {floor:.2f} s"
    )
    print(
        f"end to end / floor = {ratio:.2f}× (target ≤ 1.2×: {'met' if ratio <= 1.2 else 'NOT met'})"
    )
    shutil.rmtree(folder, ignore_errors=True)


#: A flow run of one no-op task after the same imports: what Prefect itself costs.
BARE_FLOW = """
import prefect, torch, xarray
from prefect import flow, task

@task
def one():
    return 1

@flow
def bare():
    return one()

bare()
"""


def _wall(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    return time.perf_counter() - t0


def _trigger_to_completed(deployment: str, parameters: dict[str, Any]) -> dict[str, float]:
    """Seconds from creating a run of ``deployment`` to the server reporting it Completed.

    ``total``, and its parts from the run's state history (server timestamps):
    ``to Pending`` (the worker's poll and hand-over), ``Pending → Running`` (the new
    process: start, imports, the engine's set-up) and ``Running → Completed`` (the flow).
    """
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(deployment)
        t0 = time.perf_counter()
        run = client.create_flow_run_from_deployment(dep.id, parameters=parameters)
        while True:
            state = client.read_flow_run(run.id).state
            if state is not None and state.is_final():
                break
            time.sleep(0.05)
        seconds = time.perf_counter() - t0
        history = client.read_flow_run_states(run.id)
    if not state.is_completed():
        raise RuntimeError(f"run {run.name} ended {state.name}: {state.message}")
    at = {s.type.value: s.timestamp for s in history}
    created = run.created or at["SCHEDULED"]

    def gap(a: Any, b: Any) -> float:
        return float((b - a).total_seconds())

    return {
        "total": seconds,
        "to Pending": gap(created, at["PENDING"]),
        "Pending → Running": gap(at["PENDING"], at["RUNNING"]),
        "Running → Completed": gap(at["RUNNING"], at["COMPLETED"]),
    }


def case_overhead(root: Path, budget: str, repeats: int = 5) -> None:
    cube = write_cube(root / "cube-500.nc", 500)
    folder = root / "overhead"
    cfg = config(folder, cube, budget)
    run_child(cfg)  # fills the cache
    imports = [sys.executable, "-c", "import prefect, torch, xarray"]
    rerun = [GRIDSOLVE, "run", str(cfg)]
    # Prefect's own share: the same imports and one flow run of one no-op task
    bare = [sys.executable, "-c", BARE_FLOW]
    # side by side: each repeat times all three, so load on the machine hits them alike
    runs = [(_wall(imports), _wall(rerun), _wall(bare)) for _ in range(repeats)]
    imp = statistics.median(r[0] for r in runs)
    cached = statistics.median(r[1] for r in runs)
    bare_s = statistics.median(r[2] for r in runs)

    repo = Path(__file__).resolve().parent.parent
    subprocess.run([GRIDSOLVE, "deploy", "--project", str(repo)], check=True, capture_output=True)
    raw = yaml.safe_load(cfg.read_text())
    params = {k: raw[k] for k in ("load", "design", "model", "write", "cache", "execution")}
    # the worker is confined by default (its home's data/ and outputs/): this benchmark's
    # cube and outputs lie in its own folder, which the worker is told it may use
    env = {
        **os.environ,
        "GRIDSOLVE_HOME": str(folder / "home"),
        "GRIDSOLVE_ALLOWED_INPUTS": f"{cube.parent} {folder}",
        "GRIDSOLVE_ALLOWED_ROOTS": str(folder),
    }
    with open(folder / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [GRIDSOLVE, "worker"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _trigger_to_completed("gridsolve/on-demand", params)  # the worker's first poll
        trials = [_trigger_to_completed("gridsolve/on-demand", params) for _ in range(repeats)]
        parts = {k: statistics.median(t[k] for t in trials) for k in trials[0]}
        triggered = parts.pop("total")
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
    print("\n## overhead: seed cube, every stage cached, Prefect server up")
    print(f"  python -c 'import prefect, torch, xarray'   {imp:6.2f} s")
    print(f"  the same + a bare Prefect flow, one task    {bare_s:6.2f} s  (Prefect's own)")
    print(f"  gridsolve run (cached)                      {cached:6.2f} s")
    print(f"  on-demand via worker, trigger → Completed   {triggered:6.2f} s")
    for k, v in parts.items():
        print(f"    {k:<40}{v:6.2f} s  (median)")
    beyond = cached - imp
    print(
        f"cached rerun beyond the imports = {beyond:.2f} s "
        f"(target ≤ 1 s: {'met' if beyond <= 1 else 'NOT met'})"
    )
    print(
        f"trigger → Completed = {triggered:.2f} s "
        f"(target ≤ 4 s: {'met' if triggered <= 4 else 'NOT met'})"
    )
    shutil.rmtree(folder, ignore_errors=True)


def case_dask(root: Path, budget: str) -> None:
    cube = write_cube(root / "cube-500-nan.nc", 500, nan_fraction=0.2)
    over = {
        "design": {"impl": "harmonic", "harmonics": 4},
        "solve": {"dtype": "float64"},
        "model": {"impl": "multidim_linear", "input_dim": 10, "hidden_dim": 1, "output_dim": 4},
    }
    res = {}
    for runner in ("threads", "dask"):
        execution = {"runner": runner, "dask_workers": 2, "tile_pixels": 32768}
        res[runner] = run_child(
            config(root / f"dask-{runner}", cube, budget, execution=execution, **over)
        )
        shutil.rmtree(root / f"dask-{runner}", ignore_errors=True)
    t, d = res["threads"], res["dask"]
    print("\n## dask: masked case (20% NaN, 10 coefficients), LocalCluster 2 workers vs threads")
    for name, r in res.items():
        sv = r["stages"]
        print(
            f"  {name:<8} solve {sv['solve'][1]:6.2f} s  model {sv['model'][1]:6.2f} s  "
            f"stages {r['stage_seconds']:6.2f} s  wall {r['wall']:6.1f} s"
        )
    print(
        f"dask / threads = {d['stage_seconds'] / t['stage_seconds']:.2f}× (stages), {d['wall'] / t['wall']:.2f}× (wall)"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--case", choices=["memory", "floor", "dask", "overhead", "all"], default="all")
    p.add_argument(
        "--large", type=int, default=2000, help="side of the large grid (16× pixels at 2000)"
    )
    p.add_argument("--budget", default="1GiB")
    p.add_argument("--workdir", default=None, help="keep cubes here between runs")
    args = p.parse_args()
    print(machine())
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gridsolve-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    server = None
    if not os.environ.get("PREFECT_API_URL"):
        server = LocalServer(root / "prefect-home").start()
        os.environ["PREFECT_API_URL"] = server.api
    try:
        if args.case in ("floor", "all"):
            case_floor(root, args.budget)
        if args.case in ("overhead", "all"):
            case_overhead(root, args.budget)
        if args.case in ("dask", "all"):
            case_dask(root, args.budget)
        if args.case in ("memory", "all"):
            case_memory(root, args.large, args.budget)
    finally:
        if server is not None:
            server.stop()
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
