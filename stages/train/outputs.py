"""What the ``train`` kind adds to the output: the loss curves, the gradient-norm map, the weights.

Declared once here (``KindContract.extends``) and written by whichever writer
the run uses: variables and provenance attributes in the output, and the trained
weights as safetensors beside it (``<write.path>.weights.safetensors``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gridsolve.schemas.metadata import LoadMeta, TrainMeta
from gridsolve.stages.engine.outputs import Extension
from gridsolve.stages.engine.paths import WEIGHTS_SUFFIX, atomic_file
from gridsolve.stages.engine.provenance import MARK_KEY, MARK_VALUE
from gridsolve.stages.engine.store import Artifact

if TYPE_CHECKING:  # a run whose every stage hits imports no xarray
    import xarray as xr


def extends(train: Artifact, load: Artifact) -> Extension:
    """The training's variables and attributes, and its weights file beside the output."""
    return Extension(
        add=lambda ds: add_training(ds, train, load),
        side_files={WEIGHTS_SUFFIX: lambda path: write_weights(train, path)},
    )


def weights_path(output: Path) -> Path:
    """Where the trained weights go: beside the output, ``<output>.weights.safetensors``."""
    return output.with_name(f"{output.name}{WEIGHTS_SUFFIX}")


def add_training(ds: xr.Dataset, train: Artifact, load: Artifact) -> None:
    """Add the loss per epoch, the gradient-norm map and the training's provenance."""
    n = len(train.array("train_loss"))
    ds.coords["epoch"] = (
        "epoch",
        np.arange(1, n + 1, dtype=np.int32),
        {"long_name": "training epoch", "units": "1"},
    )
    ds["epoch"].encoding["_FillValue"] = None
    for name, what in (("train_loss", "training"), ("val_loss", "validation")):
        ds[name] = (
            "epoch",
            np.asarray(train.array(name)),
            {
                "long_name": f"mean squared error of the model over the {what} pixels",
                "comment": f"mean over the {what} pixels of each pixel's mean squared error, "
                "with the weights at the end of the epoch, without clipping or noise",
            },
        )
    grid = LoadMeta.of(load)
    ds["grad_norm"] = (
        (*grid.lead_dims, grid.y_dim, grid.x_dim),
        np.asarray(train.array("grad_norm")).reshape(*grid.lead_shape, grid.ny, grid.nx),
        {
            "long_name": "norm of the per-pixel gradient of the training loss",
            "comment": "L2 norm over all model parameters, at the trained weights, before "
            "clipping; NaN where the pixel was not used for training or "
            "validation. Large values mark the pixels that pull hardest on the weights.",
        },
    )
    meta = TrainMeta.of(train)
    ds.attrs["gridsolve_train_epochs"] = meta.epochs_run
    ds.attrs["gridsolve_train_steps"] = meta.steps
    ds.attrs["gridsolve_train_pixels"] = json.dumps(meta.counts, sort_keys=True)
    if meta.best_epoch is not None:  # None: no validation pixels
        ds.attrs["gridsolve_train_best_epoch"] = meta.best_epoch
    ds.attrs["gridsolve_train_weights_epoch"] = meta.weights_epoch
    ds.attrs["gridsolve_train_weights_from"] = (
        "best validation epoch (early stopping restored it)"
        if meta.weights_from == "best"
        else "last epoch (no early stopping)"
    )
    if meta.epsilon is not None:
        ds.attrs["gridsolve_train_epsilon"] = meta.epsilon
        ds.attrs["gridsolve_train_delta"] = meta.delta


def write_weights(train: Artifact, path: Path) -> None:
    """The trained weights as safetensors at ``path`` (atomically), marked as gridsolve's."""
    from safetensors.numpy import save_file

    tensors = {
        name.removeprefix("param:"): np.ascontiguousarray(arr)
        for name, arr in train.arrays().items()
        if name.startswith("param:")
    }
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={MARK_KEY: MARK_VALUE})
