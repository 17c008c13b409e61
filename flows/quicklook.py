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


def write_quicklook(output: str | Path) -> tuple[Path, bytes]:
    """Write ``<output>.quicklook.png`` beside the output (atomically); return path and bytes."""
    png = quicklook_png(output)
    path = Path(f"{output}.quicklook.png")
    with atomic_file(path) as tmp:
        tmp.write_bytes(png)
    return path, png


def markdown(png: bytes, path: Path, output: str | Path) -> str:
    """Markdown showing the picture inline, with where the file and the picture are."""
    data = base64.b64encode(png).decode("ascii")
    return (
        f"### gridsolve quick look\n\n![quick look](data:image/png;base64,{data})\n\n"
        f"Output: `{output}`  \nPicture: `{path}`\n"
    )
