"""The stage plan: which stages run, in which order, whole or tiled, in how many tiles.

Everything here comes from the stages' declarations (:class:`StageDecl`),
never from a list of kinds: the order from each declaration's ``inputs`` (as
Kedro orders nodes), whole vs tiled from ``tiled``, the grid from the stage
that declares ``grid``, each tiled stage's memory per pixel from its
``pixel_bytes``, and the tiles' alignment from the stage that declares
``alignment`` (the writer). A run has three phases: the whole stages that no
tiled stage precedes, then every tiled stage (prepare steps, then tiles),
then the whole stages that read tiled results. The Prefect flow
(``gridsolve.flows.pipeline``) turns a plan into tasks; :func:`run_locally`
runs the same plan without Prefect (tests, notebooks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gridsolve.schemas.artifacts import ArtifactRef, Tile, TiledRef
from gridsolve.schemas.base import StageConfig
from gridsolve.schemas.errors import ConfigError
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.registry import StageDecl, decl_for
from gridsolve.stages.engine.tiles import plan_tiles

Ref = ArtifactRef | TiledRef


@dataclass(frozen=True)
class Step:
    """One stage of a plan: its kind, validated config and declaration."""

    kind: str
    config: StageConfig
    decl: StageDecl

    @property
    def name(self) -> str:
        """``kind/impl``, as messages and logs name a stage."""
        return f"{self.kind}/{self.decl.impl}"


@dataclass(frozen=True)
class Plan:
    """Stages in run order, split into the three phases of a run."""

    steps: tuple[Step, ...]

    @property
    def before(self) -> tuple[Step, ...]:
        """Whole stages that run before any tiled stage (nothing tiled upstream)."""
        return tuple(s for s in self.steps if not s.decl.tiled and not self._after_tiles(s))

    @property
    def tiled(self) -> tuple[Step, ...]:
        """Tiled stages, in order."""
        return tuple(s for s in self.steps if s.decl.tiled)

    @property
    def after(self) -> tuple[Step, ...]:
        """Whole stages that read tiled results (the writer)."""
        return tuple(s for s in self.steps if not s.decl.tiled and self._after_tiles(s))

    def _upstream(self, step: Step) -> set[str]:
        by_kind = {s.kind: s for s in self.steps}
        seen: set[str] = set()
        todo = list(step.decl.inputs)
        while todo:
            k = todo.pop()
            if k not in seen:
                seen.add(k)
                todo += list(by_kind[k].decl.inputs)
        return seen

    def _after_tiles(self, step: Step) -> bool:
        tiled = {s.kind for s in self.steps if s.decl.tiled}
        return bool(self._upstream(step) & tiled)

    def step(self, kind: str) -> Step:
        """The step of ``kind``."""
        for s in self.steps:
            if s.kind == kind:
                return s
        raise KeyError(kind)

    def tiles(
        self, refs: Mapping[str, Ref], memory_budget: int, tile_pixels: int | None
    ) -> list[Tile]:
        """The tile plan: half the budget for the heaviest tiled stage's arrays per pixel."""
        grid_steps = [s for s in self.before if s.decl.grid is not None]
        if len(grid_steps) != 1:
            raise ConfigError(
                f"the plan needs exactly one stage that declares the grid; found "
                f"{[s.name for s in grid_steps] or 'none'}",
                fix="declare `grid` on the load implementation's StageDecl",
            )
        source = grid_steps[0]
        grid_meta = meta_of(refs[source.kind])
        assert source.decl.grid is not None
        ny, nx = source.decl.grid(grid_meta)
        align = (1, 1)
        for s in self.after:
            if s.decl.alignment is not None:
                align = s.decl.alignment(s.config, grid_meta)
        if tile_pixels is None:
            per_px = max(
                [1]
                + [
                    int(s.decl.pixel_bytes(meta_of(refs[s.kind])))
                    for s in self.tiled
                    if s.decl.pixel_bytes is not None
                ]
            )
            tile_pixels = max(1, (memory_budget // 2) // per_px)
        return plan_tiles(ny, nx, tile_pixels, *align)


def meta_of(ref: Ref) -> dict[str, Any]:
    """Metadata of a whole stage's artifact, or of a tiled stage's prepare step."""
    return dict(ref.prepared.meta if isinstance(ref, TiledRef) else ref.meta)


def build_plan(configs: Mapping[str, StageConfig]) -> Plan:
    """The plan of validated stage configs (by kind), ordered by their declared inputs.

    Ties keep the order of ``configs``. Every problem is reported at once: an
    input no stage provides, a cycle, a tiled stage without a prepare step, a
    tiled stage fed by a whole stage that itself reads tiled results.
    """
    steps = {kind: Step(kind, conf, decl_for(conf)) for kind, conf in configs.items()}
    problems: list[str] = []
    for s in steps.values():
        for k in s.decl.inputs:
            if k not in steps:
                problems.append(f"{s.name} reads {k!r}, which no stage of the run provides")
        if s.decl.tiled and s.decl.prepare is None:
            problems.append(f"{s.name} is tiled but declares no prepare step")
    if problems:
        raise ConfigError(
            "the stages do not form a pipeline",
            violations=problems,
            fix="check each StageDecl's inputs, tiled and prepare fields",
        )
    order: list[Step] = []
    done: set[str] = set()
    while len(order) < len(steps):
        ready = [
            s for k, s in steps.items() if k not in done and all(i in done for i in s.decl.inputs)
        ]
        if not ready:
            left = sorted(set(steps) - done)
            raise ConfigError(
                f"the stages' inputs form a cycle among {left}",
                fix="a stage may only read stages that do not read it",
            )
        order.append(ready[0])
        done.add(ready[0].kind)
    plan = Plan(tuple(order))
    late = {s.kind for s in plan.after}
    for s in plan.tiled:
        fed = [k for k in s.decl.inputs if k in late]
        if fed:
            problems.append(f"tiled {s.name} reads {fed}, which run after the tiles")
    if problems:
        raise ConfigError(
            "the stages cannot be run in phases", violations=problems, fix="check StageDecl.inputs"
        )
    return plan


def tile_inputs(
    step: Step,
    refs: Mapping[str, Ref],
    tile_refs: Mapping[str, Mapping[int, ArtifactRef]],
    tile: Tile,
) -> dict[str, Ref]:
    """The refs one tile of ``step`` reads: that tile of tiled inputs, whole inputs as they are."""
    return {k: tile_refs[k][tile.index] if k in tile_refs else refs[k] for k in step.decl.inputs}


def tiled_ref(step: Step, prepared: ArtifactRef, tiles: Sequence[ArtifactRef] = ()) -> TiledRef:
    """The ref of a tiled stage: its prepare step's ref and its tiles' refs, in tile order."""
    return TiledRef(
        kind=step.kind,
        impl=step.decl.impl,
        key=prepared.meta["_stage_key"],
        prepared=prepared,
        tiles=tuple(tiles),
    )


def summed_counts(step: Step, tile_metas: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The tile counts a tiled stage declares (``StageDecl.counts``), summed over its tiles."""
    out: dict[str, int] = {}
    if step.decl.counts is None:
        return out
    for meta in tile_metas:
        for name, n in (meta.get(step.decl.counts) or {}).items():
            out[str(name)] = out.get(str(name), 0) + int(n)
    return out


def run_locally(
    plan: Plan,
    ctx: StageContext,
    *,
    tile_pixels: int | None = None,
    tiles: Sequence[Tile] | None = None,
) -> dict[str, Ref]:
    """Run ``plan`` in this process with the generic runner (no Prefect); the refs by kind."""
    from gridsolve.stages.engine.runner import prepare_stage, run_stage, run_tile

    refs: dict[str, Ref] = {}
    for s in plan.before:
        refs[s.kind] = run_stage(s.config, {k: refs[k] for k in s.decl.inputs}, ctx).ref
    prepared: dict[str, ArtifactRef] = {}
    for s in plan.tiled:
        run = prepare_stage(s.config, {k: refs[k] for k in s.decl.inputs}, ctx)
        prepared[s.kind] = run.ref
        refs[s.kind] = tiled_ref(s, run.ref)
    tile_list = (
        list(tiles) if tiles is not None else plan.tiles(refs, ctx.memory_budget, tile_pixels)
    )
    tile_refs: dict[str, dict[int, ArtifactRef]] = {}
    for s in plan.tiled:
        by_index = {
            t.index: run_tile(
                s.config, tile_inputs(s, refs, tile_refs, t), prepared[s.kind], t, ctx
            ).ref
            for t in tile_list
        }
        tile_refs[s.kind] = by_index
        refs[s.kind] = tiled_ref(s, prepared[s.kind], [by_index[t.index] for t in tile_list])
    for s in plan.after:
        refs[s.kind] = run_stage(s.config, {k: refs[k] for k in s.decl.inputs}, ctx).ref
    return refs
