"""The quick-look maps and the loss curve of an output file, drawn with matplotlib.

matplotlib's ``Figure`` is used directly, never pyplot: no backend switch and
nothing global. Imported only to draw (:mod:`.pictures` reuses a picture that
still shows its file without it).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gridsolve.report.maps import _edges, _panels, colour_scale, open_output, status_text
from gridsolve.report.pictures import LOSS_VARIABLE, Caption, caption_text
from gridsolve.stages.engine.provenance import MARK_KEY, MARK_VALUE, STAMP_KEY

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_PANEL_WIDTH_IN = 4.8
_CAPTION_CHARS_PER_IN = 15.5  # characters per inch of caption at its font size


def quicklook_figure(
    output: str | Path, options: Mapping[str, Any] | None = None, caption: Caption | None = None
) -> Figure:
    """The quick-look maps of ``output`` as a matplotlib Figure (not registered with pyplot).

    Panels: ``coefficients[0]``; ``residual_rms`` (or what replaces it, see
    :func:`_residual_panel`); where the output has a trend with p-values, the
    trend where it is significant (p < 0.05), grey elsewhere. Each is drawn on
    the map dims' coordinates with a robust colour scale (:func:`colour_scale`).
    The caption (``fig.texts``) names the run from ``caption`` and the status
    counts of the whole file.
    """
    with open_output(output, options) as full:
        panels, xaxis, yaxis = _panels(full)
        status = status_text(full)
    n = len(panels)
    width = _PANEL_WIDTH_IN * n
    text = caption_text(output, caption, status, int(width * _CAPTION_CHARS_PER_IN))
    caption_h = ((text.count("\n") + 1) * 1.25 * 8 + 10) / 72  # inches, 8 pt lines
    title_h = max(len(p.title) for p in panels) * 1.25 * 8.5 / 72
    height = 3.4 + title_h + caption_h
    bottom = caption_h / height  # the caption's strip, below the maps
    import matplotlib  # here: importing it costs a second, and a reused picture needs none
    from matplotlib.figure import Figure
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    layout = ConstrainedLayoutEngine(rect=(0, bottom, 1, 1 - bottom))
    fig = Figure(figsize=(width, height), dpi=90, layout=layout)
    axes = fig.subplots(1, n, squeeze=False)[0]
    xe, ye = _edges(xaxis.values), _edges(yaxis.values)
    for ax, panel in zip(axes, panels, strict=True):
        scale = colour_scale(panel.data)
        cmap = matplotlib.colormaps[scale.cmap].with_extremes(bad="0.85")
        mesh = ax.pcolormesh(
            xe, ye, panel.data, cmap=cmap, vmin=scale.vmin, vmax=scale.vmax, shading="flat"
        )
        said = " ".join(" ".join(panel.title).split())  # the title without its line breaks
        lines = panel.title + ([scale.note] if scale.note and scale.note not in said else [])
        ax.set_title("\n".join(lines), fontsize=8.5)
        ax.set_xlabel(xaxis.label, fontsize=8.5)
        ax.set_ylabel(yaxis.label, fontsize=8.5)
        ax.tick_params(labelsize=7.5)
        if scale.note:
            ax.text(0.5, 0.5, scale.note, transform=ax.transAxes, ha="center", va="center")
        bar = fig.colorbar(mesh, ax=ax, shrink=0.85, extend=scale.extend)
        bar.ax.tick_params(labelsize=7.5)
    fig.text(0.005, 0.005, text, ha="left", va="bottom", fontsize=8)
    return fig


def to_png(fig: Figure, stamp: str | None = None) -> bytes:
    """The figure as PNG bytes, marked as gridsolve's (and stamped with the output it shows)."""
    buf = io.BytesIO()
    meta = {MARK_KEY: MARK_VALUE} | ({STAMP_KEY: stamp} if stamp else {})
    fig.savefig(buf, format="png", metadata=meta)
    return buf.getvalue()


def quicklook_png(
    output: str | Path, options: Mapping[str, Any] | None = None, caption: Caption | None = None
) -> bytes:
    """PNG bytes of :func:`quicklook_figure`."""
    return to_png(quicklook_figure(output, options, caption))


def loss_curve_png(output: str | Path, options: Mapping[str, Any] | None = None) -> bytes | None:
    """PNG bytes of the training and validation loss per epoch, or None without training."""
    with open_output(output, options) as ds:
        if LOSS_VARIABLE not in ds:
            return None
        epoch = ds["epoch"].values
        train = ds[LOSS_VARIABLE].values
        val = ds["val_loss"].values
        best = ds.attrs.get("gridsolve_train_best_epoch")
        written = ds.attrs.get("gridsolve_train_weights_epoch")
    from matplotlib.figure import Figure  # not pyplot: no backend switch, nothing global
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(5, 3.4), dpi=80, layout="constrained")
    ax = fig.subplots()
    ax.plot(epoch, train, marker="o", label="training")
    if np.isfinite(val).any():
        ax.plot(epoch, val, marker="s", label="validation")
    if best is not None:
        ax.axvline(int(best), color="0.6", linestyle=":", label=f"best validation: epoch {best}")
    if written is not None and int(written) in epoch:
        at = int(np.flatnonzero(epoch == int(written))[0])
        ax.plot(
            [written] * 2,
            [train[at], val[at]],
            marker="o",
            markersize=11,
            markerfacecolor="none",
            markeredgecolor="k",
            linestyle="none",
            label=f"written weights: epoch {written}",
        )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean squared error")
    ax.set_yscale("log" if np.nanmin(train) > 0 else "linear")
    ax.set_title("training loss")
    ax.legend()
    return to_png(fig)
