"""The quick-look picture and the loss curve beside an output file, and their captions.

The maps are the first coefficient, the residual RMS (or, where that is the
same everywhere, what varies instead: the RMS of the fitted values or the
valid counts, the reason in the title) and, where the output has a trend with
p-values, the trend where it is significant. Each map is titled with its
variable's ``long_name`` and ``units`` and drawn on the map dims' coordinates;
the caption names the run, its deployment, the config keys that were set and
the solve status counts of the whole file.

A cube with more batch dims than y and x is shown at their first index.

A picture is not redrawn for an output file it was already drawn from (same
file: size, mtime, inode; same deployment and config keys; same drawing code
and matplotlib): a fully cached rerun reuses it, and its caption names the run
that drew it. What the maps show is :mod:`.maps`; drawing them, :mod:`.drawing`,
imported (with xarray and matplotlib) only to draw.
"""

from __future__ import annotations

import base64
import functools
import importlib.metadata
import json
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
from pydantic import BaseModel

from gridsolve.stages.engine import storage
from gridsolve.stages.engine.provenance import STAMP_KEY, png_text

#: The variable a training adds to the output that the loss curve draws.
LOSS_VARIABLE = "train_loss"


@dataclass(frozen=True)
class Caption:
    """What the caller knows about the run and the output file does not say.

    ``run``: the flow run's name; ``deployment``: the deployment's name (None
    for a CLI or local run); ``config``: the config keys that were set, as
    :func:`config_summary` writes them.
    """

    run: str | None = None
    deployment: str | None = None
    config: str = ""


def _short(value: Any, width: int) -> str:
    """``value`` as a short text: a long one keeps its end (a path's file name) after '…'."""
    text = value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def config_summary(cfg: BaseModel, width: int = 420, value_width: int = 28) -> str:
    """The keys of ``cfg``'s sections that were set, e.g. ``solve.impl=lstsq, solve.policy=…``.

    A section with a key set also shows its ``impl``; values longer than
    ``value_width`` keep their end, and the whole is cut to ``width`` characters.
    """
    items: list[str] = []
    for name in type(cfg).model_fields:
        section = getattr(cfg, name)
        if not isinstance(section, BaseModel):
            if name in cfg.model_fields_set:
                items.append(f"{name}={_short(section, value_width)}")
            continue
        keys = [k for k in type(section).model_fields if k in section.model_fields_set]
        if keys and "impl" in type(section).model_fields and "impl" not in keys:
            keys.insert(0, "impl")
        items += [f"{name}.{k}={_short(getattr(section, k), value_width)}" for k in keys]
    text = ", ".join(items)
    return text if len(text) <= width else text[: width - 1] + "…"


def _output_name(output: str | Path) -> str:
    return str(output).rstrip("/").rsplit("/", 1)[-1]


def caption_text(
    output: str | Path, caption: Caption | None, status: str, width_chars: int = 120
) -> str:
    """The figure's caption: run, deployment, output, config keys set, status counts."""
    lines = []
    if caption is not None:
        run = f"run {caption.run}" if caption.run else "unnamed run"
        deployment = f"deployment {caption.deployment}" if caption.deployment else "no deployment"
        lines.append(f"{run} · {deployment} · output {_output_name(output)}")
        if caption.config:
            lines.append(f"config: {caption.config}")
    else:
        lines.append(f"output {_output_name(output)}")
    if status:
        lines.append(status)
    return "\n".join(
        w for line in lines for w in textwrap.wrap(line, width_chars, break_on_hyphens=False)
    )


def _beside(output: str | Path, suffix: str) -> Path | str:
    """Where the picture ``suffix`` of ``output`` goes: ``<output>.<suffix>.png``."""
    return storage.at(f"{output}.{suffix}.png").native()


def _write_beside(
    output: str | Path, suffix: str, png: bytes, options: Mapping[str, Any] | None = None
) -> Path | str:
    path = _beside(output, suffix)
    storage.at(path, options).write_bytes(png)  # whole or absent
    return path


def drawn_from(output: str | Path, caption: Caption | None) -> str | None:
    """What identifies the picture of a local ``output`` (None for a URL or a missing file).

    The file's identity (path, size, mtime, inode) and the caption's deployment
    and config, not its run name.
    """
    st = storage.at(output).stat()  # an object has no inode or mtime to stamp
    if st is None:
        return None
    said = (caption.deployment, caption.config) if caption is not None else None
    return json.dumps([str(output), st.st_size, st.st_mtime_ns, st.st_ino, said, _drawing()])


@functools.cache
def _drawing() -> str:
    """What draws the picture: the sources of this package's modules and matplotlib's version."""
    here = Path(__file__).parent
    code = b"".join((here / f"{m}.py").read_bytes() for m in ("pictures", "maps", "drawing"))
    source = xxhash.xxh3_64_hexdigest(code)
    return f"{source}/matplotlib {importlib.metadata.version('matplotlib')}"


def write_quicklook(
    output: str | Path, options: Mapping[str, Any] | None = None, caption: Caption | None = None
) -> tuple[Path | str, bytes, bool]:
    """Write ``<output>.quicklook.png`` beside the output (atomically); path, bytes, reused.

    A picture already beside the output and drawn from this very file (see
    :func:`drawn_from`) is returned as it is (``reused``), not drawn again.
    """
    found = drawn_before(output, caption)
    if found is not None:
        return found[0], found[1], True
    from gridsolve.report.drawing import quicklook_figure, to_png

    stamp = drawn_from(output, caption)  # before drawing: a file replaced meanwhile differs
    png = to_png(quicklook_figure(output, options, caption), stamp)
    return _write_beside(output, "quicklook", png, options), png, False


def drawn_before(output: str | Path, caption: Caption | None) -> tuple[Path, bytes] | None:
    """The quick look beside ``output`` and its bytes, if drawn from this very file; else None."""
    stamp = drawn_from(output, caption)
    if stamp is None:
        return None
    existing = Path(_beside(output, "quicklook"))  # a local file: stamps are local only
    try:
        png = existing.read_bytes()
    except OSError:
        return None
    return (existing, png) if png and png_text(png).get(STAMP_KEY) == stamp else None


def write_loss_curve(
    output: str | Path, options: Mapping[str, Any] | None = None
) -> tuple[Path | str, bytes] | None:
    """Write ``<output>.loss.png`` beside the output when it holds a training's losses."""
    if not _may_hold(output, LOSS_VARIABLE):
        return None
    from gridsolve.report.drawing import loss_curve_png

    png = loss_curve_png(output, options)
    return None if png is None else (_write_beside(output, "loss", png, options), png)


def _may_hold(output: str | Path, variable: str) -> bool:
    """False when a local output certainly has no ``variable``; True when it has, or may have.

    Read without xarray (opening the output with it costs a run that never trained
    0.2–0.5 s of imports): a NetCDF file's variables with netCDF4, a Zarr store's
    consolidated metadata. An object in a bucket is opened to find out.
    """
    path = storage.at(output).native()
    if not isinstance(path, Path):
        return True
    try:
        if path.is_dir():
            listed = json.loads((path / ".zmetadata").read_text())["metadata"]
            return f"{variable}/.zarray" in listed
        import netCDF4

        with netCDF4.Dataset(path) as nc:
            return variable in nc.variables
    except (OSError, ValueError, KeyError, TypeError):
        return True  # whatever it is, the drawing code says


def markdown(
    png: bytes,
    path: Path | str,
    output: str | Path,
    title: str = "quick look",
    reused: bool = False,
) -> str:
    """Markdown showing the picture inline, with where the file and the picture are."""
    data = base64.b64encode(png).decode("ascii")
    note = (
        "  \nThe output file is unchanged since this picture was drawn "
        "(by the run named in its caption)."
        if reused
        else ""
    )
    return (
        f"### gridsolve {title}\n\n![{title}](data:image/png;base64,{data})\n\n"
        f"Output: `{output}`  \nPicture: `{path}`{note}\n"
    )
