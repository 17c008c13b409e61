"""The ``curvefit`` solve: nonlinear least squares of the user's single-sample f(t, p), per pixel.

Once per stage (``prepare``) the function the config names is imported (a
function, or an ``nn.Module`` class built with ``kwargs``) and checked on one
pixel and on a batch of two under ``vmap`` (the way every tile calls it), and
the observation coordinate ``t``, the start ``p0`` and the bounds are stored.
Per tile, the pixels are fitted in chunks under the memory budget by
:func:`fit_pixels` (batched Levenberg–Marquardt, see
:mod:`stages.solve.levmar`), honouring each pixel's gaps (NaN) and weights.
A pixel is ``converged`` only where a convergence test held; every other
outcome has its own status code (``levmar_status.FIT_STATUS_FLAGS``).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.errors import ConfigError, ContractError
from gridsolve.schemas.kinds.solve import CurvefitSolve
from gridsolve.schemas.metadata import LoadMeta
from gridsolve.stages.design.builtin import obs_axis, stored_time
from gridsolve.stages.engine.blocks import read_block
from gridsolve.stages.engine.context import StageContext, chunk_size, resolve_device, work_share
from gridsolve.stages.engine.paths import import_named
from gridsolve.stages.engine.store import Artifact, StageOutput
from gridsolve.stages.engine.timing import torch_func_ready
from gridsolve.stages.solve.levmar import Batch, begin, default_max_iter, join
from gridsolve.stages.solve.levmar_compiled import COMPILE_MIN_PIXELS, compiled_jacobians
from gridsolve.stages.solve.levmar_problem import Rows, problem
from gridsolve.stages.solve.levmar_status import FIT_STATUS_FLAGS

STAGE = "solve/curvefit"

_log = logging.getLogger("gridsolve.solve")

#: torch's forward-mode AD levels (jacfwd) are process-global: two tiles fitted at once
#: on threads (the flow's default runner) fail with "invalid forward AD level"; a tile
#: uses every core through torch's own threads anyway.
_FIT_LOCK = threading.Lock()

#: Most pixels fitted at once. A chunk's temporaries (pixel × obs × param float64) then
#: stay in memory already mapped: on 100,000 pixels of a 4-parameter double logistic
#: (benchmarks/bench_curvefit.py's cube, AMD EPYC, 2 cores) chunks of 8,192 and 16,384
#: pixels took 5.2–6.0 s, 25,000 took 10 s and one chunk of 100,000 took 13 s (the
#: fresh memory of each pass cost more than its arithmetic); 2,048 paid the per-pass
#: Python overhead instead (measured before slow pixels were pooled across chunks).
CHUNK_PIXELS = 8192

#: A chunk iterates until fewer than this share of the pixels it started running still run;
#: those are set aside and go on later, pooled with other chunks' slow pixels (fit_pixels). A
#: loop pass costs about the same fixed 10 ms (a hundred small torch calls) whether it moves
#: 8,192 pixels or one, and a chunk's slowest pixel takes 20-30 passes where most stop
#: within 5 (on 250,000 pixels, 31 chunks: 266 trial-step calls per 100,000 pixels
#: unpooled, 88-100 pooled; with the trimmed LM step, the fit went from 17.2 s to 12.4-13 s).
POOL_BELOW = 0.5

#: How to write f so that it batches (what a failing probe tells the user).
_HOW = (
    "write f(t, p) for ONE pixel with torch operations on t (obs,) and p (param,), "
    "returning (obs,): no .item(), no numpy, no Python branches on values, no in-place "
    "changes of t or p"
)


def target_object(config: CurvefitSolve) -> Any:
    """What ``target`` names, imported: a function or a class (ConfigError if neither)."""
    obj = import_named(config.target, STAGE, "solve.target")
    if not callable(obj):
        raise ConfigError(
            f"solve.target {config.target!r} is not a function or an nn.Module class",
            stage=STAGE,
            found=repr(obj),
            fix="point solve.target at a function f(t, p) or an nn.Module class",
        )
    return obj


def import_function(
    config: CurvefitSolve, device: torch.device | None = None
) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """The callable ``target`` names: the function itself, or an instance of the module class.

    A module is built with the torch seed 0 (a constructor that draws random numbers
    builds the same function in every tile and process), in float64, on ``device``.
    """
    obj = target_object(config)
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                built = obj(**config.kwargs)
        except Exception as exc:
            raise ConfigError(
                f"cannot build {config.target} with solve.kwargs {config.kwargs}",
                stage=STAGE,
                found=f"{type(exc).__name__}: {exc}",
                fix="give the constructor's keyword arguments in solve.kwargs",
            ) from exc
        fn: Callable[[torch.Tensor, torch.Tensor], Any] = built.to(
            device=device, dtype=torch.float64
        ).eval()
        return fn
    if config.kwargs:
        raise ConfigError(
            f"solve.kwargs is given but {config.target} is not an nn.Module class",
            stage=STAGE,
            fix="remove solve.kwargs (a function takes only t and p)",
        )
    if isinstance(obj, type):
        raise ConfigError(
            f"solve.target {config.target!r} is a class but not an nn.Module",
            stage=STAGE,
            found=repr(obj),
            fix="point solve.target at a function f(t, p) or an nn.Module class",
        )
    return obj  # type: ignore[no-any-return]


def observation_axis(config: CurvefitSolve, load: Artifact) -> np.ndarray:
    """The ``t`` f receives: the coordinate, since its first value, or the index (float64)."""
    meta = LoadMeta.of(load)
    if config.t == "index":
        return np.arange(meta.n_obs, dtype=np.float64)
    try:
        axis, _ = obs_axis(np.asarray(load.array("obs")), STAGE, stored_time(meta))
    except ContractError as err:  # its advice is a design's: curvefit has another way
        raise ContractError(
            f"solve.t: {config.t} needs a numeric or datetime observation coordinate in "
            "days, hours, minutes or seconds",
            stage=STAGE,
            found=err.found or err.problem,
            fix="set solve.t: index (0, 1, 2, … per observation), or store the coordinate "
            "as numbers or CF times in days since a date",
        ) from err
    return axis - axis[0] if config.t == "since_first" else axis


def _probe(f: Callable[..., Any], t: torch.Tensor, p0: torch.Tensor) -> None:
    """Refuse an f that does not give (obs,) values for one pixel, the same under vmap.

    NaN is allowed here: where f is not finite at an observed t the fit flags the pixel
    (``model_not_finite``), which is a fact about the data's pixel, not a broken f.
    """
    try:
        one = f(t, p0)
        both = torch.func.vmap(f, in_dims=(None, 0))(t, torch.stack([p0, p0]))
    except Exception as exc:
        raise ConfigError(
            "solve.target fails on one pixel at p0, or under vmap over pixels",
            stage=STAGE,
            found=f"{type(exc).__name__}: {exc}",
            fix=_HOW,
        ) from exc
    want = tuple(t.shape[:1])
    if not isinstance(one, torch.Tensor) or tuple(one.shape) != want:
        found = tuple(one.shape) if isinstance(one, torch.Tensor) else type(one).__name__
        raise ContractError(
            "solve.target does not return one value per observation",
            stage=STAGE,
            expected=f"a tensor of shape {want}",
            found=str(found),
            fix=_HOW,
        )
    same = tuple(both.shape) == (2, *want) and all(
        torch.allclose(b, one, rtol=0.0, atol=0.0, equal_nan=True) for b in both
    )
    if not same:
        raise ContractError(
            "solve.target gives a different result under vmap than on one pixel",
            stage=STAGE,
            found=f"shape {tuple(both.shape)} for two pixels",
            fix=_HOW,
        )


def check_function(config: CurvefitSolve, n_obs: int = 8) -> None:
    """Import ``target`` and try it at ``p0`` on a made-up axis (``gridsolve validate``)."""
    t = torch.linspace(0.0, 1.0, n_obs, dtype=torch.float64)
    p0 = torch.tensor([config.p0[n] for n in config.params], dtype=torch.float64)
    _probe(import_function(config), t, p0)


def prepare(
    config: CurvefitSolve, inputs: Mapping[str, Artifact], ctx: StageContext
) -> StageOutput:
    """Check f on one pixel and under vmap; store t, the start, the bounds and shared weights."""
    torch_func_ready()
    load = inputs["load"]
    t = observation_axis(config, load)
    p0 = np.array([config.p0[n] for n in config.params], dtype=np.float64)
    f = import_function(config)
    _probe(f, torch.from_numpy(t), torch.from_numpy(p0))
    lower, upper = config.bounds_arrays()
    arrays = {
        "t": t,
        "p0": p0,
        "lower": np.array(lower, dtype=np.float64),
        "upper": np.array(upper, dtype=np.float64),
    }
    if "weights" in load:  # one set of weights shared by every pixel
        arrays["weights"] = np.asarray(load.array("weights"), dtype=np.float64)
    return StageOutput(
        arrays=arrays,
        meta={
            "coef": len(config.params),
            "obs": int(t.shape[0]),
            "params": list(config.params),
            "uncertainty": "cov" if config.covariance else "stderr",
            "cov_scale": config.cov_scale,
            "status_flags": dict(FIT_STATUS_FLAGS),
            "dim_labels": {"param": list(config.params)},
            "target": config.target,
            "t": config.t,
        },
    )


def pixel_bytes_of(n_obs: int, n_param: int, covariance: bool) -> int:
    """Bytes one pixel holds while fitted: data, mask, residuals, Jacobian, QR, results."""
    work = 8 * (6 * n_obs + 3 * n_obs * n_param + 4 * n_param * n_param + 12 * n_param + 16)
    return work + (8 * n_param * n_param if covariance else 0)


def run_tile(
    config: CurvefitSolve,
    inputs: Mapping[str, Artifact],
    prepared: Artifact,
    tile: Tile,
    ctx: StageContext,
) -> StageOutput:
    """Parameters, their standard errors, cost, iterations, RMS, counts and status of one tile."""
    torch_func_ready()
    load = inputs["load"]
    load_meta = LoadMeta.of(load)
    device = resolve_device(config.device)
    t = torch.from_numpy(np.array(prepared.array("t"))).to(device)
    p0 = torch.from_numpy(np.array(prepared.array("p0"))).to(device)
    bounds = (
        torch.from_numpy(np.array(prepared.array("lower"))).to(device),
        torch.from_numpy(np.array(prepared.array("upper"))).to(device),
    )
    n_obs = int(t.shape[0])
    B = read_block(load, "cube", tile).reshape(n_obs, -1).T  # (pixel, obs)
    weights_info = load_meta.aux.get("weights")
    own_w = None
    if weights_info is not None and not weights_info.shared:
        own_w = read_block(load, "weights", tile).reshape(n_obs, -1).T
    shared_w = np.array(prepared.array("weights")) if "weights" in prepared else None
    fitted = fit_pixels(
        import_function(config, device),
        t,
        B,
        p0,
        config,
        bounds=bounds,
        weights=own_w if own_w is not None else shared_w,
        memory_budget=ctx.memory_budget,
        grid_pixels=int(np.prod(load_meta.grid_shape())),
        compile_key=f"{prepared.key}:{device}",
    )
    return _tile_output(fitted, config, tile.shape)


def fit_pixels(
    f: Callable[..., Any],
    t: torch.Tensor,
    B: np.ndarray,
    p0: torch.Tensor,
    config: CurvefitSolve,
    *,
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    weights: np.ndarray | None = None,
    memory_budget: int = 2**30,
    grid_pixels: int | None = None,
    compile_key: str | None = None,
) -> dict[str, np.ndarray]:
    """Fit ``f`` to every row of ``B`` (pixel, obs): :class:`LMResult` arrays, pixel first.

    ``weights`` (pixel, obs) per pixel or (obs,) shared; ``bounds`` (lower, upper) per
    parameter, ±inf where open. ``config.compile``: whether the Jacobian is compiled
    (:mod:`.levmar_compiled`; ``auto`` decides by ``grid_pixels``, default the rows of
    ``B``), once per process for ``compile_key`` (what ``f``, ``t``, ``p0`` and the
    bounds are; default: this ``f`` object and those values). Chunks hold at most
    ``CHUNK_PIXELS`` pixels (or ``config.chunk_pixels``) and fit the memory budget. A
    chunk iterates until fewer than ``POOL_BELOW`` of the pixels it started running still
    run; those are set aside and go on from where they stopped, pooled with those of
    other chunks, a chunk's worth at a time: every pixel iterates on its own, so its
    path is the same (up to the last bits, see ``fit_batched``), and the slow pixels'
    passes are paid once per pool, not once per chunk. At most about two chunks' worth
    of pixels wait at a time. A tile of one chunk is one batch, run to the end.
    """
    n_pix, n_obs, n_param = B.shape[0], int(t.shape[0]), int(p0.shape[0])
    device = t.device
    if bounds is not None and not bool(
        torch.isfinite(bounds[0]).any() or torch.isfinite(bounds[1]).any()
    ):
        bounds = None
    per_px = pixel_bytes_of(n_obs, n_param, config.covariance)
    step = config.chunk_pixels or min(CHUNK_PIXELS, chunk_size(work_share(memory_budget), per_px))
    limit = config.max_iter or default_max_iter(n_param)
    fits = _Fits(n_pix, step, config.cov_scale == "unscaled")
    if n_pix == 0:  # arrays of no pixels, shaped as the fit's
        with _FIT_LOCK:
            empty = torch.empty((0, n_obs), dtype=torch.float64, device=device)
            return begin(f, t, empty, p0, bounds=bounds).finish(fits.absolute).arrays()
    # compiled for whole chunks (every tile of the stage shares one compile; a smaller
    # tile's batches are padded)
    jacobians = _compiled(f, t, p0, bounds, config, step, grid_pixels or n_pix, compile_key)
    pool_below = POOL_BELOW if n_pix > step else 0.0  # one chunk: one batch to the end
    for lo in range(0, n_pix, step):
        rows = np.arange(lo, min(lo + step, n_pix))
        b = torch.from_numpy(np.ascontiguousarray(B[rows], dtype=np.float64))
        w = None
        if weights is not None:
            w_rows = weights if weights.ndim == 1 else weights[rows]
            w = torch.from_numpy(np.ascontiguousarray(w_rows, dtype=np.float64)).to(device)
        with _FIT_LOCK:
            batch = begin(
                f,
                t,
                b.to(device),
                p0,
                weights=w,
                bounds=bounds,
                max_iter=limit,
                xtol=config.xtol,
                ftol=config.ftol,
                gtol=config.gtol,
                jacobians=jacobians,
            )
        fits.settle(rows, batch, pool_below)
        while fits.waiting() >= step:
            fits.pool(pool_below)
    while fits.pending:
        fits.pool(0.0 if fits.waiting() <= step else pool_below)
    return fits.out


def _compiled(
    f: Callable[..., Any],
    t: torch.Tensor,
    p0: torch.Tensor,
    bounds: tuple[torch.Tensor, torch.Tensor] | None,
    config: CurvefitSolve,
    rows: int,
    grid_pixels: int,
    key: str | None,
) -> tuple[Rows, Rows] | None:
    """The compiled (∂f/∂u, ∂f/∂p) for chunks of ``rows`` pixels, or None (run eager).

    None unless ``config.compile`` asks for them, they compile and they agree with eager.
    """
    if config.compile == "never" or (config.compile == "auto" and grid_pixels < COMPILE_MIN_PIXELS):
        return None
    owner: object = None
    if key is None:  # this very function object, at these values
        owner = f
        digest = hashlib.sha256()
        for x in (t, p0, *(bounds or ())):
            digest.update(f"{tuple(x.shape)}{x.dtype}".encode())
            digest.update(x.detach().cpu().numpy().tobytes())
        key = f"{id(f)}:{digest.hexdigest()[:16]}:{t.device}"
    with _FIT_LOCK:
        one = torch.zeros((1, int(t.shape[0])), dtype=torch.float64, device=t.device)
        prob, u0 = problem(f, t, one, p0, None, None, bounds, "auto")
        # checked at the start and, in half the rows, at points around it (seeded)
        gen = torch.Generator().manual_seed(0)
        nudge = 1e-3 * torch.randn((rows, u0.shape[-1]), generator=gen, dtype=torch.float64)
        nudge[: rows // 2 + 1] = 0.0
        example = u0 + nudge.to(u0.device) * torch.clamp(u0.abs(), min=1.0)
        example_p = example if prob.box is None else prob.box.to_external(example)
        return compiled_jacobians(
            f"{key}:{rows}", owner, prob.jacobian, prob.jacobian_p, example, example_p, _log
        )


class _Fits:
    """A tile's fit in progress (see :func:`fit_pixels`).

    ``out``: the results of the pixels that stopped, by row of the tile;
    ``pending``: the batches of pixels set aside, still running.
    """

    def __init__(self, n_pix: int, step: int, absolute: bool) -> None:
        self.n_pix, self.step, self.absolute = n_pix, step, absolute
        self.out: dict[str, np.ndarray] = {}
        self.pending: list[tuple[np.ndarray, Batch]] = []  # (rows, their batch) still running

    def settle(self, rows: np.ndarray, batch: Batch, until_below: float) -> None:
        """Iterate ``batch``; store the pixels that stopped, set the others aside."""
        with _FIT_LOCK:
            batch.advance(until_below)
            running = batch.running()
            stopped = torch.nonzero(~running).flatten()
            if stopped.numel():
                part = batch if stopped.numel() == len(batch) else batch.take(stopped)
                at = rows[stopped.cpu().numpy()]
                for name, values in part.finish(self.absolute).arrays().items():
                    if name not in self.out:
                        self.out[name] = np.empty((self.n_pix, *values.shape[1:]), values.dtype)
                    self.out[name][at] = values
            slow = torch.nonzero(running).flatten()
            if slow.numel():
                self.pending.append((rows[slow.cpu().numpy()], batch.take(slow)))

    def waiting(self) -> int:
        """Pixels set aside, still running."""
        return sum(len(batch) for _, batch in self.pending)

    def pool(self, until_below: float) -> None:
        """The oldest waiting pixels, at most a chunk of them, iterated together."""
        group = [self.pending.pop(0)]
        size = len(group[0][1])
        while self.pending and size + len(self.pending[0][1]) <= self.step:
            group.append(self.pending.pop(0))
            size += len(group[-1][1])
        rows = np.concatenate([r for r, _ in group])
        self.settle(rows, join([batch for _, batch in group]), until_below)


def _tile_output(
    fitted: dict[str, np.ndarray], config: CurvefitSolve, shape: tuple[int, int]
) -> StageOutput:
    """The tile's arrays, pixels last as (…, y, x), in the config's dtype; status counts."""
    ny, nx = shape
    dtype = np.dtype(config.dtype)

    def grid(a: np.ndarray, as_type: Any) -> np.ndarray:
        moved = np.moveaxis(a, 0, -1).astype(as_type, copy=False)
        return np.ascontiguousarray(moved.reshape(*moved.shape[:-1], ny, nx))

    status = fitted["status"].astype(np.int8)
    arrays = {
        "params": grid(fitted["params"], dtype),
        "param_stderr": grid(fitted["param_stderr"], dtype),
        "cost": grid(fitted["cost"], dtype),
        "n_iter": grid(fitted["n_iter"], np.int32),
        "residual_rms": grid(fitted["residual_rms"], dtype),
        "n_valid": grid(fitted["n_valid"], np.int32),
        "status": grid(status, np.int8),
    }
    if config.covariance:
        arrays["param_cov"] = grid(fitted["covariance"], dtype)
    codes, counts = np.unique(status, return_counts=True)
    counted = {FIT_STATUS_FLAGS[int(c)]: int(n) for c, n in zip(codes, counts, strict=True)}
    return StageOutput(arrays=arrays, meta={"status_counts": counted})
