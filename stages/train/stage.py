"""The ``train`` stage: fits the model's single-sample module to ``load.target`` over pixels.

One pixel is one sample: its solved coefficients (reshaped to the model's
input shape) are the input, its target values the target. The numerics are in
:mod:`gridsolve.stages.train.dpsgd`; this module turns the stored solve tiles
into a dataset and the result into the stage's artifact.

Out of core. The usable pixels' inputs and targets are copied once, tile by
tile, into two files in a scratch folder of the store, in global raster order
(so pixel indices, shuffles and the validation split never depend on the
tiling); minibatches are read from them by index, each read mapping the files
only while it copies its rows (:class:`Rows`). The whole grid costs a
one-byte-per-pixel mask and the epoch's permutation.

Resuming. After every epoch the training state (weights, optimiser state,
history) is stored under a key derived from the stage's key and the epoch; a
run killed mid-training and started again continues from the last stored
epoch and ends with byte-identical weights.

The module to train is the ``model`` section's (its architecture, initial
weights file or seed, dtype and mode): the stage reads that config as a peer
(``StageDecl.peers``), and its key covers only the fields that define the
module (``ModelConfig.module_payload``), so changing what the model stage
outputs (``jacobian``, ``wrt``) never retrains.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gridsolve.schemas.contracts import STATUS_CODES
from gridsolve.schemas.errors import ContractError
from gridsolve.schemas.kinds.model import ModelConfig
from gridsolve.schemas.kinds.train import GradientTrain
from gridsolve.schemas.metadata import LoadMeta, Meta, SolvePrepared
from gridsolve.stages.engine.blocks import read_block
from gridsolve.stages.engine.context import StageContext, work_share
from gridsolve.stages.engine.hashing import hash_text
from gridsolve.stages.engine.pyparse import PARSE_LOCK, load_npy
from gridsolve.stages.engine.store import Artifact, StageOutput, TiledArtifact
from gridsolve.stages.engine.timing import torch_func_ready
from gridsolve.stages.model import building
from gridsolve.stages.train import dpsgd
from gridsolve.stages.train.clipped_step import per_sample_grad_norms
from gridsolve.stages.train.sampling import VALIDATION_BLOCK, block_split, privacy_spent
from gridsolve.stages.train.train_state import TrainState, state_from_arrays, state_to_arrays

#: Bytes of dataset rows read into memory at most; larger datasets are streamed.
ROW_BUDGET = 256 * 2**20


def _stage(config: GradientTrain) -> str:
    return f"train/{config.impl}"


class _Streamed:
    """One .npy file of rows read with ``pread``: nothing of it stays in the process."""

    def __init__(self, path: Path) -> None:
        with PARSE_LOCK:  # np.load parses the header with ast
            header = np.load(path, mmap_mode="r", allow_pickle=False)
        self._width, self._dtype, self._offset = header.shape[1], header.dtype, header.offset
        del header
        self._row_bytes = self._width * self._dtype.itemsize
        self._fd = os.open(path, os.O_RDONLY)

    def read(self, at: np.ndarray | slice) -> np.ndarray:
        """A copy of rows ``at`` (indices, or a slice with step 1)."""
        rb = self._row_bytes
        if isinstance(at, slice):
            n = max(0, at.stop - at.start)
            buf = bytearray(os.pread(self._fd, n * rb, self._offset + at.start * rb))
        else:
            # A mapping would keep ~64 KiB per row in the process (the kernel maps pages
            # around each fault): reads of single rows keep the memory flat instead.
            buf = bytearray(rb * len(at))
            view = memoryview(buf)
            for j, i in enumerate(np.asarray(at).tolist()):
                os.preadv(self._fd, [view[j * rb : (j + 1) * rb]], self._offset + i * rb)
        return np.frombuffer(buf, self._dtype).reshape(-1, self._width)

    def __del__(self) -> None:
        os.close(self._fd)


@dataclass(frozen=True)
class Rows:
    """Inputs X (N, coef) and targets Y (N, n_out) in two .npy files, read by row.

    Writes map the files only while they copy their rows; reads keep the rows
    in memory when both files fit in ``budget`` bytes and stream them from the
    files otherwise (:meth:`reader`).
    """

    x_path: Path
    y_path: Path
    budget: int = ROW_BUDGET

    @classmethod
    def create(
        cls,
        folder: Path,
        n: int,
        n_coef: int,
        n_out: int,
        dtype: np.dtype,
        budget: int = ROW_BUDGET,
    ) -> Rows:
        """Two new files of ``n`` rows, under ``folder``."""
        rows = cls(folder / "X.npy", folder / "Y.npy", budget)
        for path, width in ((rows.x_path, n_coef), (rows.y_path, n_out)):
            np.lib.format.open_memmap(path, "w+", dtype, (max(n, 1), width))
        return rows

    def write(self, at: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        """Rows ``at`` set to ``x`` and ``y``."""
        for path, values in ((self.x_path, x), (self.y_path, y)):
            with PARSE_LOCK:  # open_memmap parses the header with ast
                mapped = np.lib.format.open_memmap(path, "r+")
            mapped[at] = values
            mapped.flush()
            del mapped

    def reader(self) -> Callable[[np.ndarray | slice], tuple[np.ndarray, np.ndarray]]:
        """``read(at)``: copies of rows ``at`` of X and Y.

        Files that fit in ``budget`` together are read into memory once (fast
        gathers); larger ones are streamed row by row, so memory stays flat
        however large the grid (a speed-only choice: the rows are the same).
        """
        size = self.x_path.stat().st_size + self.y_path.stat().st_size
        if size <= self.budget:
            x_all, y_all = load_npy(self.x_path, mmap=False), load_npy(self.y_path, mmap=False)
            return lambda at: (np.ascontiguousarray(x_all[at]), np.ascontiguousarray(y_all[at]))
        x, y = _Streamed(self.x_path), _Streamed(self.y_path)
        return lambda at: (x.read(at), y.read(at))


@dataclass(frozen=True)
class Dataset:
    """The usable pixels' inputs and targets, in global raster order, in files."""

    rows: Rows
    n: int
    validation: np.ndarray  # (N,) bool: held out
    counts: dict[str, int]
    mask: np.ndarray  # (ny, nx) bool: the usable pixels, in the order of X's rows


def _usable(
    config: GradientTrain,
    coef: np.ndarray,
    status: np.ndarray,
    target: np.ndarray,
    dtype: np.dtype,
) -> tuple[np.ndarray, dict[str, int]]:
    """Which pixels of one tile are training samples, and why the others are not.

    Finite means finite in the model's ``dtype``, which the rows are stored in.
    """
    codes = [STATUS_CODES[s] for s in config.usable_status]
    ok_status = np.isin(status, codes)
    with np.errstate(over="ignore"):
        finite_x = np.isfinite(coef.astype(dtype)).all(axis=0)
        finite_y = np.isfinite(target.astype(dtype)).all(axis=0)
    use = ok_status & finite_x & finite_y
    counts = {
        "excluded_status": int((~ok_status).sum()),
        "excluded_coefficients_not_finite": int((ok_status & ~finite_x).sum()),
        "excluded_target_not_finite": int((ok_status & finite_x & ~finite_y).sum()),
    }
    return use, counts


def _mask(
    config: GradientTrain, load: Artifact, solve: TiledArtifact, dtype: np.dtype
) -> tuple[np.ndarray, dict[str, int]]:
    """The usable-pixel mask of the whole grid and the exclusion counts."""
    ny, nx = LoadMeta.of(load).grid_shape()
    mask = np.zeros((ny, nx), dtype=bool)
    counts: dict[str, int] = {}
    for tile, art in solve.tiles:
        target = read_block(load, "target", tile)
        use, c = _usable(config, art.array("coefficients"), art.array("status"), target, dtype)
        mask[tile.y0 : tile.y1, tile.x0 : tile.x1] = use
        for k, v in c.items():
            counts[k] = counts.get(k, 0) + v
    return mask, counts


#: The counts of pixels left out of training and validation, by reason.
EXCLUSIONS = (
    "excluded_status",
    "excluded_coefficients_not_finite",
    "excluded_target_not_finite",
)


def _excluded(config: GradientTrain, counts: Mapping[str, int], target: str) -> tuple[str, str]:
    """Why pixels are not samples, as counts, and the config fields that change it."""
    found = (
        f"{counts['excluded_status']} with a solve status outside train.usable_status "
        f"{list(config.usable_status)}, {counts['excluded_coefficients_not_finite']} with "
        f"non-finite coefficients, {counts['excluded_target_not_finite']} with no finite "
        f"value of the target {target!r}"
    )
    fixes = []
    if counts["excluded_target_not_finite"]:
        fixes.append(
            f"check that load.target ({target!r}) names the variable of targets and that its "
            "values are not all missing (NaN, _FillValue or outside valid_range)"
        )
    if counts["excluded_status"]:
        fixes.append("allow more solve statuses in train.usable_status")
    if counts["excluded_coefficients_not_finite"]:
        fixes.append("check the solve's coefficients (status, policy)")
    return found, "; or ".join(fixes) or "check the input data"


def check_split(
    config: GradientTrain,
    counts: Mapping[str, int],
    map_shape: tuple[int, int],
    target: str,
    block: int = VALIDATION_BLOCK,
) -> None:
    """ContractError naming the sizes and counts if either side of the split has no pixel.

    ``counts`` are :func:`dataset`'s (exclusions, ``train_pixels``,
    ``validation_pixels``); ``map_shape`` is the (y, x) map the validation
    blocks are drawn on. Checked before any row is copied or any step taken.
    """
    stage = _stage(config)
    n_train, n_val = counts["train_pixels"], counts["validation_pixels"]
    total = n_train + n_val + sum(counts[k] for k in EXCLUSIONS)
    frac = config.validation_fraction
    ny, nx = map_shape
    n_blocks = -(-ny // block) * -(-nx // block)
    if n_train + n_val == 0:
        found, fix = _excluded(config, counts, target)
        raise ContractError(
            f"no pixel can be a training sample: none of the {total} pixels has a usable "
            "solve status, finite coefficients and a finite target",
            stage=stage,
            found=found,
            fix=fix,
        )
    if n_train == 0 and frac > 0 and n_blocks == 1:
        raise ContractError(
            f"the map ({ny} × {nx} pixels) is smaller than one validation block "
            f"({block} × {block} pixels): validation_fraction {frac} holds out the whole map, "
            "so no pixel is left to train on",
            stage=stage,
            found=f"{n_val} usable pixels, all in the one validation block",
            fix="set train.validation_fraction: 0 (no validation loss; early_stopping: null), "
            f"or train on a map larger than {block} pixels along y or x",
        )
    if n_train == 0:
        raise ContractError(
            f"no usable pixel is left to train on: all {n_val} fall in the validation blocks "
            f"(validation_fraction {frac} of the {n_blocks} blocks of {block} × {block} "
            f"pixels on the {ny} × {nx} map)",
            stage=stage,
            found=_excluded(config, counts, target)[0] + " outside the validation blocks",
            fix="lower train.validation_fraction, or choose another train.seed (it draws "
            "the blocks)",
        )
    if n_val == 0 and frac > 0:
        found, _ = _excluded(config, counts, target)
        raise ContractError(
            f"no usable pixel falls in the validation blocks (validation_fraction {frac} of "
            f"the {n_blocks} blocks of {block} × {block} pixels on the {ny} × {nx} map), so "
            "there is no validation loss",
            stage=stage,
            found=f"{n_train} usable pixels to train on, none held out; not usable: {found}",
            fix="choose another train.seed (it draws the blocks), raise "
            "train.validation_fraction, or set train.validation_fraction: 0 and "
            "early_stopping: null to train without validation",
        )


def dataset(
    config: GradientTrain,
    load: Artifact,
    solve: TiledArtifact,
    folder: Path,
    dtype: np.dtype,
    budget: int = ROW_BUDGET,
) -> Dataset:
    """The training dataset, in files under ``folder`` (the caller removes it).

    ContractError (see :func:`check_split`) before any row is copied when the
    training or the validation side would have no pixel.
    """
    mask, counts = _mask(config, load, solve, dtype)
    grid = LoadMeta.of(load)
    target_info = grid.aux["target"]
    # The split is drawn on the map (y, x) and repeated over the batch dims' planes, so a
    # location is on one side for every member/level: no leak between the two sides.
    map_shape = (grid.ny, grid.nx)
    plane = block_split(*map_shape, config.validation_fraction, config.seed)
    planes = mask.shape[0] // plane.shape[0]
    held = np.tile(plane, (planes, 1))[mask]
    counts["train_pixels"] = int((~held).sum())
    counts["validation_pixels"] = int(held.sum())
    check_split(config, counts, map_shape, target_info.name)
    n = int(mask.sum())
    n_coef = SolvePrepared.of(solve.prepared).coef
    n_out = target_info.n_out
    rank = np.cumsum(mask.ravel()).reshape(mask.shape) - 1  # raster position among usable
    rows = Rows.create(folder, n, n_coef, n_out, dtype, budget)
    for tile, art in solve.tiles:
        ys, xs = slice(tile.y0, tile.y1), slice(tile.x0, tile.x1)
        use = mask[ys, xs]
        target = read_block(load, "target", tile)
        rows.write(rank[ys, xs][use], art.array("coefficients")[:, use].T, target[:, use].T)
    return Dataset(rows=rows, n=n, validation=held, counts=counts, mask=mask)


def fetcher(rows: Rows, subset: np.ndarray) -> dpsgd.Fetch:
    """``fetch(indices)`` over the dataset rows ``subset`` (indices are positions in it).

    The rows were checked finite in the model's dtype when the dataset was made.
    """
    read = rows.reader()

    def fetch(indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = read(subset[np.asarray(indices)])
        return torch.from_numpy(x), torch.from_numpy(y)

    return dpsgd.FiniteFetch(fetch)


def _initial(model: ModelConfig) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model's module with its initial weights (file or seed), and its parameters."""
    module = building.build_module(model)
    if model.weights is not None:
        stage = f"model/{model.impl}"
        building.apply_weights(
            module, building.load_weights(model.weights, stage), model.weights, stage
        )
    params = {k: v.detach().clone() for k, v in module.named_parameters()}
    return module, params


def _epoch_key(stage_key: str, epoch: int) -> str:
    return hash_text(f"{stage_key}/train-epoch/{epoch}")


class EpochCheckpoint(Meta):
    """An epoch checkpoint's metadata: the training state (:func:`train_state.state_to_arrays`)."""

    state: dict[str, Any]


def _resume(config: GradientTrain, ctx: StageContext) -> TrainState | None:
    """The state of the last epoch a killed run of this stage stored, if any."""
    for epoch in range(config.epochs, 0, -1):
        key = _epoch_key(ctx.key, epoch)
        if ctx.store.check(key)[0] == "hit":
            art = ctx.store.get(key)
            return state_from_arrays(art.arrays(), EpochCheckpoint.of(art).state)
    return None


def _checkpoint(config: GradientTrain, ctx: StageContext) -> Any:
    """After each epoch: store the state (to resume from) and report the progress."""

    def save(state: TrainState) -> None:
        arrays, meta = state_to_arrays(state)
        key = _epoch_key(ctx.key, state.epoch)
        info = {"kind": "train", "part": "epoch", "epoch": state.epoch}
        ctx.store.put(key, StageOutput(arrays=arrays, meta={"state": meta}), info)
        last = state.history[-1]
        line = f"train: epoch {state.epoch}/{config.epochs}, training loss {last['train_loss']:.6g}"
        if last.get("val_loss") is not None:
            line += f", validation loss {last['val_loss']:.6g}"
        ctx.logger.info(line)
        if ctx.progress is not None:
            ctx.progress(state.epoch / config.epochs, line)

    return save


def grad_norm_map(
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    data: Dataset,
    shape: tuple[int, ...],
    chunk: int,
) -> np.ndarray:
    """Per-pixel L2 norm of the loss gradient at ``params`` (y, x); NaN where not usable.

    A map of how strongly each pixel pulls on the weights: outliers stand out.
    """
    out = np.full(data.mask.shape, np.nan, dtype=np.float32)
    flat = out.reshape(-1)
    where = np.flatnonzero(data.mask.reshape(-1))
    like = next(iter(params.values()))
    read = data.rows.reader()
    for start in range(0, len(where), chunk):
        stop = min(len(where), start + chunk)
        xs, ys = read(slice(start, stop))
        x, y = torch.from_numpy(xs).to(like.dtype), torch.from_numpy(ys).to(like.dtype)
        norms = per_sample_grad_norms(module, params, x.reshape(-1, *shape), y)
        flat[where[start:stop]] = norms.numpy()
    return out


def _history_arrays(history: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    def col(name: str) -> np.ndarray:
        return np.array(
            [math.nan if h.get(name) is None else float(h[name]) for h in history],
            dtype=np.float64,
        )

    return {"train_loss": col("train_loss"), "val_loss": col("val_loss")}


def check_outputs_match_target(
    config: GradientTrain,
    module: torch.nn.Module,
    params: Mapping[str, torch.Tensor],
    input_shape: tuple[int, ...],
    n_out: int,
    impl: str,
) -> None:
    """ContractError, before any row is copied, if the model's output size is not the target's.

    The MSE compares each pixel's output with its target value for value, so both
    must hold the same number of values.
    """
    like = next(iter(params.values()))
    buffers = {k: v.detach() for k, v in module.named_buffers()}
    with torch.no_grad():
        out = torch.func.functional_call(
            module, (dict(params), buffers), (torch.zeros(input_shape, dtype=like.dtype),)
        )
    if out.numel() == n_out:
        return
    fix = (
        f"set model.output_dim: {n_out}"
        if impl == "multidim_linear"
        else f"make the model return {n_out} value(s) per sample"
    )
    raise ContractError(
        f"the model's output has {out.numel()} value(s) per pixel (shape {tuple(out.shape)}), "
        f"the training target has {n_out}: the loss compares them value by value",
        stage=_stage(config),
        fix=f"{fix}, or name a target variable with {out.numel()} value(s) per pixel",
    )


def run(config: GradientTrain, inputs: Mapping[str, Any], ctx: StageContext) -> StageOutput:
    """Train the model's module on the usable pixels; the weights and the loss history."""
    torch_func_ready()
    model = ctx.peers["model"]
    assert isinstance(model, ModelConfig)
    load, solve = inputs["load"], inputs["solve"]
    target = LoadMeta.of(load).aux.get("target")
    if target is None:
        raise ContractError(
            "training needs a target, and the input has none",
            stage=_stage(config),
            fix="set load.target to the variable of per-pixel targets",
        )
    module, params = _initial(model)
    dtype = np.dtype(model.dtype)
    shape = tuple(building.input_shape(model))
    check_outputs_match_target(config, module, params, shape, target.n_out, model.impl)
    resumed = _resume(config, ctx)
    with ctx.store.scratch() as folder:
        data = dataset(config, load, solve, folder, dtype, work_share(ctx.memory_budget))
        train_rows = np.flatnonzero(~data.validation)
        val_rows = np.flatnonzero(data.validation)
        validation = (fetcher(data.rows, val_rows), len(val_rows)) if len(val_rows) else None
        result = dpsgd.train(
            module,
            params,
            fetcher(data.rows, train_rows),
            len(train_rows),
            config,
            validation=validation,
            input_shape=shape,
            state=resumed,
            on_epoch=_checkpoint(config, ctx),
        )
        counts = data.counts
        grad_norm = grad_norm_map(module, result.params, data, shape, config.batch_pixels)
    state = result.state
    eps, delta = privacy_spent(config, counts["train_pixels"], state.steps)
    arrays: dict[str, np.ndarray] = {
        f"param:{k}": v.detach().cpu().numpy() for k, v in result.params.items()
    }
    arrays.update(_history_arrays(state.history))
    arrays["grad_norm"] = grad_norm
    meta = {
        "epochs_run": state.epoch,
        # run facts, not results: a resumed run's weights equal an uninterrupted run's
        "resumed_after_epoch": resumed.epoch if resumed is not None else 0,
        # the epoch of the lowest validation loss (None without validation pixels), and the
        # epoch whose weights are written: the best with early stopping, else the last
        "best_epoch": state.best_epoch,
        "weights_epoch": result.epoch,
        "weights_from": "best" if config.early_stopping is not None else "last",
        "steps": state.steps,
        "counts": counts,
        "epsilon": None if math.isinf(eps) else eps,
        "delta": delta,
        "history": state.history,
        "params": {k: list(v.shape) for k, v in result.params.items()},
    }
    return StageOutput(arrays=arrays, meta=meta)
