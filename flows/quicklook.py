"""A quick-look picture of an output file: the first coefficient and the residual RMS maps."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on workers

import matplotlib.pyplot as plt
import numpy as np
import xarray as xr

from gridsolve.stages.engine.paths import atomic_file

MAX_SIDE = 300


def _thin(a: np.ndarray) -> np.ndarray:
    step = max(1, int(np.ceil(max(a.shape) / MAX_SIDE)))
    return a[::step, ::step]


def quicklook_png(output: str | Path) -> bytes:
    """PNG bytes of two maps of ``output``: ``coefficients[0]`` and ``residual_rms``."""
    with xr.open_dataset(output) as ds:
        coef = _thin(np.asarray(ds["coefficients"].isel(coef=0).values, dtype=np.float64))
        rms = _thin(np.asarray(ds["residual_rms"].values, dtype=np.float64))
        labels = ds["coef_name"] if "coef_name" in ds.coords else ds.get("coef")
        name = str(labels.values[0]) if labels is not None else "0"
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6), dpi=80, constrained_layout=True)
    for ax, data, title in ((axes[0], coef, f"coefficient {name}"), (axes[1], rms, "residual RMS")):
        im = ax.imshow(data, origin="lower", interpolation="nearest", cmap="viridis")
        ax.set_title(title)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, shrink=0.8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def loss_curve_png(output: str | Path) -> bytes | None:
    """PNG bytes of the training and validation loss per epoch, or None without training."""
    with xr.open_dataset(output) as ds:
        if "train_loss" not in ds:
            return None
        epoch = ds["epoch"].values
        train = ds["train_loss"].values
        val = ds["val_loss"].values
    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=80, constrained_layout=True)
    ax.plot(epoch, train, marker="o", label="training")
    if np.isfinite(val).any():
        ax.plot(epoch, val, marker="s", label="validation")
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean squared error")
    ax.set_yscale("log" if np.nanmin(train) > 0 else "linear")
    ax.set_title("training loss")
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _write_beside(output: str | Path, suffix: str, png: bytes) -> Path:
    path = Path(f"{output}.{suffix}.png")
    with atomic_file(path) as tmp:
        tmp.write_bytes(png)
    return path


def write_quicklook(output: str | Path) -> tuple[Path, bytes]:
    """Write ``<output>.quicklook.png`` beside the output (atomically); return path and bytes."""
    png = quicklook_png(output)
    return _write_beside(output, "quicklook", png), png


def write_loss_curve(output: str | Path) -> tuple[Path, bytes] | None:
    """Write ``<output>.loss.png`` beside the output when it holds a training's losses."""
    png = loss_curve_png(output)
    return None if png is None else (_write_beside(output, "loss", png), png)


def markdown(png: bytes, path: Path, output: str | Path, title: str = "quick look") -> str:
    """Markdown showing the picture inline, with where the file and the picture are."""
    data = base64.b64encode(png).decode("ascii")
    return (
        f"### gridsolve {title}\n\n![{title}](data:image/png;base64,{data})\n\n"
        f"Output: `{output}`  \nPicture: `{path}`\n"
    )
