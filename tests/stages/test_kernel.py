"""The compiled per-pixel kernels (stages/solve/kernel.py) against the eager torch path and numpy.

Every kernel is compared with an independent computation: the eager functions in
linalg (a different implementation of the same algorithm) and numpy formulas, under
the agreement bound; the fallbacks (no compiler, ``eager``, a required kernel that
cannot be built) are exercised by building in a fresh directory.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.stages.engine.agreement import disagreements
from gridsolve.stages.solve import kernel, linalg
from gridsolve.stages.solve.block import solve_block
from gridsolve.stages.solve.cholesky import (
    PackedFactor,
    _step,
    batched_cholesky,
    cholesky_solve,
    lower_pairs,
    packed_cholesky,
)
from gridsolve.stages.solve.columns import residual_moments
from gridsolve.stages.solve.policy import (
    FELL_BACK_MINNORM,
    FELL_BACK_RIDGE,
    OK,
    PIVOT_TOL,
    REFINE_STEPS,
    REFINE_TOL,
    SINGULAR,
    UNDERDETERMINED,
    Policy,
)
from gridsolve.stages.solve.prepared import make_operator
from gridsolve.stages.solve.primal import _primal, _primal_setup
from gridsolve.stages.solve.spread import _primal_spread

# Skipped only outside CI: in CI (CI=1) a machine without a C compiler fails these.
needs_kernel = pytest.mark.skipif(
    kernel.name() != "c" and not os.environ.get("CI"), reason="no C compiler on this machine"
)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often each compiled kernel ran inside the test (its wrapper in kernel.py)."""
    seen: dict[str, int] = {}
    for name in (
        "cholesky",
        "solve_",
        "spread",
        "moments",
        "load",
        "statistics",
        "gap_solve",
        "gap_factor",
        "step",
        "fit",
    ):
        fn = getattr(kernel, name)

        def counted(*args: object, _fn: object = fn, _name: str = name, **kw: object) -> object:
            if kernel._library() is not None:  # called with the library there: it ran
                seen[_name] = seen.get(_name, 0) + 1
                for part in ("spread", "rhs"):  # the factorisation with a fused pass
                    if kw.get(part) is not None:
                        seen[f"{_name}+{part}"] = seen.get(f"{_name}+{part}", 0) + 1
            return _fn(*args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(kernel, name, counted)
    return seen


@pytest.fixture
def eager(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inside the test: the eager path (the library's cache is restored afterwards)."""
    monkeypatch.setenv(kernel.ENV, "eager")
    kernel._library.cache_clear()
    yield
    monkeypatch.delenv(kernel.ENV)
    kernel._library.cache_clear()


def _systems(n: int, p: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed Gram matrices of ``p`` random gappy systems of order ``n``, a few degenerate."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(3 * n + 2, n, dtype=torch.float64, generator=g)
    W = (torch.rand(A.shape[0], p, generator=g) > 0.2).double()
    r, c = lower_pairs(n)
    G = ((A[:, r] * A[:, c]).T @ W).contiguous()
    G[:, 3] = torch.nan  # a NaN pixel
    G[:, 5] = 0.0  # an all-gap pixel
    if n > 1:  # a rank-deficient pixel: column 1 repeats column 0
        G[:, 7] = ((A[:, r] * A[:, c]).T @ W[:, 7]).clone()
        G[1, 7], G[n, 7] = G[0, 7], G[0, 7]
    h = torch.randn(n, p, dtype=torch.float64, generator=g)
    T = torch.tril(torch.randn(n, n, dtype=torch.float64, generator=g)) + 3 * torch.eye(n)
    return G, h, T


def _both(G: torch.Tensor, n: int, h: torch.Tensor, T: torch.Tensor) -> dict[str, list]:
    out: dict[str, list] = {}
    for how in ("eager", "c"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(kernel.ENV, how)
            kernel._library.cache_clear()
            Gc = G.clone()
            ok = packed_cholesky(Gc, n)
            L = PackedFactor(Gc, n)
            assert L.compiled == (how == "c")
            x = L.solve_(h.clone())
            full = _primal_spread(L, T, 0.0, True)
            ridge = _primal_spread(L, None, 0.3, False)
            plain = _primal_spread(L, T, 0.0, False)  # variances only
            unit = _primal_spread(L, None, 0.0, False)
            out[how] = [ok, Gc, x, full.var, full.cov, ridge.var, ridge.edf, plain.var, unit.var]
    kernel._library.cache_clear()
    return out


@needs_kernel
@pytest.mark.parametrize("n", [1, 2, 3, 5, 10, 17])
def test_factor_solve_and_spread_agree_with_eager(n: int) -> None:
    p = 333  # not a multiple of the kernel's 64-pixel blocks
    G, h, T = _systems(n, p, seed=n)
    got = _both(G, n, h, T)
    ok_e, ok_c = got["eager"][0], got["c"][0]
    assert torch.equal(ok_e, ok_c)
    assert not ok_c[3] and not ok_c[5] and (n == 1 or not ok_c[7])
    good = ok_c.clone()
    for e, c in zip(got["eager"][1:], got["c"][1:], strict=True):
        e, c = e[..., good], c[..., good]
        assert torch.isfinite(c).all()
        scale = float(e.abs().max())
        assert float((e - c).abs().max()) <= 1e-12 * scale


@needs_kernel
@pytest.mark.parametrize("n", [1, 3, 10, 16])
def test_variances_fused_into_the_factorisation_equal_the_separate_pass(n: int) -> None:
    p = 333  # not a multiple of the kernel's 64-pixel blocks
    G, _, T = _systems(n, p, seed=40 + n)
    Gc = G.clone()
    ok = kernel.cholesky(Gc, n, PIVOT_TOL)
    with_t = torch.empty(0)
    for t in (T, None):
        var, _ = kernel.spread(Gc, n, t, False)
        Gf, fused = G.clone(), torch.empty((n, p), dtype=torch.float64)
        assert torch.equal(kernel.cholesky(Gf, n, PIVOT_TOL, spread=(t, fused)), ok)
        assert torch.equal(Gf.isnan(), Gc.isnan())
        assert torch.equal(torch.nan_to_num(Gf), torch.nan_to_num(Gc))
        assert torch.equal(fused.isnan(), var.isnan())
        assert torch.equal(torch.nan_to_num(fused), torch.nan_to_num(var))
        with_t = fused if t is not None else with_t
    # and against numpy where the pixel factored: diag((TᵀG⁻¹T)) with Z = L⁻¹T
    r, c = lower_pairs(n)
    for px in torch.nonzero(ok).flatten().tolist()[:20]:
        M = np.zeros((n, n))
        M[r.numpy(), c.numpy()] = G[:, px].numpy()
        M = M + np.tril(M, -1).T
        want = np.diag(T.numpy().T @ np.linalg.solve(M, T.numpy()))
        np.testing.assert_allclose(with_t[:, px].numpy(), want, rtol=1e-9)


@needs_kernel
@pytest.mark.parametrize("n", [1, 3, 10, 17])
def test_solve_fused_into_the_factorisation_equals_the_separate_one(n: int) -> None:
    p = 333
    G, h, T = _systems(n, p, seed=60 + n)
    Gc = G.clone()
    ok = kernel.cholesky(Gc, n, PIVOT_TOL)
    want = kernel.solve_(Gc, n, h.clone())
    Gf, got = G.clone(), h.clone()
    spread = (T, torch.empty((n, p), dtype=torch.float64)) if n <= kernel.MAX_ORDER else None
    assert torch.equal(kernel.cholesky(Gf, n, PIVOT_TOL, spread=spread, rhs=got), ok)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    with pytest.raises(ValueError, match="right-hand side"):
        kernel.cholesky(G.clone(), n, PIVOT_TOL, rhs=h[:, :-1].clone())


@needs_kernel
def test_fused_variances_refuse_what_they_cannot_take() -> None:
    G, _, T = _systems(17, 70, seed=3)
    with pytest.raises(ValueError, match="at most 16 columns"):
        kernel.cholesky(G, 17, PIVOT_TOL, spread=(None, torch.empty((17, 70)).double()))
    G, _, T = _systems(4, 70, seed=3)
    with pytest.raises(ValueError, match="at most 16 columns"):
        kernel.cholesky(G, 4, PIVOT_TOL, spread=(T, torch.empty((4, 69)).double()))
    with pytest.raises(ValueError, match="T must be"):
        kernel.cholesky(G, 4, PIVOT_TOL, spread=(T.T, torch.empty((4, 70)).double()))


@needs_kernel
def test_solve_matches_numpy() -> None:
    n, p = 6, 130
    G, h, _ = _systems(n, p, seed=1)
    r, c = lower_pairs(n)
    Gc = G.clone()
    ok = packed_cholesky(Gc, n)
    x = PackedFactor(Gc, n).solve_(h.clone())
    for px in torch.nonzero(ok).flatten().tolist():
        M = np.zeros((n, n))
        M[r.numpy(), c.numpy()] = G[:, px].numpy()
        M = M + np.tril(M, -1).T
        want = np.linalg.solve(M, h[:, px].numpy())
        np.testing.assert_allclose(x[:, px].numpy(), want, rtol=1e-10, atol=1e-12)


@needs_kernel
def test_threads_split_pixels_without_changing_a_bit() -> None:
    n, p = 10, 9000  # 1, 2 and 4 ranges of at least kernel.MIN_PART pixels
    G, h, T = _systems(n, p, seed=2)
    rng = np.random.default_rng(2)
    A, x0 = torch.from_numpy(rng.standard_normal((23, n))), torch.from_numpy(rng.random((n, p)))
    W = torch.from_numpy((rng.random((23, p)) > 0.2).astype(np.float64))
    B0 = torch.from_numpy(rng.standard_normal((23, p))) * W
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            assert len(kernel._parts(p)) == threads
            Gc = G.clone()
            ok = kernel.cholesky(Gc, n, PIVOT_TOL)
            x = kernel.solve_(Gc, n, h.clone())
            var, Z = kernel.spread(Gc, n, T, True)
            var_only, _ = kernel.spread(Gc, n, T, False)
            fused = torch.empty((n, p), dtype=torch.float64)
            kernel.cholesky(G.clone(), n, PIVOT_TOL, spread=(T, fused))
            assert Z is not None
            results.append([ok, Gc, x, var, Z, var_only, fused, *kernel.moments(A, B0, W, x0)])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a.isnan(), b.isnan())
            assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def _numpy_moments(A: np.ndarray, B0: np.ndarray, W: np.ndarray, x: np.ndarray) -> list[np.ndarray]:
    valid = W > 0
    R = np.where(valid, B0 - A @ x, 0.0)
    n = valid.sum(0)
    mean = (W * B0).sum(0) / W.sum(0)
    return [
        np.sqrt((R**2).sum(0) / n),
        np.sqrt((W * R**2).sum(0) / n),
        np.sqrt(np.where(valid, W * (B0 - mean) ** 2, 0.0).sum(0) / n),
        np.sqrt((W * B0**2).sum(0) / n),
    ]


@needs_kernel
@pytest.mark.parametrize("n", [1, 4, 10, 16])
@pytest.mark.parametrize("weighted", [False, True])
def test_residual_moments_match_numpy(n: int, weighted: bool) -> None:
    rng = np.random.default_rng(n)
    m, p = 37, 203  # an odd row count (rows go four at a time) and a ragged last group
    A = rng.standard_normal((m, n))
    valid = rng.random((m, p)) > 0.25
    W = np.where(valid, rng.random((m, p)) + 0.5 if weighted else 1.0, 0.0)
    B0 = np.where(valid, rng.standard_normal((m, p)) * 3 + 1, 0.0)
    x = rng.standard_normal((n, p))
    n_v = valid.sum(0).astype(np.float64)
    got = residual_moments(*map(torch.from_numpy, (A, B0, W, x, n_v)))
    assert got is not None
    for g, want in zip(got, _numpy_moments(A, B0, W, x), strict=True):
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-13)


@needs_kernel
def test_residual_moments_redo_extreme_columns() -> None:
    rng = np.random.default_rng(5)
    m, n, p = 20, 3, 40
    A = rng.standard_normal((m, n))
    W = np.ones((m, p))
    B0 = rng.standard_normal((m, p))
    B0[:, 4] *= 1e200  # squares overflow
    B0[:, 9] *= 1e-170  # squares underflow
    x = np.zeros((n, p))
    got = residual_moments(*map(torch.from_numpy, (A, B0, W, x, np.full(p, float(m)))))
    assert got is not None
    want = np.sqrt(np.mean((B0 / np.abs(B0).max(0)) ** 2, axis=0)) * np.abs(B0).max(0)
    np.testing.assert_allclose(got[0].numpy(), want, rtol=1e-13)
    np.testing.assert_allclose(got[3].numpy(), want, rtol=1e-13)
    assert np.isfinite(float(got[0][4])) and float(got[0][9]) > 0
    # centred only: the same residual and centred sums, redone alike; no other sums
    args = map(torch.from_numpy, (A, B0, W, x, np.full(p, float(m))))
    centred = residual_moments(*args, centred_only=True)
    assert centred is not None
    assert torch.equal(centred[0], got[0]) and torch.equal(centred[2], got[2])
    assert not centred[1].any() and not centred[3].any()


def test_orders_beyond_the_kernel_take_the_eager_path() -> None:
    m, n, p = 40, kernel.MAX_ORDER + 1, 10
    args = [torch.zeros(m, n, dtype=torch.float64), torch.zeros(m, p, dtype=torch.float64)]
    args += [torch.ones(m, p, dtype=torch.float64), torch.zeros(n, p, dtype=torch.float64)]
    assert residual_moments(*args, torch.full((p,), float(m))) is None


def _masked_cube(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.linspace(-1, 1, 30)
    A = np.vander(t, 6, increasing=True)
    B = (A @ rng.standard_normal((6, 700)) + 0.1 * rng.standard_normal((30, 700))).astype(
        np.float32
    )
    B[rng.random(B.shape) < 0.2] = np.nan
    B[:, :3] = np.nan  # all missing
    return A, B


def _run(
    A: np.ndarray, B: np.ndarray, config: LstsqSolve, per_pixel: int = 600
) -> dict[str, np.ndarray]:
    """The solve of ``B``, more than ``per_pixel`` of its pixels on the per-pixel path."""
    svd = np.linalg.svd(A, full_matrices=False)
    op = make_operator(A, np.ones(A.shape[0]), config, svd)
    out = solve_block(B, op, config, memory_budget=2**30)
    assert out.meta["paths"]["per_pixel"] > per_pixel
    return dict(out.arrays)


def _run_eager(
    A: np.ndarray,
    B: np.ndarray,
    config: LstsqSolve,
    monkeypatch: pytest.MonkeyPatch,
    per_pixel: int = 600,
) -> dict[str, np.ndarray]:
    """:func:`_run` on the eager path (the compiled library is back afterwards)."""
    monkeypatch.setenv(kernel.ENV, "eager")
    kernel._library.cache_clear()
    try:
        return _run(A, B, config, per_pixel)
    finally:
        monkeypatch.delenv(kernel.ENV)
        kernel._library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("uncertainty", ["none", "stderr", "cov"])
def test_solve_stage_agrees_with_the_eager_path_and_lstsq(
    uncertainty: str, monkeypatch: pytest.MonkeyPatch, calls: dict[str, int]
) -> None:
    A, B = _masked_cube(3)
    config = LstsqSolve(policy="minnorm", dtype="float64", uncertainty=uncertainty)
    compiled = _run(A, B, config)
    # unit weights, no covariance: the fused fit; the covariance: the separate passes
    ran = {"fit"} if uncertainty != "cov" else {"cholesky", "cholesky+rhs", "solve_", "moments"}
    ran |= {"load"} if uncertainty == "cov" else set()
    ran |= {"statistics"} if uncertainty == "stderr" else set()
    ran |= {"spread"} if uncertainty == "cov" else set()
    assert ran <= set(calls), calls  # the compiled path did run
    calls.clear()
    reference = _run_eager(A, B, config, monkeypatch)
    assert disagreements(compiled, reference) == []
    assert not calls  # and the reference did not
    C = compiled["coefficients"]
    for p in range(3, 700, 37):
        ok = np.isfinite(B[:, p])
        want = np.linalg.lstsq(A[ok], B[ok, p].astype(np.float64), rcond=None)[0]
        np.testing.assert_allclose(C[:, p], want, rtol=1e-10, atol=1e-12)
        r = B[ok, p] - A[ok] @ C[:, p]
        assert compiled["residual_rms"][p] == pytest.approx(np.sqrt(np.mean(r**2)), rel=1e-10)


@needs_kernel
@pytest.mark.parametrize("uncertainty", ["none", "stderr"])
def test_fused_fit_is_silent_about_pixels_without_data(uncertainty: str) -> None:
    """All-missing pixels share the fused fit's batches (computed, then dropped): no
    warning from them, even where warnings are errors."""
    A, B = _masked_cube(4)  # its first three pixels have no valid row
    config = LstsqSolve(policy="minnorm", dtype="float64", uncertainty=uncertainty)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _run(A, B, config)
    assert np.isnan(out["coefficients"][:, :3]).all()
    assert np.isfinite(out["coefficients"][:, 3:]).all()


@needs_kernel
@pytest.mark.parametrize("uncertainty", ["none", "stderr"])
def test_fused_fit_takes_gathered_batches(
    uncertainty: str, monkeypatch: pytest.MonkeyPatch, calls: dict[str, int]
) -> None:
    """A tile with few gappy pixels gathers them (numpy lays a gathered batch out column
    by column): the fused fit still takes it, and agrees with the eager path and lstsq."""
    rng = np.random.default_rng(8)
    t = np.linspace(-1, 1, 30)
    A = np.vander(t, 6, increasing=True)
    B = (A @ rng.standard_normal((6, 900)) + 0.1 * rng.standard_normal((30, 900))).astype(
        np.float32
    )
    gappy = rng.choice(900, 60, replace=False)
    for j in gappy:
        B[rng.choice(30, 7, replace=False), j] = np.nan
    config = LstsqSolve(policy="minnorm", dtype="float64", uncertainty=uncertainty)
    compiled = _run(A, B, config, per_pixel=59)
    assert calls.get("fit", 0) >= 1, calls
    reference = _run_eager(A, B, config, monkeypatch, per_pixel=59)
    assert disagreements(compiled, reference) == []
    for j in gappy[:20]:
        ok = np.isfinite(B[:, j])
        want = np.linalg.lstsq(A[ok], B[ok, j].astype(np.float64), rcond=None)[0]
        np.testing.assert_allclose(compiled["coefficients"][:, j], want, rtol=1e-10, atol=1e-12)


def test_eager_choice_builds_nothing(
    eager: None, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    from pathlib import Path

    monkeypatch.setenv(kernel.DIR_ENV, str(tmp_path))
    assert kernel.name() == "eager"
    assert not kernel.usable(torch.zeros(2, 2, dtype=torch.float64))
    assert not list(Path(str(tmp_path)).iterdir())


@needs_kernel
def test_no_pixels_is_no_work() -> None:
    G = torch.zeros(3, 0, dtype=torch.float64)
    assert kernel.cholesky(G, 2, PIVOT_TOL).shape == (0,)
    assert kernel.solve_(G, 2, torch.zeros(2, 0, dtype=torch.float64)).shape == (2, 0)


def test_missing_compiler_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv(kernel.DIR_ENV, str(tmp_path))
    kernel._library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C compiler found"):
            assert kernel.name() == "eager"
        # the eager path still solves
        A, B = _masked_cube(4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            out = _run(A, B, LstsqSolve(policy="minnorm", dtype="float64"))
        assert np.isfinite(out["coefficients"][:, 3:]).all()
        monkeypatch.setenv(kernel.ENV, "c")
        kernel._library.cache_clear()
        with pytest.raises(kernel.KernelUnavailable, match="Install a C compiler"):
            kernel.name()
    finally:
        monkeypatch.delenv("CC")
        monkeypatch.delenv(kernel.ENV, raising=False)
        kernel._library.cache_clear()


def test_a_wrong_choice_names_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel.ENV, "fast")
    with pytest.raises(ValueError, match="auto, c or eager"):
        kernel.choice()


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@needs_kernel
def test_a_fresh_directory_gets_a_fresh_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    from pathlib import Path

    where = Path(str(tmp_path)) / "kernels"
    monkeypatch.setenv(kernel.DIR_ENV, str(where))
    kernel._library.cache_clear()
    try:
        assert kernel.name() == "c"
        built = list(where.glob("gridsolve-solve-*.so"))
        assert len(built) == 1 and built[0].stat().st_size > 0
        assert not [p for p in where.iterdir() if p.is_dir()]  # no build leftovers
    finally:
        monkeypatch.delenv(kernel.DIR_ENV)
        kernel._library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("n", [1, 4, 11])
def test_square_factor_and_solve_agree_with_eager(n: int) -> None:
    """The square layout (the dual paths' k × k and obs × obs systems) against eager and numpy."""
    p = 150
    Gp, h, _ = _systems(n, p, seed=10 + n)
    r, c = lower_pairs(n)
    G = torch.zeros(n, n, p, dtype=torch.float64)
    G[r, c], G[c, r] = Gp, Gp
    got = {}
    for how in ("eager", "c"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(kernel.ENV, how)
            kernel._library.cache_clear()
            L, ok = batched_cholesky(G.clone())
            got[how] = (ok, torch.tril(L.permute(2, 0, 1)), cholesky_solve(L, h.clone()))
    kernel._library.cache_clear()
    assert torch.equal(got["eager"][0], got["c"][0])
    good = got["c"][0]
    for e, k in zip(got["eager"][1:], got["c"][1:], strict=True):
        e, k = e[good] if e.dim() == 3 else e[:, good], k[good] if k.dim() == 3 else k[:, good]
        assert float((e - k).abs().max()) <= 1e-12 * float(e.abs().max())
    for px in torch.nonzero(good).flatten().tolist()[:20]:
        want = np.linalg.solve(G[:, :, px].numpy(), h[:, px].numpy())
        np.testing.assert_allclose(got["c"][2][:, px].numpy(), want, rtol=1e-10, atol=1e-12)


@needs_kernel
def test_gapwise_dual_agrees_with_the_eager_path_and_lstsq(
    monkeypatch: pytest.MonkeyPatch, calls: dict[str, int]
) -> None:
    """coef > obs with gaps: the dual by gap groups (gs_gap_factor and gs_gap_solve)."""
    rng = np.random.default_rng(8)
    A = rng.standard_normal((30, 60))  # well-conditioned AAᵀ: the gap-wise dual takes it
    B = rng.standard_normal((30, 900)).astype(np.float32)
    B[rng.random(B.shape) < 0.2] = np.nan
    config = LstsqSolve(policy="minnorm", dtype="float64")
    compiled = _run(A, B, config)
    assert {"gap_factor", "gap_solve", "load"} <= set(calls), calls
    reference = _run_eager(A, B, config, monkeypatch)
    # A minimum-norm fit with coef > obs interpolates: its residual RMS is rounding noise
    # (≈ 1e-16), which no relative bound holds between two computations; both must be
    # that small against the data instead.
    scale = float(np.nanmax(np.abs(B)))
    for out in (compiled, reference):
        assert float(np.nanmax(out.pop("residual_rms"))) <= 1e-12 * scale
    assert disagreements(compiled, reference) == []
    for p in range(0, 900, 41):
        ok = np.isfinite(B[:, p])
        want = np.linalg.lstsq(A[ok], B[ok, p].astype(np.float64), rcond=None)[0]
        np.testing.assert_allclose(compiled["coefficients"][:, p], want, rtol=1e-9, atol=1e-12)


@needs_kernel
def test_gap_factor_is_the_gather_then_the_square_factor() -> None:
    """gs_gap_factor: torch's gather of H's submatrices, then gs_cholesky, bit for bit
    (failed pixels included: a repeated row makes a singular submatrix)."""
    rng = np.random.default_rng(12)
    m, k, n = 30, 7, 4500  # n: two threads' parts (2048 pixels at least), a partial block
    A = torch.from_numpy(rng.standard_normal((m, 2 * m)))
    H = torch.cholesky_inverse(torch.linalg.cholesky(A @ A.T)).contiguous()
    rows = torch.from_numpy(np.sort(rng.random((n, m)).argsort(axis=1)[:, :k], axis=1).T.copy())
    rows[1, 5] = rows[0, 5]  # singular: the pixel fails
    L, ok = kernel.gap_factor(H, rows, PIVOT_TOL)
    G = H[rows[:, None, :], rows[None, :, :]].contiguous()
    ok_ref = kernel.cholesky(G, k, PIVOT_TOL, square=True)
    assert torch.equal(ok, ok_ref) and not bool(ok[5]) and int(ok.sum()) == n - 1
    assert torch.equal(L.isnan(), G.isnan())
    assert torch.equal(L.nan_to_num(), G.nan_to_num())  # every entry, the failed pixel's too
    with pytest.raises(ValueError, match="rows must index H"):
        kernel.gap_factor(H, torch.full((k, 3), m, dtype=torch.int64), PIVOT_TOL)


@needs_kernel
@pytest.mark.parametrize("policy", ["minnorm", "ridge"])
@pytest.mark.parametrize("cov_scale", ["residual", "unscaled"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_statistics_equal_the_numpy_ones(
    policy: str, cov_scale: str, dtype: str, calls: dict[str, int]
) -> None:
    """The per-pixel path's statistics (gs_statistics) against uncertainty._statistics, bit for bit:
    both are the same correctly rounded IEEE operations."""
    from gridsolve.stages.solve import uncertainty

    rng = np.random.default_rng(11)
    coef, p = 4, 301
    config = LstsqSolve(
        policy=policy, dtype=dtype, uncertainty="stderr", cov_scale=cov_scale, ridge=0.1
    )
    C = rng.standard_normal((coef, p)).astype(dtype)
    C[1, 7] = np.nan  # not solved: a coefficient is not finite
    n_valid = rng.integers(3, 40, p).astype(np.int32)
    n_valid[:5] = coef  # no dof left
    status = np.zeros(p, dtype=np.int8)
    status[10:20] = FELL_BACK_RIDGE
    status[20:25] = FELL_BACK_MINNORM
    status[25:30] = SINGULAR
    wrms, trms = rng.random(p) + 0.1, rng.random(p) + 0.5
    var = rng.random((coef, p))
    var[2, 40:45] = np.nan  # not identifiable
    edf = np.full(p, float(coef))
    edf[50:60] += rng.uniform(-1e-7, 1e-7, 10)  # rounding of the effective rank
    edf[60:70] = coef - rng.random(10)  # a ridge-shrunk rank
    want = uncertainty._statistics(C, n_valid, status, wrms, trms, var, edf, None, config)
    for idx in (slice(0, p), np.arange(p)):
        mom = uncertainty._Moments(coef, p, config)
        mom.put(idx, C, n_valid, status, wrms, trms, var, edf, None)
        assert mom.done.all()
        for name, values in want.items():
            np.testing.assert_array_equal(mom.out[name], values, err_msg=name)
            assert mom.out[name].dtype == values.dtype
    assert calls.get("statistics") == 2  # the kernel made them, both times


@needs_kernel
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_load_equals_torch_conversion(dtype: type) -> None:
    """gs_load: float64 with NaN and ±inf as 0, from a column slice, as torch converts."""
    rng = np.random.default_rng(12)
    B = rng.standard_normal((23, 500)).astype(dtype)
    B[rng.random(B.shape) < 0.2] = np.nan
    B[3, 7], B[4, 8] = np.inf, -np.inf
    B[5, 9] = np.finfo(dtype).max
    view = B[:, 37:411]
    got = kernel.load(view, finite=True)
    assert got is not None and got[1] is not None
    want = torch.from_numpy(view).to(torch.float64, copy=True).nan_to_num_(0.0, 0.0, 0.0)
    assert torch.equal(got[0], want)
    assert torch.equal(got[1], torch.from_numpy(np.isfinite(view).astype(np.float64)))
    alone = kernel.load(view)
    assert alone is not None and alone[1] is None and torch.equal(alone[0], want)
    assert kernel.load(B[:, ::2]) is None  # rows not contiguous: the caller converts


@needs_kernel
def test_residual_without_moments_equals_the_full_sums() -> None:
    rng = np.random.default_rng(13)
    m, n, p = 29, 7, 77
    A, x = rng.standard_normal((m, n)), rng.standard_normal((n, p))
    W = (rng.random((m, p)) > 0.3).astype(np.float64)
    B0 = rng.standard_normal((m, p)) * W
    args = [torch.from_numpy(a) for a in (A, B0, W, x)]
    full = kernel.moments(*args)
    short = kernel.moments(*args, full=False)
    assert torch.equal(full[0], short[0])
    assert all(bool((s == 0).all()) for s in short[1:])
    centred = kernel.moments(*args, centred_only=True)
    assert torch.equal(full[0], centred[0]) and torch.equal(full[2], centred[2])
    assert not centred[1].any() and not centred[3].any()


@needs_kernel
def test_refinement_step_equals_the_eager_one(calls: dict[str, int]) -> None:
    """gs_step: the same additions as _step's, the same convergence flags, for one pair
    and for two."""
    rng = np.random.default_rng(14)
    n, p = 7, 700
    x0 = torch.from_numpy(rng.standard_normal((n, p)))
    dx = torch.from_numpy(rng.standard_normal((n, p)) * 10.0 ** rng.integers(-16, -8, p))
    x0[2, 5], dx[3, 6], x0[1, 7], dx[0, 8] = np.nan, np.nan, np.inf, np.inf
    ok = torch.from_numpy(rng.random(p) > 0.1)
    got, want = [], []
    for use_kernel, out in ((True, got), (False, want)):
        with pytest.MonkeyPatch.context() as mp:
            if not use_kernel:
                mp.setattr(kernel, "usable", lambda *t: False)
            x = x0.clone()
            conv, (x,) = _step(ok, None, (x, dx.clone()))
            first = (conv.clone(), x.clone())
            conv, (x,) = _step(ok, conv, (x, dx * 1e-6))
            out.extend([*first, conv, x])
            # two pairs (the dual's coefficients and α): flags from the first, the same
            # pixels corrected in the second
            x, a = x0.clone(), x0[:3].clone() * 2.0
            conv, (x, a) = _step(ok, None, (x, dx.clone()), (a, dx[:3].clone()))
            first = (conv.clone(), x.clone(), a.clone())
            conv, (x, a) = _step(ok, conv, (x, dx * 1e-6), (a, dx[3:6] * 1e-3))
            out.extend([*first, conv, x, a])
    assert calls.get("step") == 6
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.isnan(), w.isnan()) if g.is_floating_point() else True
        assert (
            torch.equal(torch.nan_to_num(g), torch.nan_to_num(w))
            if g.is_floating_point()
            else torch.equal(g, w)
        )
    assert bool(got[0].any()) and not bool(got[0].all())  # some converged, some not


@needs_kernel
def test_every_vector_version_gives_the_same_bits() -> None:
    """The register kernels' AVX-512, AVX2 and SSE2 versions (an AMD or older CPU runs
    another one than this machine): the same lanes of the same operations, so the same bits."""
    rng = np.random.default_rng(15)
    n, m, p = 10, 37, 203  # a ragged last group for every lane count
    A, x = torch.from_numpy(rng.standard_normal((m, n))), torch.from_numpy(rng.random((n, p)))
    W = torch.from_numpy((rng.random((m, p)) > 0.2) * (rng.random((m, p)) + 0.5))
    B0 = torch.from_numpy(rng.standard_normal((m, p))) * (W > 0)
    G, _, T = _systems(n, p, seed=15)
    kernel.cholesky(G, n, PIVOT_TOL)
    # the fused fit: float32 data with gaps, a polynomial design in its orthonormal basis
    tf, src = _fit_data(m, p, np.float32, seed=15)
    src[:, 0] = np.nan  # pixels that are not good are compared too
    src[n - 2 :, 1] = np.nan
    Af = torch.from_numpy(np.ascontiguousarray(np.polynomial.chebyshev.chebvander(tf, n - 1)))
    setup = _primal_setup(Af, 0.0)
    assert setup.Rinv is not None
    Qf, pairs, Rinv = setup.basis.contiguous(), setup.pairs, setup.Rinv.contiguous()
    best = kernel.use_isa(3)
    if best < 2:
        pytest.skip("this CPU has SSE2 only: one vector version, nothing to compare")
    results = {}
    try:
        for isa in range(1, best + 1):
            assert kernel.use_isa(isa) == isa
            var, _ = kernel.spread(G, n, T, False)
            centred = kernel.moments(A, B0, W, x, centred_only=True)
            fit = kernel.fit(src, Qf, pairs, Af, Rinv, PIVOT_TOL, 1e-11, 2, True)
            results[isa] = [var, *kernel.moments(A, B0, W, x), *centred, *fit]
    finally:
        kernel.use_isa(3)
    assert len(results) == best >= 2  # SSE2 and AVX2, and AVX-512 where the CPU has it
    for isa, got in results.items():
        for a, b in zip(got, results[1], strict=True):
            if not a.is_floating_point():  # the fused fit's flags
                assert torch.equal(a, b) and bool(a.any()) and not bool(a[0]), isa
                continue
            assert torch.equal(a.isnan(), b.isnan()), isa
            assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), isa


def _fit_data(m: int, p: int, dtype: type, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A design (m, 6 columns of a polynomial) and data with NaN, ±inf and a strided layout."""
    rng = np.random.default_rng(seed)
    t = np.linspace(-1, 1, m)
    big = rng.standard_normal((m, p + 9)) + 3.0
    big[rng.random(big.shape) < 0.2] = np.nan
    big[rng.random(big.shape) < 0.02] = np.inf
    big[rng.random(big.shape) < 0.02] = -np.inf
    return t, big.astype(dtype)[:, 5 : 5 + p]  # a column slice: rows `p + 9` apart


@needs_kernel
@pytest.mark.parametrize("n", [1, 3, 10, 16])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_fit_agrees_with_the_separate_passes_and_lstsq(n: int, dtype: type) -> None:
    """kernel.fit (every step of a unit-weight primal fit in one pass) against the separate
    kernels' _primal, numpy's lstsq per pixel, and, bit for bit, the moments kernel on its
    own coefficients (the same arithmetic)."""
    m, p = 40, 203  # a ragged last group for every lane count
    t, src = _fit_data(m, p, dtype, seed=n)
    A = torch.from_numpy(np.ascontiguousarray(np.polynomial.chebyshev.chebvander(t, n - 1)))
    setup = _primal_setup(A, 0.0)
    assert setup.Rinv is not None
    x, good, ss, var, tss = kernel.fit(
        src, setup.basis.contiguous(), setup.pairs, A, setup.Rinv.contiguous(),
        PIVOT_TOL, REFINE_TOL, REFINE_STEPS, True,
    )  # fmt: skip
    assert var is not None and tss is not None
    loaded = kernel.load(src, True)
    assert loaded is not None and loaded[1] is not None
    B0, W = loaded
    xe, conv, (L, _) = _primal(A, B0, W, 0.0, True, True)
    assert torch.equal(good, conv) and bool(good.all())
    np.testing.assert_allclose(x.numpy(), xe.numpy(), rtol=1e-11, atol=1e-12)
    assert L.var is not None
    np.testing.assert_allclose(var.numpy(), L.var.numpy(), rtol=1e-11)
    sums = kernel.moments(A, B0, W, x, centred_only=True)
    assert torch.equal(ss, sums[0]) and torch.equal(tss, sums[2])
    for j in range(0, p, 17):
        ok = np.isfinite(src[:, j])
        want = np.linalg.lstsq(A.numpy()[ok], src[ok, j].astype(np.float64), rcond=None)[0]
        np.testing.assert_allclose(x[:, j].numpy(), want, rtol=1e-10, atol=1e-12)
        r = src[ok, j] - A.numpy()[ok] @ x[:, j].numpy()
        assert float(ss[j]) == pytest.approx(float(r @ r), rel=1e-9)


@needs_kernel
def test_fused_fit_without_a_change_of_basis_and_with_singular_pixels() -> None:
    """``Rinv`` None (the design itself as the basis); a pixel with fewer valid rows than
    coefficients, or none, is not good; the others match lstsq."""
    m, n, p = 25, 4, 70
    t, src = _fit_data(m, p, np.float64, seed=3)
    src[:, 0] = np.nan
    src[3:, 1] = np.nan  # 3 rows for 4 coefficients
    A = torch.from_numpy(np.vander(t, n, increasing=True))
    r, c = lower_pairs(n)
    pairs = (A[:, r] * A[:, c]).T.contiguous()
    args = (PIVOT_TOL, REFINE_TOL, REFINE_STEPS, False)
    x, good, ss, var, tss = kernel.fit(src, A, pairs, A, None, *args)
    assert var is None and tss is None
    # no valid row: no pivot passes (the 3-row pixel's last pivot may pass by rounding:
    # fit_unit's rule sends it to the SVD, below)
    assert not bool(good[0]) and bool(good[2:].all())
    nv = torch.from_numpy(np.isfinite(src).sum(0).astype(np.float64))
    pol = Policy("minnorm")
    active = nv >= 1
    fit = linalg.fit_unit(A, src, pol, nv, active, False)
    assert fit is not None
    xf, status = fit[0], fit[1]
    # 3 rows for 4 coefficients: the minimum-norm fit, underdetermined
    assert int(status[1]) == UNDERDETERMINED
    assert bool((status[2:] == OK).all())
    ok = np.isfinite(src[:, 1])
    want = np.linalg.lstsq(A.numpy()[ok], src[ok, 1], rcond=None)[0]  # the minimum norm
    np.testing.assert_allclose(xf[:, 1].numpy(), want, rtol=1e-10, atol=1e-12)
    for j in range(2, p, 7):
        ok = np.isfinite(src[:, j])
        want = np.linalg.lstsq(A.numpy()[ok], src[ok, j], rcond=None)[0]
        np.testing.assert_allclose(x[:, j].numpy(), want, rtol=1e-10, atol=1e-12)
        r = src[ok, j] - A.numpy()[ok] @ want
        assert float(ss[j]) == pytest.approx(float(r @ r), rel=1e-9)


@needs_kernel
def test_fused_fit_refuses_what_it_cannot_read() -> None:
    A = torch.from_numpy(np.vander(np.linspace(-1, 1, 8), 3, increasing=True))
    r, c = lower_pairs(3)
    pairs = (A[:, r] * A[:, c]).T.contiguous()
    args = (PIVOT_TOL, REFINE_TOL, 2, False)
    good_src = np.ones((8, 5))
    with pytest.raises(ValueError, match="rows must each be contiguous"):
        kernel.fit(np.ones((5, 8)).T, A, pairs, A, None, *args)
    with pytest.raises(ValueError, match="float32 or float64"):
        kernel.fit(np.ones((8, 5), dtype=np.int32), A, pairs, A, None, *args)
    with pytest.raises(ValueError, match="contiguous float64"):
        kernel.fit(good_src, A, pairs[:, :4], A, None, *args)
    with pytest.raises(ValueError, match="contiguous float64"):
        kernel.fit(good_src, A, pairs, A, torch.eye(2, dtype=torch.float64), *args)


@needs_kernel
def test_fused_fit_does_not_depend_on_the_threads() -> None:
    """Split over threads (ranges of whole 64-pixel blocks) or not, each pixel's bits."""
    m, n, p = 30, 6, 3 * kernel.MIN_PART + 37
    t, src = _fit_data(m, p, np.float32, seed=21)
    A = torch.from_numpy(np.vander(t, n, increasing=True))
    setup = _primal_setup(A, 0.0)
    assert setup.Rinv is not None
    args = (setup.basis.contiguous(), setup.pairs, A, setup.Rinv.contiguous())
    tol = (PIVOT_TOL, REFINE_TOL, REFINE_STEPS, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.fit(src, *args, *tol)
        torch.set_num_threads(max(2, threads))
        assert len(kernel._parts(p)) >= 2
        many = kernel.fit(src, *args, *tol)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, many, strict=True):
        assert a is not None and b is not None
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) and torch.equal(
            a.isnan(), b.isnan()
        )
