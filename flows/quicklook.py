"""A quick-look picture of an output file: the first coefficient and the residual RMS maps.

A cube with more batch dims than y and x is shown at their first index.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: no display on workers

import matplotlib.pyplot as plt
import numpy as np
import xarray as xr

from gridsolve.stages.engine import remote
from gridsolve.stages.engine.paths import atomic_file

MAX_SIDE = 300


def _thin(a: np.ndarray) -> np.ndarray:
    step = max(1, int(np.ceil(max(a.shape) / MAX_SIDE)))
    return a[::step, ::step]


def open_output(output: str | Path, options: Mapping[str, Any] | None = None) -> xr.Dataset:
    """An output of gridsolve: a NetCDF file, or a Zarr store (a folder, whatever its name).

    A URL is opened with ``options`` (``write.storage_options``) and the
    credentials of the environment.
    """
    if remote.is_url(str(output)):
        url = str(output)
        if remote.exists(f"{url}/.zmetadata", options):
            so = remote.storage_options(options)
            found: xr.Dataset = xr.open_zarr(url, storage_options=so)
            return found
        return xr.open_dataset(remote.local_copy(url, options))
    if Path(output).is_dir():
        store: xr.Dataset = xr.open_zarr(output)
        return store
    return xr.open_dataset(output)


def first_plane(ds: xr.Dataset) -> tuple[xr.Dataset, str]:
    """``ds`` at the first index of every batch dim besides the map's two, and which that is.

    The maps show the last two dims of ``residual_rms`` (y, x); a cube with more
    batch dims (member, level, …) is shown at their first index, named in the
    titles, e.g. ``member=1, level=500``.
    """
    batch = [str(d) for d in ds["residual_rms"].dims[:-2]]
    if not batch:
        return ds, ""
    labels = [f"{d}={ds[d].values[0] if d in ds.coords else 0}" for d in batch]
    return ds.isel({d: 0 for d in batch}), ", ".join(labels)


def significant_trend(ds: xr.Dataset, level: float = 0.05) -> tuple[np.ndarray, float] | None:
    """The trend map with pixels whose trend coefficient has p ≥ ``level`` masked (NaN).

    None unless the output has a ``trend`` and p-values (``solve.uncertainty``).
    Also returns the fraction of finite-trend pixels that are significant.
    """
    if "trend" not in ds or "p_value" not in ds or "coef_name" not in ds.coords:
        return None
    names = [str(n) for n in ds["coef_name"].values]
    column = str(ds["trend"].attrs.get("coefficient", ""))
    if column not in names:
        return None
    trend = np.asarray(ds["trend"].values, dtype=np.float64)
    p = np.asarray(ds["p_value"].isel(coef=names.index(column)).values, dtype=np.float64)
    significant = p < level  # NaN p-values (not identifiable) are never significant
    shown = np.where(significant, trend, np.nan)
    finite = np.isfinite(trend)
    fraction = float(significant[finite].mean()) if finite.any() else 0.0
    return shown, fraction


def quicklook_png(output: str | Path, options: Mapping[str, Any] | None = None) -> bytes:
    """PNG bytes of maps of ``output``: ``coefficients[0]``, ``residual_rms``, significance.

    The third map, where the output has a trend with p-values, is the trend
    where it is significant (p < 0.05), blank elsewhere.
    """
    with open_output(output, options) as full:
        ds, where = first_plane(full)
        coef = _thin(np.asarray(ds["coefficients"].isel(coef=0).values, dtype=np.float64))
        rms = _thin(np.asarray(ds["residual_rms"].values, dtype=np.float64))
        labels = ds["coef_name"] if "coef_name" in ds.coords else ds.get("coef")
        name = str(labels.values[0]) if labels is not None else "0"
        panels = [(coef, f"coefficient {name}"), (rms, "residual RMS")]
        trend = significant_trend(ds)
        if trend is not None:
            shown, fraction = trend
            panels.append((_thin(shown), f"trend, p < 0.05 ({100 * fraction:.0f}% of pixels)"))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4 * len(panels), 3.6), dpi=80, constrained_layout=True
    )
    for ax, (data, title) in zip(axes, panels, strict=True):
        im = ax.imshow(data, origin="lower", interpolation="nearest", cmap="viridis")
        ax.set_title(f"{title}\n{where}" if where else title)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, shrink=0.8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def loss_curve_png(output: str | Path, options: Mapping[str, Any] | None = None) -> bytes | None:
    """PNG bytes of the training and validation loss per epoch, or None without training."""
    with open_output(output, options) as ds:
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


def _write_beside(
    output: str | Path, suffix: str, png: bytes, options: Mapping[str, Any] | None = None
) -> Path | str:
    if remote.is_url(str(output)):
        url = f"{output}.{suffix}.png"
        remote.filesystem(url, options).pipe_file(url, png)  # one PUT: whole or absent
        return url
    path = Path(f"{output}.{suffix}.png")
    with atomic_file(path) as tmp:
        tmp.write_bytes(png)
    return path


def write_quicklook(
    output: str | Path, options: Mapping[str, Any] | None = None
) -> tuple[Path | str, bytes]:
    """Write ``<output>.quicklook.png`` beside the output (atomically); return path and bytes."""
    png = quicklook_png(output, options)
    return _write_beside(output, "quicklook", png, options), png


def write_loss_curve(
    output: str | Path, options: Mapping[str, Any] | None = None
) -> tuple[Path | str, bytes] | None:
    """Write ``<output>.loss.png`` beside the output when it holds a training's losses."""
    png = loss_curve_png(output, options)
    return None if png is None else (_write_beside(output, "loss", png, options), png)


def markdown(png: bytes, path: Path | str, output: str | Path, title: str = "quick look") -> str:
    """Markdown showing the picture inline, with where the file and the picture are."""
    data = base64.b64encode(png).decode("ascii")
    return (
        f"### gridsolve {title}\n\n![{title}](data:image/png;base64,{data})\n\n"
        f"Output: `{output}`  \nPicture: `{path}`\n"
    )
