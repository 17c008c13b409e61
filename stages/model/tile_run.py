"""Running one tile: its pixels, the kernel to run them with, the chunks, and the outputs."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.contracts import MODEL_STATUS_CODES, MODEL_STATUS_FLAGS, flag_counts
from gridsolve.schemas.errors import first_line
from gridsolve.schemas.kinds.model import ModelConfig
from gridsolve.schemas.metadata import LoadMeta, ModelPrepared
from gridsolve.stages.engine.blocks import read_block
from gridsolve.stages.engine.context import StageContext, chunk_size, resolve_device, work_share
from gridsolve.stages.engine.store import Artifact, StageOutput
from gridsolve.stages.model.building import (
    build_module,
)
from gridsolve.stages.model.chunk_kernel import Kernel, make_kernel
from gridsolve.stages.model.compiled import (
    CHUNK_BYTES,
    CHUNK_BYTES_COMPILED,
    COMPILE_CHECK_PIXELS,
    COMPILE_MIN_PIXELS,
    _as_tensor,
    _finite_pixels,
    _forget_compiled,
    _pixels_dynamic,
    compiled_kernel,
)
from gridsolve.stages.model.per_sample import ClosedForm, Write, _closed_form


def _tensors(
    prepared: Artifact, prefix: str, names: Mapping[str, Any], device: torch.device
) -> dict[str, torch.Tensor]:
    return {
        k: torch.from_numpy(np.array(prepared.array(f"{prefix}:{k}"))).to(device) for k in names
    }


def _output_shapes(meta: ModelPrepared, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-pixel shape of every output array, in the order they are stored."""
    n_out, shape = meta.n_out, tuple(meta.input_shape)
    want_params = config.wrt in ("params", "both")
    want_input = config.wrt in ("input", "both")
    out: dict[str, tuple[int, ...]] = {"prediction": (n_out,)}
    for kind, lead in (("grad", ()), ("jac", (n_out,))):
        if kind == "jac" and not config.jacobian:
            continue
        if want_params:
            for k, s in meta.params.items():
                out[f"{kind}:{k}"] = (*lead, *s)
        if want_input:
            out[f"{kind}:input"] = (*lead, *shape)
    return out


@dataclass
class _Pixels:
    """One tile's pixels as the model takes them, and their model status so far."""

    X: np.ndarray  # (coef, n_px) pixel-last, as stored: a view, never transposed
    target: np.ndarray | None  # (n_out, n_px); None unless objective mse
    status: np.ndarray  # (n_px,) int8 model status
    finite_in: np.ndarray  # (n_px,) the pixel's coefficients are all finite
    ok: np.ndarray  # indices of the pixels with finite coefficients
    bad_target: np.ndarray  # (n_px,) finite coefficients but a non-finite target


@dataclass
class _TileRun:
    """One tile's pixels as they are run, chunk by chunk, and the arrays their outputs go to."""

    px: _Pixels
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    eager: Kernel
    shapes: dict[str, tuple[int, ...]]  # per-pixel shape of each output
    dtype: torch.dtype
    np_dtype: np.dtype
    device: torch.device
    dense: bool  # every pixel is run (else only those with finite coefficients)
    src: np.ndarray  # (coef, n_run) the coefficients run
    src_t: np.ndarray | None  # (n_out, n_run) their target
    dest: dict[str, np.ndarray]  # (*shape, n_run) the outputs of the pixels run
    finite_run: np.ndarray  # (n_run,) the pixel's outputs are all finite
    #: the arrays the tile returns, (*shape, ny, nx): ``dest``'s own memory when dense
    out: dict[str, np.ndarray]
    #: the model's closed form, where it writes this tile whole rows at a time (dense, on
    #: the host, eager, without Jacobians): see :func:`_run_rows`
    rows: ClosedForm | None = None

    @property
    def flat(self) -> dict[str, np.ndarray]:
        """``out`` pixel-last, (*shape, n_px): views of the same memory."""
        n_px = self.px.X.shape[1]
        return {k: v.reshape(*v.shape[:-2], n_px) for k, v in self.out.items()}

    @property
    def n_run(self) -> int:
        """How many pixels are run."""
        return int(self.src.shape[1])

    def inputs(self, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Coefficients and target of the pixels ``s:e`` run, on the device in the model dtype."""
        px = self.px
        x = self.src[:, s:e]
        if self.dense and not px.finite_in[s:e].all():
            x = x.copy()
            x[:, ~px.finite_in[s:e]] = px.X[:, px.ok[0], None]
        xt = _as_tensor(x).to(device=self.device, dtype=self.dtype)
        tt = (
            None
            if self.src_t is None
            else _as_tensor(self.src_t[:, s:e]).to(device=self.device, dtype=self.dtype)
        )
        return xt, tt

    def empty(self, m: int) -> dict[str, torch.Tensor]:
        """Uninitialised outputs of ``m`` pixels on the device."""
        return {
            k: torch.empty((*s, m), dtype=self.dtype, device=self.device)
            for k, s in self.shapes.items()
        }


def _tile_pixels(
    config: ModelConfig, inputs: Mapping[str, Artifact], tile: Tile, n_out: int
) -> _Pixels:
    """The tile's coefficients and target, with the status of pixels the model cannot run on."""
    coefs = np.asarray(inputs["solve"].array("coefficients"))
    coef = coefs.shape[0]
    X = coefs.reshape(coef, -1)  # pixel-last, as stored: a view, never transposed
    n_px = X.shape[1]
    status = np.full(n_px, MODEL_STATUS_CODES["ok"], np.int8)
    finite_in = np.isfinite(X).all(axis=0)
    status[~finite_in] = MODEL_STATUS_CODES["input_not_finite"]
    ok = np.flatnonzero(finite_in)
    target = None
    bad_target = np.zeros(n_px, bool)
    if config.objective == "mse":
        target = read_block(inputs["load"], "target", tile).reshape(n_out, -1)
        bad_target = finite_in & ~np.isfinite(target).all(axis=0)
        status[bad_target] = MODEL_STATUS_CODES["target_not_finite"]
    return _Pixels(X, target, status, finite_in, ok, bad_target)


def _plan_run(
    config: ModelConfig,
    inputs: Mapping[str, Artifact],
    prepared: Artifact,
    tile: Tile,
    ctx: StageContext,
) -> _TileRun:
    """The model, the pixels to run and the arrays for their outputs, for one tile."""
    meta = ModelPrepared.of(prepared)
    device = resolve_device(config.device)
    np_dtype = np.dtype(config.dtype)
    module = build_module(config).to(device)
    params = _tensors(prepared, "param", meta.params, device)
    buffers = _tensors(prepared, "buffer", meta.buffers, device)
    shapes = _output_shapes(meta, config)
    px = _tile_pixels(config, inputs, tile, meta.n_out)
    n_px = px.X.shape[1]
    # Dense: every pixel is computed in place in the stored arrays, a pixel without finite
    # coefficients on a copy of a valid pixel's (a real input, so a forward that could fail
    # on NaN never sees one) and set to NaN after. Mostly-missing tiles are computed compacted
    # (only the valid pixels) and scattered.
    dense = 2 * len(px.ok) >= n_px
    n_run = n_px if dense else len(px.ok)
    closed = _closed_form(module, config)
    rows = (
        closed
        if closed is not None
        and dense
        and device.type == "cpu"
        and not config.jacobian
        and not _wants_compile(config, inputs)
        else None
    )
    run = _TileRun(
        px=px,
        params=params,
        buffers=buffers,
        eager=make_kernel(module, config, tuple(meta.input_shape)),
        shapes=shapes,
        dtype=getattr(torch, config.dtype),
        np_dtype=np_dtype,
        device=device,
        dense=dense,
        src=px.X if dense else px.X[:, px.ok],
        src_t=px.target if dense or px.target is None else px.target[:, px.ok],
        dest={},
        finite_run=np.ones(n_run, bool),
        # The returned arrays come from the context: filled where the store keeps them
        # (by writes of whole rows, or through the mapping, its pages mapped in first).
        out={
            k: ctx.empty((*s, *tile.shape), np_dtype, populate=rows is None)
            for k, s in shapes.items()
        },
        rows=rows,
    )
    if dense:  # computed in place in the returned arrays
        run.dest = run.flat
    else:  # compacted, scattered after
        run.dest = {k: np.empty((*s, n_run), np_dtype) for k, s in shapes.items()}
    return run


def _chunk_pixels(config: ModelConfig, run: _TileRun, memory_budget: int, compiled: bool) -> int:
    """Pixels per chunk."""
    coef = run.px.X.shape[0]
    per_px = run.np_dtype.itemsize * (sum(int(np.prod(s)) for s in run.shapes.values()) + coef)
    target = CHUNK_BYTES_COMPILED if compiled else CHUNK_BYTES
    return config.chunk_pixels or max(
        256, min(chunk_size(target, per_px), chunk_size(work_share(memory_budget), 4 * per_px))
    )


def _wants_compile(config: ModelConfig, inputs: Mapping[str, Artifact]) -> bool:
    """Whether the config asks for the compiled kernel on this grid."""
    grid_px = int(np.prod(LoadMeta.of(inputs["load"]).grid_shape()))
    return config.compile == "always" or (
        config.compile == "auto" and grid_px >= COMPILE_MIN_PIXELS
    )


def _pick_kernel(
    run: _TileRun,
    config: ModelConfig,
    inputs: Mapping[str, Artifact],
    prepared: Artifact,
    logger: logging.Logger,
) -> tuple[Kernel, str]:
    """The kernel to start the tile with (compiled when asked for and checked) and its cache key."""
    kernel: Kernel = run.eager
    compile_key = f"{prepared.key}:{run.device}"
    if _wants_compile(config, inputs) and run.n_run > 1:
        m = min(COMPILE_CHECK_PIXELS, run.n_run)
        compiled = compiled_kernel(
            compile_key,
            run.eager,
            (run.params, run.buffers, *run.inputs(0, m)),
            run.empty,
            logger,
        )
        kernel = compiled or run.eager
    return kernel, compile_key


def _run_chunks(
    run: _TileRun,
    kernel: Kernel,
    chunks: Mapping[bool, int],
    compile_key: str,
    logger: logging.Logger,
) -> bool:
    """Fill ``run.dest`` and ``run.finite_run``; whether the compiled kernel ran to the end.

    True when it computed at least one chunk and never failed (single-pixel
    chunks always run eager). ``chunks``: pixels per chunk for the eager
    (False) and compiled (True) kernel.
    """
    eager, params, buffers = run.eager, run.params, run.buffers
    on_host = run.device.type == "cpu"
    dest_t = {k: torch.from_numpy(v) for k, v in run.dest.items()}
    e = 0
    compiled_chunks = 0
    while e < run.n_run:
        # the eager kernel's chunks again after a compiled one failed
        s, e = e, min(run.n_run, e + chunks[kernel is not eager])
        x, t = run.inputs(s, e)
        views = {k: v[..., s:e] for k, v in dest_t.items()} if on_host else run.empty(e - s)
        # One pixel would make the compiler specialise (recompile) on a size of 1.
        fn = kernel if e - s > 1 else eager
        if fn is not eager:
            _pixels_dynamic(x, t, *views.values())
        try:
            flags = fn(params, buffers, x, t, views)
            compiled_chunks += fn is not eager
        except Exception as exc:
            if fn is eager:
                raise
            logger.warning("model: compiled kernel failed, running eager: %s", first_line(exc))
            _forget_compiled(compile_key)
            kernel = eager
            flags = eager(params, buffers, x, t, views)
        if not on_host:
            for k, v in views.items():
                dest_t[k][..., s:e].copy_(v)
        if flags is not None:
            run.finite_run[s:e] = flags.cpu().numpy()
        else:
            run.finite_run[s:e] = _finite_pixels(arr[..., s:e] for arr in run.dest.values())
    return kernel is not eager and compiled_chunks > 0


def _run_rows(run: _TileRun, rows: ClosedForm, chunk: int, write: Write) -> None:
    """Fill ``run.dest`` and ``run.finite_run`` by the closed form, whole rows at a time.

    The outputs and d loss/d y chunk by chunk (small: n_out per pixel), then
    every output written in blocks of whole rows: the gradients are made a
    row block at a time in one buffer and written to the store's file, never
    whole in memory, and no page of the file is zeroed or faulted in first
    (``Staging.write``). Pixels without finite coefficients get junk here
    and NaN in :func:`_tile_outputs`, as on the chunk path.
    """
    n = run.n_run
    n_out = run.shapes["prediction"][0]
    y_t = torch.empty((n_out, n), dtype=run.dtype)
    dl_t = torch.empty((n_out, n), dtype=run.dtype)
    shape = tuple(rows.weight_shape[:-1])
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        x, t = run.inputs(s, e)
        xs = x.t().contiguous().reshape(e - s, *shape)
        y, dl = rows.forward(run.params, run.buffers, xs, None if t is None else t.t())
        y_t[:, s:e] = y.t()
        dl_t[:, s:e] = dl.t()
        run.finite_run[s:e] = rows.finite(x, y, dl_t[:, s:e]).numpy()
    src = run.src

    def x_row(r: int) -> torch.Tensor:
        return _as_tensor(src[r]).to(dtype=run.dtype)

    rows.write_rows(x_row, y_t, dl_t, run.dest, write)


def _tile_outputs(run: _TileRun) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every output of the tile, (…, y, x), and whether each pixel's outputs are all finite.

    Pixels without finite coefficients get NaN outputs.
    """
    px = run.px
    n_px = px.X.shape[1]
    if run.dense:  # computed in place: ``dest`` is ``flat``
        finite_out = run.finite_run
        missing = np.flatnonzero(~px.finite_in)
        if len(missing):
            for arr in run.dest.values():
                arr[..., missing] = np.nan
    else:
        for k, arr in run.flat.items():
            arr[...] = np.nan
            arr[..., px.ok] = run.dest[k]
        finite_out = np.zeros(n_px, bool)
        finite_out[px.ok] = run.finite_run
    return run.out, finite_out


def _tile_result(px: _Pixels, out: dict[str, np.ndarray], tile: Tile, kernel: str) -> StageOutput:
    """The tile's arrays, with its pixel and status counts."""
    n_px = px.X.shape[1]
    counts = flag_counts(px.status, MODEL_STATUS_FLAGS)
    ny, nx = tile.shape
    arrays = dict(out)
    arrays["model_status"] = px.status.reshape(ny, nx)
    return StageOutput(
        arrays=arrays,
        meta={
            "pixels": len(px.ok),
            "skipped": int(n_px - len(px.ok)),
            "model_status_counts": counts,
            "kernel": kernel,
        },
    )
