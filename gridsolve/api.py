"""The Python API: fit an xarray object in this process, as ``gridsolve run`` fits a file.

``gridsolve.fit(da, design={...})`` runs the same plan and the same stage functions as the
Prefect flow, without Prefect or a server, and returns what the NetCDF writer writes, as
an in-memory :class:`xarray.Dataset`.

Decisions, written down here because nobody else will:

- The data reach the load stage as a NetCDF file in a private temporary folder (under
  ``TMPDIR``): the load stage's checks, CF decoding and content hash are then exactly the
  CLI's, and a dask-backed object is written chunk by chunk and read back tile by tile,
  never held whole. The cost is one write of the input at disk speed.
- The result is the NetCDF writer's file, opened and loaded, then the folder is removed:
  the variables, attributes and numbers are the file's by construction. That file is
  written uncompressed (``zlib: false``): it is read back at once, and a result saved
  with ``to_netcdf`` is then written as xarray writes any dataset (uncompressed unless
  ``encoding=`` asks), as xarray's own ``polyfit`` results and cdo's are. Compressing
  it cost a warm 50 × 500 × 500 trend fit about a third of its time, once in the
  writer and again in the user's ``to_netcdf`` (issue 29).
- With ``cache=folder`` the stage keys are the CLI's: they cover the input's content,
  never its path, so a later ``gridsolve run`` of the equivalent config on the file the
  data came from reuses every stage up to the writer (whose key names its own output
  path, and which writes that file).
- No xarray accessor: ``gridsolve.fit(da, ...)`` is one line already, and registering
  one would make ``import gridsolve`` (which every CLI call does) import xarray.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gridsolve.schemas.artifacts import ArtifactRef
from gridsolve.schemas.base import StageConfig
from gridsolve.schemas.errors import ConfigError, InputError
from gridsolve.schemas.execution import CacheConfig, ExecutionConfig
from gridsolve.schemas.metadata import WriteMeta
from gridsolve.schemas.pipeline import PipelineConfig, build_config, section

if TYPE_CHECKING:
    import xarray as xr

#: A stage argument: the YAML section as a dict, or its pydantic config.
Section = Mapping[str, Any] | StageConfig

#: The variable names the input file gives ``weights`` and ``target`` passed as arrays.
WEIGHTS_VAR, TARGET_VAR = "gridsolve_weights", "gridsolve_target"

#: What the provenance of a result names instead of the temporary input and output files.
IN_MEMORY_INPUT, IN_MEMORY_OUTPUT = "(data given to gridsolve.fit)", "(returned by gridsolve.fit)"

#: Encoding kept when the data are written for the load stage: a time's units, calendar
#: and stored dtype (the load stage hashes them, so the file hashes as the one the data
#: came from). Packing (scale_factor, add_offset, _Unsigned) and fill values are dropped:
#: values a user changed, or an unsigned type, would no longer fit them and be written
#: wrong; the values go as they are in memory, NaN for missing.
_KEPT_TIME_ENCODING = ("units", "calendar", "dtype")

log = logging.getLogger("gridsolve")


def _as_section(value: Section | None) -> dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, StageConfig):
        return section(value)
    if isinstance(value, Mapping):
        return dict(value)
    raise ConfigError(
        f"a stage argument must be a dict or a gridsolve config, not {type(value).__name__}",
        fix="pass e.g. design={'impl': 'polynomial', 'degree': 1}",
    )


def _input_dataset(
    data: xr.DataArray | xr.Dataset,
    variable: str | None,
    weights: xr.DataArray | str | None,
    target: xr.DataArray | str | None,
) -> tuple[xr.Dataset, dict[str, Any]]:
    """The dataset written for the load stage, and the load section's variable fields."""
    import xarray as xr

    fields: dict[str, Any] = {}
    if isinstance(data, xr.DataArray):
        name = str(data.name) if data.name is not None else "data"
        if variable is not None and variable != name:
            raise ConfigError(
                f"variable={variable!r} names a variable of a Dataset, but data is a "
                f"DataArray named {name!r}",
                fix="leave variable out for a DataArray, or pass the Dataset",
            )
        ds = data.to_dataset(name=name)
        fields["variable"] = name
    elif isinstance(data, xr.Dataset):
        ds = data.copy(deep=False)
        if variable is not None:
            fields["variable"] = variable
    else:
        raise InputError(
            f"data must be an xarray DataArray or Dataset, not {type(data).__name__}",
            stage="load",
            fix="wrap a numpy array first: xarray.DataArray(values, dims=('time', 'y', 'x'), "
            "coords={...})",
        )
    for role, value, var in (("weights", weights, WEIGHTS_VAR), ("target", target, TARGET_VAR)):
        if value is None:
            continue
        if isinstance(value, str):
            fields[role] = value
            continue
        if not isinstance(value, xr.DataArray):
            raise InputError(
                f"{role} must be a DataArray or the name of a variable of data, not "
                f"{type(value).__name__}",
                stage="load",
                fix=f"pass {role}=<DataArray on the data's grid> or {role}='<variable name>'",
            )
        try:
            xr.align(ds, value, join="exact")
        except ValueError as exc:
            raise InputError(
                f"{role} is not on the data's grid: their coordinates differ",
                stage="load",
                found=str(exc),
                fix=f"give {role} the data's coordinates, e.g. {role}.reindex_like(data) "
                "or .assign_coords(...) if they differ only by rounding",
            ) from None
        if var in ds.variables:
            raise InputError(
                f"data already has a variable named {var!r}, which {role} would replace",
                stage="load",
                fix=f"rename it, or pass {role} by that variable's name",
            )
        ds[var] = value
        fields[role] = var
    return ds, fields


def _for_writing(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` with only its times' encoding (see _KEPT_TIME_ENCODING)."""
    out = ds.copy(deep=False)
    for var in out.variables.values():  # ds[name] of an index would be a new object
        enc = var.encoding
        time_like = var.dtype.kind in "mM" and " since " in str(enc.get("units", ""))
        var.encoding = {k: v for k, v in enc.items() if k in _KEPT_TIME_ENCODING and time_like}
    return out


def _write_input(ds: xr.Dataset, path: Path) -> None:
    """Write ``ds`` for the load stage, its time units spelled as the source spelled them.

    xarray rewrites a time unit it encodes ('days since 2021-01-01 00:00:00' becomes
    'days since 2021-01-01'); the load stage hashes the spelling (the output copies it),
    so where both spellings decode the stored numbers to the same times, the original
    is put back and the file hashes as the one the data came from.
    """
    import netCDF4
    import numpy as np

    ready = _for_writing(ds)
    spelled = {
        str(name): str(var.encoding["units"])
        for name, var in ready.variables.items()
        if " since " in str(var.encoding.get("units", ""))
    }
    ready.to_netcdf(path)
    if not spelled:
        return
    with netCDF4.Dataset(path, "a") as nc:
        for name, units in spelled.items():
            var = nc.variables.get(name)
            written = getattr(var, "units", None) if var is not None else None
            if var is None or written in (None, units):
                continue
            calendar = getattr(var, "calendar", "standard")
            stored = np.ma.getdata(var[:]).ravel()
            try:
                same = bool(
                    np.all(
                        netCDF4.num2date(stored, written, calendar)
                        == netCDF4.num2date(stored, units, calendar)
                    )
                )
            except (ValueError, TypeError):  # a spelling cftime cannot read: keep xarray's
                same = False
            if same:
                var.setncattr("units", units)


@contextmanager
def _scratch() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="gridsolve-fit-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Progress:
    """Tiles and long stages shown with rich, in a terminal or a notebook; silent otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.bar: Any = None
        self.tasks: dict[str, Any] = {}
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import Progress

        console = Console(stderr=True)
        if console.is_terminal or console.is_jupyter:
            self.bar = Progress(console=console, transient=False)

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def _task(self, name: str, total: float) -> Any:
        if name not in self.tasks:
            self.tasks[name] = self.bar.add_task(name, total=total)
        return self.tasks[name]

    def tile(self, kind: str, done: int, total: int) -> None:
        """One more tile of stage ``kind`` finished."""
        if self.bar is not None:
            self.bar.update(self._task(f"{kind} tiles", total), completed=done)

    def stage(self, fraction: float, description: str) -> None:
        """A long stage's own progress (e.g. training epochs)."""
        if self.bar is not None:
            self.bar.update(self._task(description.split(":")[0], 1.0), completed=fraction)

    def callbacks(self) -> tuple[Callable[[str, int, int], None], Callable[[float, str], None]]:
        """``on_tile`` and the stages' ``progress``."""
        return self.tile, self.stage


def config(
    *,
    load: Section,
    design: Section | None = None,
    normal_equations: Section | None = None,
    solve: Section | None = None,
    train: Section | None = None,
    model: Section | None = None,
    write: Section | None = None,
    cache: Mapping[str, Any] | CacheConfig | None = None,
    execution: Mapping[str, Any] | ExecutionConfig | None = None,
) -> PipelineConfig:
    """A validated run config from sections (dicts or configs): what ``gridsolve run`` reads.

    ``config(...).to_yaml()`` is the YAML file to schedule what a notebook fitted.
    Raises one :class:`ConfigError` with every problem, as the CLI prints it.
    """
    raw: dict[str, Any] = {"load": _as_section(load)}
    for name, value in (
        ("design", design),
        ("normal_equations", normal_equations),
        ("solve", solve),
        ("train", train),
        ("model", model),
        ("write", write),
    ):
        if value is not None:
            raw[name] = _as_section(value)
    for name, settings in (("cache", cache), ("execution", execution)):
        if isinstance(settings, CacheConfig | ExecutionConfig):
            raw[name] = settings.model_dump()
        elif settings is not None:
            raw[name] = dict(settings)
    return build_config(raw, source="gridsolve arguments")


def _run_plan(cfg: PipelineConfig, *, keep: bool, progress: bool) -> tuple[xr.Dataset, Path]:
    """Run ``cfg``'s plan in this process; the output it wrote, loaded, and its path.

    ``keep``: the cache is the user's (its size cap applies), not a scratch folder.
    """
    import xarray as xr

    from gridsolve.stages.engine.context import StageContext
    from gridsolve.stages.engine.plan import build_plan, run_locally
    from gridsolve.stages.engine.prune import run_housekeeping
    from gridsolve.stages.engine.store import open_store

    plan = build_plan(cfg.stage_configs())
    with (
        _Progress(progress) as bar,
        run_housekeeping(cfg.cache.root, cfg.cache.max_size_bytes if keep else None, log),
    ):
        on_tile, on_stage = bar.callbacks()
        ctx = StageContext(
            store=open_store(cfg.cache.root, cfg.cache.storage_options),
            memory_budget=cfg.execution.memory_budget_bytes,
            logger=log,
            progress=on_stage,
        )
        refs = run_locally(
            plan,
            ctx,
            tile_pixels=cfg.execution.tile_pixels,
            max_workers=cfg.execution.max_workers,
            on_tile=on_tile,
        )
    wrote = refs["write"]
    assert isinstance(wrote, ArtifactRef)  # the writer is a whole stage
    written = Path(WriteMeta.of(wrote).path)
    with xr.open_dataset(written) as out:
        return out.load(), written


def fit(
    data: xr.DataArray | xr.Dataset,
    *,
    design: Section | None = None,
    normal_equations: Section | None = None,
    solve: Section | None = None,
    model: Section | None = None,
    train: Section | None = None,
    variable: str | None = None,
    weights: xr.DataArray | str | None = None,
    target: xr.DataArray | str | None = None,
    obs_dim: str | None = None,
    y_dim: str | None = None,
    x_dim: str | None = None,
    execution: Mapping[str, Any] | ExecutionConfig | None = None,
    cache: str | Path | None = None,
    progress: bool = True,
) -> xr.Dataset:
    """Fit every pixel of ``data`` in this process; the output dataset ``gridsolve run`` writes.

    ``data`` is a DataArray (or a Dataset, with ``variable`` naming the cube when it has
    several) with an observation dim and two grid dims, in memory or dask-backed. Stage
    arguments are the YAML sections, as dicts or configs; no ``model`` runs no model;
    ``solve={"impl": "curvefit", ...}`` fits a function of your own and takes no ``design``.
    ``weights``/``target`` are DataArrays on the data's grid or names of variables of
    ``data``; ``obs_dim``/``y_dim``/``x_dim`` name dims the CF metadata do not. With
    ``cache`` a folder, stage outputs are stored there under the CLI's keys; without,
    nothing is kept. ``progress`` shows tiles and epochs in a terminal or notebook.

    Raises the package's errors (:class:`gridsolve.schemas.errors.GridsolveError`), with
    the messages the CLI prints.
    """
    ds, fields = _input_dataset(data, variable, weights, target)
    dims = {"obs_dim": obs_dim, "y_dim": y_dim, "x_dim": x_dim}
    fields.update({k: v for k, v in dims.items() if v is not None})
    with _scratch() as tmp:
        source, output = tmp / "input.nc", tmp / "output.nc"
        cache_root = str(Path(cache).expanduser().resolve()) if cache is not None else None
        # Validated before the data are written: a bad argument costs no I/O.
        cfg = config(
            load={"impl": "netcdf", "path": str(source), **fields},
            design=design,
            normal_equations=normal_equations,
            solve=solve,
            train=train,
            model=model,
            write={"impl": "netcdf", "path": str(output), "zlib": False},
            cache={"root": cache_root or str(tmp / "cache")},
            execution=execution,
        )
        _write_input(ds, source)
        result, written = _run_plan(cfg, keep=cache_root is not None, progress=progress)
    # Provenance names no temporary file that is gone by now.
    said = str(result.attrs.get("gridsolve_config", ""))
    said = said.replace(str(source), IN_MEMORY_INPUT).replace(str(written), IN_MEMORY_OUTPUT)
    if said:
        result.attrs["gridsolve_config"] = _without_scratch_encoding(said)
    return result


def _without_scratch_encoding(said: str) -> str:
    """The recorded config with the writer's default compression, not the scratch file's.

    The scratch file's ``zlib: false`` was this module's choice, not the user's: a config
    rebuilt from the provenance writes as ``gridsolve run`` does by default.
    """
    import json

    from gridsolve.schemas.kinds.write import NetCDFWrite

    try:
        config = json.loads(said)
    except ValueError:
        return said
    write = config.get("write") if isinstance(config, dict) else None
    if not isinstance(write, dict) or "zlib" not in write:
        return said
    write["zlib"] = NetCDFWrite.model_fields["zlib"].default
    return json.dumps(config, sort_keys=True)
