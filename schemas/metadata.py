"""Each stage kind's metadata: one typed model per kind (and part), read as attributes.

A stage returns small JSON metadata beside its arrays; the runner stores it in
the artifact's manifest and checks it against its kind's model (the keys a
model lists without a default are required; implementations may add more).
Every consumer — a later stage, the writers, the flow, the Python API — reads
another kind's metadata through that kind's model, ``LoadMeta.of(load).y_dim``,
never by string key (an AST test, ``tests/schemas/test_metadata.py``): a
renamed or retyped key is a type error where it is read, not a ``KeyError``
mid-run. The models live here, with the other data contracts, rather than in
each kind's package, so that consumers which must know no kind (the writers)
can still read them typed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.errors import StageError


class Meta(BaseModel):
    """Base of a kind's metadata contract: the keys listed are required, others allowed."""

    model_config = ConfigDict(extra="allow")

    @classmethod
    def of(cls, source: Any) -> Self:
        """The typed metadata of ``source``: an artifact (anything with ``.meta``) or a mapping."""
        if isinstance(source, cls):
            return source
        meta: Mapping[str, Any] = getattr(source, "meta", source)
        return cls.model_validate(dict(meta))


class Labelled(Meta):
    """What any tiled stage's prepared metadata may hold: names along the dims it labels.

    ``dim_labels``: dim → one name per index (curvefit's ``param``); the writers
    write them as that dim's coordinate and a ``<dim>_name`` label variable.
    """

    dim_labels: dict[str, list[str]] = Field(default_factory=dict)


# ---------------------------------------------------------------- load
class AuxInfo(BaseModel):
    """One helper variable the load stage read beside the cube (design, weights or target)."""

    model_config = ConfigDict(extra="allow")

    name: str
    dims: list[str] = Field(default_factory=list)
    #: weights: one set shared by every pixel (dims obs only)
    shared: bool = False
    #: target: its output dim (None: one output) and that dim's size
    out_dim: str | None = None
    n_out: int = 1
    #: design: the dim of its columns, and the units of its values
    coef_dim: str | None = None
    units: str | None = None


class LoadMeta(Meta):
    """What every later stage may read from the load stage's metadata."""

    variable: str
    dims: list[str]
    obs_dim: str
    y_dim: str
    x_dim: str
    n_obs: int
    ny: int
    nx: int
    #: batch dims besides y and x (member, level, …) and their sizes, folded into the
    #: grid's rows ahead of y (see :meth:`grid_shape`)
    lead_dims: list[str] = Field(default_factory=list)
    lead_shape: list[int] = Field(default_factory=list)
    dtype: str
    #: helper variables by role: ``design``, ``weights``, ``target``
    aux: dict[str, AuxInfo]
    content_hash: str
    #: the cube's kept CF attributes (units, long_name, …)
    attrs: dict[str, Any] = Field(default_factory=dict)
    #: per coordinate role (``obs``, ``y``, ``x``, ``lead:<dim>``): its kept attributes
    coord_attrs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    #: per coordinate role: how the writer stores it (CF encoding, bounds)
    coord_cf: dict[str, dict[str, Any]] = Field(default_factory=dict)
    history: str = ""
    #: the largest finite |value| of the cube (None: none finite, or not measured)
    abs_max: float | None = None
    #: a design variable's column names, from its coordinate
    design_columns: list[str] | None = None
    #: ``load.isel``/``load.select`` as positions: ``[[dim, index or [indices]], …]``
    selection: list[list[Any]] = Field(default_factory=list)
    #: scalar coordinates carried to the output: name → value, kind, attrs
    scalar_coords: dict[str, dict[str, Any]] = Field(default_factory=dict)
    #: 2-D (y, x) coordinates carried (stored as ``aux:<name>`` arrays): name → attrs, dtype
    grid_coords: dict[str, dict[str, Any]] = Field(default_factory=dict)

    def grid_shape(self) -> tuple[int, int]:
        """(rows, columns) of the grid tiled stages see: the batch dims and y folded into rows."""
        planes = int(np.prod(self.lead_shape, dtype=np.int64))
        return planes * self.ny, self.nx

    def pixel_name(self, row: int, col: int) -> str:
        """The cube's own coordinates of grid position (row, col), e.g. ``member=1, lat=3``."""
        plane, y = divmod(row, self.ny)
        index = np.unravel_index(plane, tuple(self.lead_shape)) if self.lead_dims else ()
        parts = [f"{d}={int(i)}" for d, i in zip(self.lead_dims, index, strict=True)]
        return ", ".join([*parts, f"{self.y_dim}={y}", f"{self.x_dim}={col}"])

    def plane_window(self, tile: Tile) -> dict[str, Any]:
        """The ``.isel`` window of ``tile`` in the cube's own dims.

        The grid's rows are the cube's batch dims (member, level, …) and y folded
        together, in C order: row ``r`` is y ``r % ny`` of plane ``r // ny``. A tile
        never spans two planes (the load implementation's ``grid``), so its window is
        one hyperslab.
        """
        plane, r0 = divmod(tile.y0, self.ny)
        if r0 + (tile.y1 - tile.y0) > self.ny:
            raise StageError(
                f"tile rows {tile.y0}:{tile.y1} span two planes of {self.ny} rows",
                stage="load",
                fix="plan tiles with the load stage's grid (its plane rows)",
            )
        index = np.unravel_index(plane, tuple(self.lead_shape)) if self.lead_dims else ()
        window: dict[str, Any] = {d: int(i) for d, i in zip(self.lead_dims, index, strict=True)}
        window[self.y_dim] = slice(r0, r0 + tile.y1 - tile.y0)
        window[self.x_dim] = slice(tile.x0, tile.x1)
        return window


# ---------------------------------------------------------------- design
class TrendColumn(BaseModel):
    """The design column whose coefficient is a linear trend: trend = coefficient / scale."""

    column: int
    scale: float
    #: the raw axis unit the trend is per (``days``, ``hours``, …); None: unknown
    per: str | None = None


class HarmonicColumns(BaseModel):
    """Which design columns are harmonic ``k``'s cosine and sine."""

    k: int
    cos: int
    sin: int


class DesignMeta(Meta):
    """What later stages and the writer read about the design."""

    coef: int
    rank: int
    cond: float
    columns: list[str]
    #: ``polynomial``, ``harmonic``, ``variable``, or a plugin's own
    basis: str = ""
    column_units: list[str | None] | None = None
    trend: TrendColumn | None = None
    harmonics: list[HarmonicColumns] = Field(default_factory=list)
    period: float | None = None
    #: the axis the columns are functions of: centre, half-width and units
    t_centre: float | None = None
    t_scale: float | None = None
    t_units: str | None = None
    #: the raw observation axis's unit (the trend is per it)
    axis_step: str | None = None

    @model_validator(mode="after")
    def _harmonics_have_a_period(self) -> Self:
        if self.harmonics and self.period is None:
            raise ValueError("a design with harmonics must give their period")
        return self

    def describe(self) -> str:
        """One line for the run summary."""
        return f"{self.coef} coefficients, rank {self.rank}, condition number {self.cond:.3g}"


# ---------------------------------------------------------------- normal equations
class NormalEquationsMeta(Meta):
    """Rank and conditioning of the weighted shared design."""

    rank: int
    cond: float


# ---------------------------------------------------------------- solve
class SolvePrepared(Meta):
    """The once-per-stage part: sizes every tile and the model stage rely on."""

    coef: int
    obs: int
    #: the shared design's coefficients its rows do not determine (gap-free pixels)
    undetermined_columns: list[int] = Field(default_factory=list)
    #: ``none``, ``stderr`` or ``cov`` (the solve config's ``uncertainty``)
    uncertainty: str = "none"
    #: ``residual``: covariances scaled by the residual variance; ``unscaled``: known errors
    cov_scale: str = "residual"
    #: the meaning of each ``status`` code, where the implementation has its own
    #: (``curvefit``); None: the linear solve's (``schemas.contracts.STATUS_FLAGS``)
    status_flags: dict[int, str] | None = None


class CurvefitPrepared(SolvePrepared):
    """The ``curvefit`` solve's own prepared metadata: the function and its parameters."""

    #: the import path of the user's function (``solve.target``)
    target: str
    params: list[str]
    #: what the function receives as t (``solve.t``)
    t: str


class SolveTile(Meta):
    """Per-tile counts of each status (summed for the run summary)."""

    status_counts: dict[str, int]


# ---------------------------------------------------------------- model
class ModelPrepared(Meta):
    """What the tiles, the tile plan and the writer read about the model."""

    params: dict[str, list[int]]
    buffers: dict[str, list[int]] = Field(default_factory=dict)
    #: each parameter's dim names, and the input's (None: the model names none)
    param_dims: dict[str, list[str]] = Field(default_factory=dict)
    input_dims: list[str] | None = None
    #: what the per-sample gradients are of: ``sum`` of the outputs, or ``mse``
    objective: str | None = None
    input_shape: list[int]
    n_out: int
    dtype: str
    wrt: str
    jacobian: bool


class ModelTile(Meta):
    """Per-tile counts of each model status (summed for the run summary)."""

    model_status_counts: dict[str, int]


# ---------------------------------------------------------------- train
class TrainMeta(Meta):
    """What the model stage, the writer and the run summary read about a training run."""

    epochs_run: int
    steps: int
    params: dict[str, list[int]]
    counts: dict[str, int]
    history: list[dict[str, Any]]
    epsilon: float | None
    delta: float
    best_epoch: int | None
    weights_epoch: int
    weights_from: str

    def describe(self) -> str:
        """One line for the run summary."""
        last = self.history[-1]["train_loss"] if self.history else None
        return (
            f"{self.epochs_run} epoch(s), {self.steps} steps, "
            f"{self.counts.get('train_pixels', 0)} training pixels, "
            f"weights of epoch {self.weights_epoch} ({self.weights_from}), "
            f"last training loss {last}"
        )


# ---------------------------------------------------------------- write
class Published(Meta):
    """Any stage's metadata as the flow reads it: where the stage published an output, if it did."""

    path: str | None = None


class WriteMeta(Published):
    """Where the output is (the run summary names it), and how to tell it is intact."""

    path: str
    storage_options: dict[str, Any] = Field(default_factory=dict)
    #: files written beside the output (weights, pictures): name → identity facts
    side_files: dict[str, Any] = Field(default_factory=dict)
