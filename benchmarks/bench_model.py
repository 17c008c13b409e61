"""Per-sample gradients of the model stage vs the peers, side by side in one run (medians).

The problem of issue 13: 250,000 pixels (500 × 500), the 10×10×4 multidim linear model
(``tensordot(x, W, 2) + b``, x of 10 × 10 coefficients), sum objective, float32. Rows:

loop       a Python loop of torch.autograd.grad, timed on --loop-pixels and extrapolated
vmap       vmap(grad(...)) of the same single-sample model, written by hand
backpack   BackPACK BatchGrad on the model rewritten by hand as nn.Linear(100, 4)
opacus     Opacus GradSampleModule (loss_reduction="sum") on the same rewrite
gridsolve  the model stage's tile function (stages/model/vmapped.py run_tile) on the
           unmodified model, eager and compiled: compute only (its outputs are the
           pixel-last arrays the store writes)
store      the same through the runner (stages/engine/runner.run_tile): key, compute,
           contract check, store write and read-back, on a fresh artifact each repeat

cli        the model row of ``gridsolve run``'s summary on the same problem (the demo's
           seed cube and config, ``gridsolve demo --size seed`` once, then ``gridsolve
           run --profile`` in a fresh process with a fresh cache, median of at least 3:
           setup included: importing torch.func's machinery, building and probing the
           model, every tile with its store), as a user reads it, with its compute and
           store phases; beside it the store's floor: the same bytes put into new
           files by a fresh process, by write from memory, by filling mapped files,
           and by writes of 1 MB row blocks from one buffer (as the store now does)

Targets (issue 13): compute ≤ 1.5× BackPACK; incl. store ≤ 3× BackPACK; compute ≥ 100×
faster than the loop. Issue 29: the model stage as the run summary reports it ≤ 3×
BackPACK's compute. Peers come from the ``bench`` extra:
``pip install -e '.[bench]'``.

Usage: python benchmarks/bench_model.py [--size N] [--repeats R] [--loop-pixels P]
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import gridsolve.stages  # noqa: F401  (registers the built-in implementations)
from gridsolve.schemas.artifacts import Tile, TiledRef
from gridsolve.schemas.kinds.design import RandomDesign
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.kinds.model import MultidimLinearModel
from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.runner import _open, prepare_stage, run_stage, run_tile
from gridsolve.stages.engine.store import Store
from gridsolve.stages.load.demo import make_cube, write_atomic
from gridsolve.stages.model import building, compiled, vmapped

from common import machine, print_verdicts, table


def timed(fn: Callable[[], Any], repeats: int, setup: Callable[[], None] | None = None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up (``setup`` untimed)."""
    if setup:
        setup()
    fn()
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Pipeline:
    """load → design → normal_equations → solve on one tile, through the runner (no Prefect)."""

    def __init__(self, folder: Path, n: int) -> None:
        cube = write_atomic(make_cube(50, n, n, seed=0), folder / "cube.nc")
        self.ctx = StageContext(store=Store(folder / "cache"), memory_budget=2**30)
        self.refs: dict[str, Any] = {}
        for kind, cfg in (
            ("load", NetCDFLoad(path=str(cube), variable="signal")),
            ("design", RandomDesign(coef=100, seed=0)),
            ("normal_equations", SVDNormalEquations()),
        ):
            self.refs[kind] = run_stage(cfg, self.refs, self.ctx).ref
        self.tile = Tile(index=0, y0=0, y1=n, x0=0, x1=n)
        solve = LstsqSolve()
        prep = prepare_stage(solve, self.refs, self.ctx)
        tile = run_tile(solve, self.refs, prep.ref, self.tile, self.ctx)
        self.refs["solve"] = TiledRef(
            kind="solve",
            impl=solve.impl,
            key=prep.ref.meta["_stage_key"],
            prepared=prep.ref,
            tiles=(tile.ref,),
        )

    def tile_refs(self) -> dict[str, Any]:
        return {**self.refs, "solve": self.refs["solve"].tiles[0]}

    def coefficients(self) -> np.ndarray:
        """(pixels, 10, 10) float32, pixel-first, as the peers take them."""
        art = self.ctx.store.get(self.refs["solve"].tiles[0].key)
        c = np.asarray(art.array("coefficients"), np.float32)
        return np.ascontiguousarray(c.reshape(100, -1).T).reshape(-1, 10, 10)


def linear_rewrite(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    """The multidim linear model as nn.Linear(100, 4): the hand rewrite the peers need."""
    lin = nn.Linear(100, 4)
    with torch.no_grad():
        lin.weight.copy_(weight.reshape(100, 4).T)
        lin.bias.copy_(bias)
    return lin


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", type=int, default=500, help="grid is size × size pixels")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--loop-pixels", type=int, default=2000)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(machine())
    folder = Path(tempfile.mkdtemp(prefix="gridsolve-bench-model-"))
    try:
        run(folder, args.size, args.repeats, args.loop_pixels)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(folder: Path, n: int, repeats: int, loop_pixels: int) -> None:
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad
    from opacus import GradSampleModule

    pipe = Pipeline(folder, n)
    X = torch.from_numpy(pipe.coefficients())
    n_px = X.shape[0]
    cfg = MultidimLinearModel(input_dim=10, hidden_dim=10, output_dim=4)
    module = building.build_module(cfg)
    params = {k: v.detach() for k, v in module.named_parameters()}

    # ---- the loop, extrapolated
    pick = torch.from_numpy(np.random.default_rng(0).choice(n_px, loop_pixels, replace=False))

    def loop() -> None:
        for i in pick:
            torch.autograd.grad(module(X[i]).sum(), [module.weight, module.bias])

    loop_s = timed(loop, max(1, repeats // 2)) * n_px / loop_pixels

    # ---- vmap(grad) by hand
    def objective(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(module, p, (x,))
        return out.sum()

    hand = vmap(grad(objective), in_dims=(None, 0))
    hand_s = timed(lambda: hand(params, X), repeats)
    ref = hand(params, X)

    # ---- BackPACK and Opacus on the nn.Linear rewrite
    X2 = X.reshape(n_px, 100)
    bp = extend(linear_rewrite(params["weight"], params["bias"]))

    def backpack_grads() -> None:
        bp.zero_grad()
        with backpack(BatchGrad()):
            bp(X2).sum().backward()

    backpack_s = timed(backpack_grads, repeats)
    bp_w = bp.weight.grad_batch.reshape(n_px, 4, 10, 10).permute(0, 2, 3, 1)
    op = GradSampleModule(linear_rewrite(params["weight"], params["bias"]), loss_reduction="sum")

    def opacus_grads() -> None:
        op.zero_grad(set_to_none=True)
        op(X2).sum().backward()

    opacus_s = timed(opacus_grads, repeats)

    # ---- gridsolve: the stage's tile function, then through the runner with the store
    rows: list[tuple[str, float, str]] = []
    stage: dict[str, float] = {}
    results: dict[str, Any] = {}
    inputs_refs = pipe.tile_refs()
    for mode in ("never", "always"):
        mcfg = cfg.model_copy(update={"compile": mode})
        prep = prepare_stage(mcfg, inputs_refs, pipe.ctx)
        prepared = pipe.ctx.store.get(prep.ref.key)
        opened = {k: _open(inputs_refs[k], pipe.ctx.store) for k in ("load", "design", "solve")}
        compiled._forget_compiled()
        t0 = time.perf_counter()
        out = vmapped.run_tile(mcfg, opened, prepared, pipe.tile, pipe.ctx)
        first = time.perf_counter() - t0
        kernel = out.meta["kernel"]
        results[mode] = out
        stage[f"compute-{mode}"] = timed(
            lambda mcfg=mcfg, opened=opened, prepared=prepared: vmapped.run_tile(
                mcfg, opened, prepared, pipe.tile, pipe.ctx
            ),
            repeats,
        )
        key = run_tile(mcfg, inputs_refs, prep.ref, pipe.tile, pipe.ctx).ref.key

        def fresh(key: str = key) -> None:
            shutil.rmtree(pipe.ctx.store.path(key))

        def through_runner(mcfg: MultidimLinearModel = mcfg, prep: Any = prep) -> None:
            r = run_tile(mcfg, inputs_refs, prep.ref, pipe.tile, pipe.ctx, use_cache=False)
            assert not r.hit

        stage[f"store-{mode}"] = timed(through_runner, repeats, setup=fresh)
        label = "compiled" if mode == "always" else "eager"
        rows.append(
            (
                f"gridsolve compute, {label}",
                stage[f"compute-{mode}"],
                f"kernel: {kernel}; first call {first:.1f} s"
                + (" (incl. torch.compile)" if mode == "always" else ""),
            )
        )
        rows.append(
            (
                f"gridsolve incl. store, {label}",
                stage[f"store-{mode}"],
                "runner.run_tile, fresh artifact each repeat",
            )
        )

    # ---- agreement of the gridsolve outputs with the peers
    def pixel_first(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.moveaxis(a.reshape(*a.shape[:-2], -1), -1, 0))

    agree = []
    for mode, out in results.items():
        gw = pixel_first(out.arrays["grad:weight"])
        agree.append(
            f"{mode}: max|Δ| vs vmap {float((gw - ref['weight']).abs().max()):.1e}, "
            f"vs BackPACK {float((gw - bp_w).abs().max()):.1e}"
        )

    print(f"\n## per-sample gradients: {n}×{n} = {n_px:,} pixels, 10×10×4 model, sum objective")
    print(
        table(
            [
                ("autograd loop", loop_s, f"timed on {loop_pixels:,} pixels, extrapolated"),
                ("vmap(grad) by hand", hand_s, "unmodified model, pixel-first"),
                ("BackPACK BatchGrad", backpack_s, "nn.Linear(100, 4) rewrite"),
                ("Opacus GradSampleModule", opacus_s, "nn.Linear(100, 4) rewrite"),
                *rows,
            ],
            backpack_s,
            "BackPACK",
        )
    )
    print("agreement: " + "; ".join(agree))
    best = min(stage["compute-never"], stage["compute-always"])
    best_store = min(stage["store-never"], stage["store-always"])
    verdicts = [
        ("compute / BackPACK", best / backpack_s, 1.5, "≤"),
        ("incl. store / BackPACK", best_store / backpack_s, 3.0, "≤"),
        ("loop / compute", loop_s / best, 100.0, "≥"),
    ]
    if n == 500:  # the seed demo's grid: the same problem as BackPACK's row
        cli = CliRuns(folder / "cli")
        runs = [cli.model_row() for _ in range(max(3, repeats))]
        summary_s = statistics.median(r[0] for r in runs)
        stored = sum(a.nbytes for a in results["never"].arrays.values())
        before = int(statistics.median(r[3] for r in runs)) - stored
        floors = store_floor_seconds(folder / "floor", before, stored, max(3, repeats))
        floor_s = min(floors.values())
        print(
            f"gridsolve run's summary, model row (seed demo's config, a fresh process and "
            f"cache each): median {summary_s:.2f} s of {len(runs)} runs (range "
            f"{min(r[0] for r in runs):.2f}–{max(r[0] for r in runs):.2f} s) = "
            f"{summary_s / backpack_s:.1f}× BackPACK compute; of it (--profile, summed over "
            f"tiles, medians): compute {statistics.median(r[1] for r in runs):.2f} s, store "
            f"{statistics.median(r[2] for r in runs):.2f} s of {stored / 1e6:.0f} MB"
        )
        print(
            f"store floor: those {stored / 1e6:.0f} MB put into 4 new files by a fresh process "
            f"that first wrote the {before / 1e6:.0f} MB the earlier stages store, medians: "
            f"{floors['rows']:.2f} s by writes of row blocks from one buffer (as the model "
            f"stage now fills them), {floors['mapped']:.2f} s filling mapped files, "
            f"{floors['write']:.2f} s by write from memory; the least = "
            f"{floor_s / backpack_s:.1f}× BackPACK compute"
        )
        verdicts.append(
            ("model stage in the run summary / BackPACK", summary_s / backpack_s, 3.0, "≤")
        )
    else:
        print("gridsolve run's summary: not timed (the seed demo is 500 × 500; --size differs)")
    print_verdicts(verdicts)


class CliRuns:
    """``gridsolve run --profile`` of the seed demo's config, as a user runs it."""

    def __init__(self, folder: Path) -> None:
        self.exe = Path(sys.executable).parent / "gridsolve"
        self.folder = folder
        self._run("demo", "--size", "seed", "--out", str(folder))  # the cube and its config
        self.runs = 0

    def _run(self, *args: str) -> str:
        res = subprocess.run([str(self.exe), *args], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"gridsolve {args[0]} failed: {res.stderr[-2000:]}")
        return res.stdout

    def model_row(self) -> tuple[float, float, float, int]:
        """(the summary's model seconds, its compute and store phases, the bytes the run
        stored in its cache): a cold run, a fresh process and cache, removed after."""
        self.runs += 1
        cache, out = self.folder / f"cache{self.runs}", self.folder / f"out{self.runs}.nc"
        text = self._run(
            "run",
            str(self.folder / "gridsolve.yaml"),
            "--profile",
            "--set",
            f"cache.root={cache}",
            "--set",
            f"write.path={out}",
        )
        cached = sum(f.stat().st_size for f in (cache / "objects").rglob("*.npy"))
        shutil.rmtree(cache, ignore_errors=True)
        for f in self.folder.glob(f"out{self.runs}.nc*"):
            f.unlink()
        lines = text.splitlines()
        rows = [line.split() for line in lines if line.startswith("model ")]
        profs = [line for line in lines if line.strip().startswith("model ") and " · " in line]
        if not rows or not profs:
            raise RuntimeError(f"no model row or profile line in gridsolve run's output:\n{text}")
        row, prof = rows[0], profs[0]
        phases = {k: float(v) for k, v in re.findall(r"(\w+) (\d+\.\d+)", prof)}
        if not {"compute", "store"} <= set(phases):
            raise RuntimeError(f"no compute and store phases in the profile's line: {prof!r}")
        # seconds, then pixels/s (the cache label may hold spaces)
        return float(row[-2]), phases["compute"], phases["store"], cached


def store_floor_seconds(folder: Path, before: int, nbytes: int, repeats: int) -> dict[str, float]:
    """Median seconds for a fresh process to put ``nbytes`` into 4 new files (as the model's
    4 tiles), after it wrote ``before`` bytes untimed (what the run's earlier stages
    stored): by ``write`` from arrays made before the clock starts, by filling mapped
    files (blocks reserved, pages mapped in, then written), and by writes of 1 MB row
    blocks from one buffer into files with their blocks reserved (``Staging.write``).

    The store's floor on this host. A fresh process's first writes to memory it has not
    touched cost far more than later ones (this VM backs its memory on first use: 408 MB
    took 0.18-0.74 s of page faults, 0.03 s when written again), and the kernel throttles a
    process writing a few hundred MB to new files (measured here: 100 MB in 0.03 s, then
    0.23-0.37 s per 100 MB in the same process).
    """
    code = (
        "import mmap, os, sys, time, numpy as np\n"
        "how, folder, before, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])\n"
        "with open(f'{folder}/before.bin', 'wb') as f: f.write(np.ones(before // 4, np.float32).data)\n"
        "src = np.ones(n // 16, np.float32)\n"
        "parts = [src.copy() for _ in range(4)] if how == 'write' else []\n"
        "t0 = time.perf_counter()\n"
        "for i in range(4):\n"
        "    path = f'{folder}/tile{i}.bin'\n"
        "    if how == 'write':\n"
        "        with open(path, 'wb') as f: f.write(parts[i].data)\n"
        "        continue\n"
        "    with open(path, 'wb') as f: os.posix_fallocate(f.fileno(), 0, src.nbytes)\n"
        "    if how == 'rows':\n"
        "        fd, block = os.open(path, os.O_WRONLY), src[: 2**18].view(np.uint8).data\n"
        "        for at in range(0, src.nbytes, len(block)):\n"
        "            os.pwrite(fd, block[: src.nbytes - at], at)\n"
        "        os.close(fd)\n"
        "        continue\n"
        "    a = np.memmap(path, np.float32, 'r+', shape=src.shape)\n"
        "    a._mmap.madvise(getattr(mmap, 'MADV_POPULATE_WRITE', 23))\n"
        "    np.copyto(a, src)\n"
        "print(time.perf_counter() - t0)\n"
    )
    times: dict[str, list[float]] = {"write": [], "mapped": [], "rows": []}
    for _ in range(repeats):
        for how, got in times.items():
            folder.mkdir(parents=True, exist_ok=True)
            res = subprocess.run(
                [sys.executable, "-c", code, how, str(folder), str(before), str(nbytes)],
                capture_output=True,
                text=True,
                check=True,
            )
            shutil.rmtree(folder)
            got.append(float(res.stdout))
    return {how: statistics.median(got) for how, got in times.items()}


if __name__ == "__main__":
    main()
