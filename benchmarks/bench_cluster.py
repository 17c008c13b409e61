"""Threads vs a Dask cluster of separate processes, on a 4-D cube given as a glob of files.

One run each way, side by side, each with its own empty cache (so every stage
computes): the threads runner in the flow's process, and a ``dask scheduler``
plus two ``dask worker --nthreads 1`` processes started here on 127.0.0.1
(``execution.dask_address``), reading the input files themselves. No target:
the figures say what a cluster costs on one 2-core machine, where it cannot be
faster (its workers share the same two cores and add scheduling and transfer).

Usage: python benchmarks/bench_cluster.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from gridsolve.flows.localserver import LocalServer, free_port, stop_group
from gridsolve.flows.pipeline import run_config
from gridsolve.schemas.pipeline import build_config
from gridsolve.stages.load.demo import make_cube

from common import machine, table


def cube(folder: Path) -> str:
    """The demo cube (50 × 128 × 128) twice along ``member``, in 5 files along time."""
    one = make_cube(50, 128, 128, seed=0, nan_fraction=0.1, dtype="float32")
    ds = xr.concat([one, one * 0.5 + 1.0], dim="member").transpose("time", "member", "y", "x")
    ds = ds[["signal"]]
    for i in range(5):
        ds.isel(time=slice(10 * i, 10 * i + 10)).to_netcdf(folder / f"part-{i}.nc")
    return str(folder / "part-*.nc")


def config(root: Path, src: str, name: str, **execution: Any) -> Any:
    return build_config(
        {
            "load": {"path": src, "variable": "signal"},
            "design": {"impl": "harmonic", "harmonics": 1},
            "model": {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 3},
            "write": {"path": str(root / f"{name}.nc")},
            "cache": {"root": str(root / f"cache-{name}")},
            "execution": {"memory_budget": "16MiB", **execution},  # several tiles
        }
    )


def timed(root: Path, src: str, name: str, **execution: Any) -> float:
    shutil.rmtree(root / f"cache-{name}", ignore_errors=True)
    t0 = time.perf_counter()
    summary = run_config(config(root, src, name, **execution))
    seconds = time.perf_counter() - t0
    assert not any(s.hit for s in summary.stages), "a stage came from the cache"
    return seconds


def start(command: list[str]) -> subprocess.Popen[bytes]:
    """A quiet child process in its own session (stopped with its children by stop_group)."""
    return subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(machine())
    root = Path(tempfile.mkdtemp(prefix="gridsolve-bench-cluster-"))
    server = None
    if not os.environ.get("PREFECT_API_URL"):
        server = LocalServer(root / "prefect-home").start()
        os.environ["PREFECT_API_URL"] = server.api
    dask_bin = str(Path(sys.executable).parent / "dask")
    port = free_port()
    scheduler = [dask_bin, "scheduler", "--host", "127.0.0.1", "--port", str(port)]
    worker = [dask_bin, "worker", f"tcp://127.0.0.1:{port}", "--nthreads", "1"]
    local = ["--host", "127.0.0.1", "--dashboard-address", ":0"]
    procs = [start([*scheduler, "--dashboard-address", ":0", "--no-show"])]
    try:
        src = cube(root)
        for _ in range(2):
            procs.append(start([*worker, *local, "--no-nanny"]))
        from distributed import Client

        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
        address = f"tcp://127.0.0.1:{port}"
        # One untimed run each first: imports, worker warm-up and the store's folders.
        timed(root, src, "threads")
        timed(root, src, "cluster", runner="dask", dask_address=address)
        threads, cluster = [], []
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            threads.append(timed(root, src, "threads"))
            cluster.append(timed(root, src, "cluster", runner="dask", dask_address=address))
        with xr.open_dataset(root / "threads.nc") as a, xr.open_dataset(root / "cluster.nc") as b:
            diff = float(np.nanmax(np.abs(a["coefficients"].values - b["coefficients"].values)))
        t, c = float(np.median(threads)), float(np.median(cluster))
        tiles = run_config(config(root, src, "threads")).tiles
        print(
            f"cube: time 50 × member 2 × 128 × 128 float32, 10 % NaN, 5 files (glob); {tiles} tiles"
        )
        print(
            table(
                [
                    ("threads (flow process)", t, f"runs {[round(x, 2) for x in threads]}"),
                    (
                        "dask cluster, 2 worker processes",
                        c,
                        f"runs {[round(x, 2) for x in cluster]}",
                    ),
                ],
                t,
                "threads",
            )
        )
        print(f"largest |coefficient difference| cluster vs threads: {diff:.3g}")
    finally:
        for proc in procs:
            stop_group(proc)
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
