"""Solve benchmarks, each measured side by side in one run (medians of repeats).

shared  — the original problem: 50 obs × 500 × 500 float32, a 50×100 random design
          (coef > obs: minimum norm). The per-pixel loop (torch.linalg.lstsq, timed on a
          subset and extrapolated) vs gridsolve's normal_equations + solve stages, and
          both vs the memory floor: an in-memory copy of the input and the outputs.
          Targets: ≥ 1000× faster than the loop; ≤ 3× the floor.
masked  — 50 × 500 × 500 with 20% NaN, polynomial degree 9 (coef 10), float64:
          xarray DataArray.polyfit(skipna=True) vs gridsolve's masked stages vs the floor.
          Target: ≥ 50× faster than xarray, float64 accuracy kept. Then coef 100 > obs 50
          with gaps (minimum norm per pixel), with where the time goes.

Usage: python benchmarks/bench_solve.py [--case shared|masked|all] [--size N] [--repeats R]
"""

from __future__ import annotations

import os

#: the environment as the user started this script (the peers' processes get it)
USER_ENV = dict(os.environ)
# as the gridsolve command sets it for its processes (flows/cli.py), before numpy loads
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import cProfile
import pstats
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np
import torch

from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.stages.load.patterns import common_patterns, full_hash, pattern_hash
from gridsolve.stages.solve.block import solve_block
from gridsolve.stages.solve.outputs import p_values, t_values
from gridsolve.stages.solve.prepared import SharedOperator, make_operator

from common import machine, median_pair_seconds, median_seconds, table


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def nbytes(B: np.ndarray, out: Any) -> int:
    return int(B.nbytes + sum(a.nbytes for a in out.arrays.values()))


def stages_once(
    A: np.ndarray, B: np.ndarray, config: LstsqSolve, top: float, gaps: np.ndarray | None = None
) -> tuple[SharedOperator, Any]:
    """normal_equations (float64 SVD of the design) + solve (operator, then every pixel).

    ``top``: the cube's largest |value| (:func:`abs_max`), as in a run, so the
    solve does not scan the data for it.
    """
    sqrtw = np.ones(A.shape[0])
    svd = np.linalg.svd(A, full_matrices=False)
    op = make_operator(A, sqrtw, config, svd, data_max=top)
    return op, solve_block(B, op, config, memory_budget=2**30, gap_patterns=gaps)


def abs_max(B: np.ndarray) -> float:
    """What the load stage finds while hashing the cube, and normal_equations hands on
    (its ``abs_max``): the largest |value|."""
    return float(np.nanmax(np.abs(B)))


def grid_gap_patterns(B: np.ndarray) -> np.ndarray:
    """What the load stage finds while hashing the cube: the grid's common gap patterns."""
    return common_patterns(pattern_hash(np.isfinite(B)), full_hash(B.shape[0]))


def floor_seconds(B: np.ndarray, out: Any, repeats: int) -> tuple[float, float]:
    """The memory floor: the input and every output array copied once, in memory.

    Two readings: into buffers already paged in (pure bandwidth), and with
    ``np.copy`` (allocating, as any stage that returns new arrays must).
    """
    srcs = [B, *out.arrays.values()]
    dsts = [np.empty_like(a) for a in srcs]

    def copy_into() -> None:
        for d, s in zip(dsts, srcs, strict=True):
            np.copyto(d, s)

    def copy_new() -> None:
        for s in srcs:
            s.copy()

    return median_seconds(copy_into, repeats), median_seconds(copy_new, repeats)


def case_shared(n: int, repeats: int, loop_pixels: int) -> None:
    rng = np.random.default_rng(0)
    A = rng.standard_normal((50, 100))
    B = (rng.standard_normal((50, n * n)) * 3 + 10).astype(np.float32)
    config = LstsqSolve(policy="minnorm", dtype="float32")
    top = abs_max(B)
    stage_s = median_seconds(lambda: stages_once(A, B, config, top), repeats)
    op, out = stages_once(A, B, config, top)
    floor_s, floor_new = floor_seconds(B, out, repeats)
    # The GEMM floor: the one product this solve must do (C = P·B, coef × obs × pixels,
    # float32) with torch.mm into a fresh output, as the stage must return one: the
    # faster of a fresh tensor and a fresh numpy array (huge pages) as the output.
    Pt = torch.from_numpy(np.ascontiguousarray(op.P, dtype=np.float32))
    Bt32 = torch.from_numpy(B)
    C_shape = (op.P.shape[0], B.shape[1])
    gemm_s = min(
        median_seconds(lambda: torch.mm(Pt, Bt32), repeats),
        median_seconds(
            lambda: torch.mm(Pt, Bt32, out=torch.from_numpy(np.empty(C_shape, np.float32))),
            repeats,
        ),
    )
    limit = max(floor_new, gemm_s)

    At = torch.from_numpy(A.astype(np.float32))
    Bt = torch.from_numpy(B)
    pick = rng.choice(B.shape[1], loop_pixels, replace=False)

    def loop() -> None:
        for p in pick:
            torch.linalg.lstsq(At, Bt[:, p : p + 1], driver="gelsd")

    loop_s = median_seconds(loop, max(1, repeats // 2)) * B.shape[1] / loop_pixels
    C = out.arrays["coefficients"].astype(np.float64)
    ref = np.linalg.lstsq(A, B[:, pick].astype(np.float64), rcond=None)[0]
    rel = np.max(np.linalg.norm(C[:, pick] - ref, axis=0) / np.linalg.norm(ref, axis=0))

    print(f"\n## shared design: 50 obs × {n}×{n} float32, design 50×100 (coef > obs, minimum norm)")
    print(
        table(
            [
                (
                    "per-pixel loop (torch.linalg.lstsq)",
                    loop_s,
                    f"timed on {loop_pixels} pixels, extrapolated",
                ),
                ("gridsolve normal_equations+solve", stage_s, f"max rel. error vs lstsq {rel:.1e}"),
                ("floor: copy in+out, paged-in", floor_s, f"{nbytes(B, out) / 1e6:.0f} MB"),
                ("floor: copy in+out, np.copy", floor_new, "allocates, like any stage"),
                (
                    "floor: GEMM C = P·B (torch.mm)",
                    gemm_s,
                    f"{op.P.shape[0]}×{B.shape[0]}×{B.shape[1]:,} float32",
                ),
            ],
            floor_s,
            "floor",
        )
    )
    speedup = loop_s / stage_s
    print(f"loop / gridsolve = {speedup:,.0f}× (target ≥ 1000×: {verdict(speedup >= 1000)})")
    print(
        f"gridsolve / floor = {stage_s / floor_s:.2f}× paged-in, "
        f"{stage_s / floor_new:.2f}× np.copy "
        f"(target ≤ 3×: {verdict(stage_s <= 3 * floor_s)} / {verdict(stage_s <= 3 * floor_new)})"
    )
    print(
        f"gridsolve / its limit (max of np.copy floor, GEMM floor) = {stage_s / limit:.2f}× "
        f"(target ≤ 1.5×: {verdict(stage_s <= 1.5 * limit)})"
    )


def _profile(fn: Any) -> dict[str, float]:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof)
    wanted = {
        "_primal": "per-pixel normal equations (primal, total)",
        "_dual": "per-pixel dual system (total)",
        "_dual_schur": "per-pixel dual by gaps (total)",
        "colmm": "matrix products (forming AᵀWA / AAᵀ, residuals)",
        "batched_cholesky": "vectorised Cholesky",
        "cholesky_solve": "triangular solves (incl. refinement)",
        "svd_per_pixel": "per-pixel SVD fallback",
        "_groups": "grouping pixels by gap pattern",
    }
    out = {}
    for (file, _, name), row in stats.stats.items():  # type: ignore[attr-defined]
        if name in wanted and ("linalg" in file or "solve" in file):
            out[wanted[name]] = out.get(wanted[name], 0.0) + row[3]
    return out


XARRAY_PEER = """
import sys, time
import numpy as np, xarray as xr
data, t = np.load(sys.argv[1]), np.load(sys.argv[2])
da = xr.DataArray(data, dims=("t", "y", "x"), coords={"t": t})
runs = []
for _ in range(int(sys.argv[3])):
    t0 = time.perf_counter()
    fit = da.polyfit("t", 9, skipna=True)["polyfit_coefficients"].values
    runs.append(time.perf_counter() - t0)
np.save(sys.argv[4], fit)
print(float(np.median(runs)))
"""


def xarray_polyfit(data: np.ndarray, t: np.ndarray, repeats: int) -> tuple[float, np.ndarray]:
    """Median seconds and coefficients of xarray's ``polyfit(skipna=True)`` over ``data``.

    In a process of its own with the environment as the user has it: this one keeps
    OpenBLAS on one thread as gridsolve's command does, which would slow the peer.
    """
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if "OPENBLAS_NUM_THREADS" in USER_ENV:
        env["OPENBLAS_NUM_THREADS"] = USER_ENV["OPENBLAS_NUM_THREADS"]
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"{n}.npy") for n in ("data", "t", "fit")]
        np.save(paths[0], data)
        np.save(paths[1], t)
        done = subprocess.run(
            [sys.executable, "-c", XARRAY_PEER, paths[0], paths[1], str(repeats), paths[2]],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        return float(done.stdout.split()[-1]), np.load(paths[2])


def case_masked(n: int, repeats: int, xr_repeats: int) -> None:
    rng = np.random.default_rng(1)
    n_obs = 50
    t = np.linspace(-1.0, 1.0, n_obs)
    amp = rng.random((n, n))
    data = (np.cos(3 * t)[:, None, None] * amp + 0.1 * rng.standard_normal((n_obs, n, n))).astype(
        np.float32
    )
    data[rng.random(data.shape) < 0.2] = np.nan
    B = data.reshape(n_obs, -1)
    A = np.vander(t, 10, increasing=True)
    config = LstsqSolve(policy="minnorm", dtype="float64")

    xr_s, fit = xarray_polyfit(data, t, xr_repeats)
    gaps, top = grid_gap_patterns(B), abs_max(B)
    config_se = config.model_copy(update={"uncertainty": "stderr"})
    # alternately, at least 9 times each: the stderr ratio compares two runs of ~0.15 s
    stage_s, stage_se = median_pair_seconds(
        lambda: stages_once(A, B, config, top, gaps),
        lambda: stages_once(A, B, config_se, top, gaps),
        max(repeats, 9),
    )
    se_out = stages_once(A, B, config_se, top, gaps)[1].arrays
    p_s = median_seconds(
        lambda: p_values(t_values(se_out["coefficients"], se_out["coef_stderr"]), se_out["dof"]),
        repeats,
    )
    _, out = stages_once(A, B, config, top, gaps)
    floor_s, floor_new = floor_seconds(B, out, repeats)
    C = out.arrays["coefficients"]
    ref = fit[::-1].reshape(10, -1)  # polyfit: highest degree first
    both = np.isfinite(ref).all(0) & np.isfinite(C).all(0)
    rel_xr = np.max(
        np.linalg.norm(C[:, both] - ref[:, both], axis=0) / np.linalg.norm(ref[:, both], axis=0)
    )
    pick = rng.choice(np.flatnonzero(both), 300, replace=False)
    rel_ls = 0.0
    for p in pick:
        ok = np.isfinite(B[:, p])
        one = np.linalg.lstsq(A[ok], B[ok, p].astype(np.float64), rcond=None)[0]
        rel_ls = max(rel_ls, float(np.linalg.norm(C[:, p] - one) / np.linalg.norm(one)))
    print(f"\n## masked: 50 obs × {n}×{n}, 20% NaN, polynomial degree 9 (coef 10), float64")
    print(
        table(
            [
                ("xarray polyfit(skipna=True)", xr_s, f"median of {xr_repeats}"),
                (
                    "gridsolve normal_equations+solve",
                    stage_s,
                    f"max rel. diff: xarray {rel_xr:.1e}, lstsq (300 px) {rel_ls:.1e}",
                ),
                (
                    "gridsolve, solve.uncertainty: stderr",
                    stage_se,
                    f"{stage_se / stage_s:.2f}× without it (target ≤ 1.3×)",
                ),
                (
                    "  + t and p-values where written (write stage)",
                    p_s,
                    f"{se_out['coef_stderr'].size / 1e6:.1f}M scipy stdtr calls",
                ),
                ("floor: copy in+out, paged-in", floor_s, f"{nbytes(B, out) / 1e6:.0f} MB"),
                ("floor: copy in+out, np.copy", floor_new, "allocates, like any stage"),
            ],
            floor_s,
            "floor",
        )
    )
    print(f"paths: {out.meta['paths']}; status: {out.meta['status_counts']}")
    ratio = stage_se / stage_s
    print(f"stderr / without = {ratio:.2f}× (target ≤ 1.3×: {verdict(ratio <= 1.3)})")
    speed = xr_s / stage_s
    print(
        f"xarray / gridsolve = {speed:.1f}× (target ≥ 50×: {'met' if speed >= 50 else 'NOT met'})"
    )
    prof = _profile(lambda: stages_once(A, B, config, top, gaps))
    print(
        "where the time goes (one run, cProfile, cumulative s): "
        + "; ".join(f"{k} {v:.2f}" for k, v in prof.items())
    )

    # coef 100 > obs 50 with gaps: minimum norm per pixel (dual form, by each pixel's gaps).
    A100 = rng.standard_normal((n_obs, 100))
    s100 = median_seconds(lambda: stages_once(A100, B, config, top, gaps), max(1, repeats // 2))
    _, out100 = stages_once(A100, B, config, top, gaps)
    C = out100.arrays["coefficients"]
    rel100 = 0.0
    for p in pick[:100]:
        ok = np.isfinite(B[:, p])
        one = np.linalg.lstsq(A100[ok], B[ok, p].astype(np.float64), rcond=None)[0]
        rel100 = max(rel100, float(np.linalg.norm(C[:, p] - one) / np.linalg.norm(one)))
    prof = _profile(lambda: stages_once(A100, B, config, top, gaps))
    print(
        f"\n## masked, coef 100 > obs 50 (minimum norm per pixel): {s100:.2f} s "
        f"for {B.shape[1]:,} pixels ({s100 / floor_s:.0f}× floor); "
        f"max rel. error vs lstsq (100 px) {rel100:.1e}"
    )
    print(f"paths: {out100.meta['paths']}")
    print(
        "where the time goes (cProfile, cumulative s): "
        + "; ".join(f"{k} {v:.2f}" for k, v in prof.items())
    )
    print(f"masked coef > obs = {s100:.2f} s (target ≤ 1 s: {'met' if s100 <= 1 else 'NOT met'})")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--case", choices=["shared", "masked", "all"], default="all")
    p.add_argument("--size", type=int, default=500, help="grid is size × size pixels")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--loop-pixels", type=int, default=2000)
    p.add_argument("--xarray-repeats", type=int, default=3)
    args = p.parse_args()
    print(machine())
    if args.case in ("shared", "all"):
        case_shared(args.size, args.repeats, args.loop_pixels)
    if args.case in ("masked", "all"):
        case_masked(args.size, args.repeats, args.xarray_repeats)


if __name__ == "__main__":
    main()
