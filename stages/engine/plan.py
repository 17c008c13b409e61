"""The stage plan: which stages run, in which order, whole or tiled, in how many tiles.

Everything here comes from the stages' declarations (:class:`StageDecl`),
never from a list of kinds: the order from each declaration's ``inputs`` (as
Kedro orders nodes), whole vs tiled from ``tiled``, the grid from the stage
that declares ``grid``, each tiled stage's memory per pixel from its
``pixel_bytes``, and the tiles' alignment from the stage that declares
``alignment`` (the writer). A run is a sequence of segments in that order:
each whole stage alone, each run of consecutive tiled stages together (their
prepare steps, then their tiles); a whole stage may sit between two tiled
segments (``train`` reads every solve tile and the model's tiles read it).
Every tiled stage of a run uses one tile plan, made when the first tiled
segment is prepared. A stage whose config is not ``active`` (``train: none``)
is left out, and a stage's ``optional_inputs`` are read only when present,
so a run without it is the run it was before that stage existed. The Prefect flow
(``gridsolve.flows.pipeline``) turns a plan into tasks; :func:`run_locally`
runs the same plan without Prefect (tests, notebooks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gridsolve.schemas.artifacts import ArtifactRef, Tile, TiledRef
from gridsolve.schemas.base import StageConfig
from gridsolve.schemas.errors import ConfigError
from gridsolve.stages.engine.context import StageContext, tile_share
from gridsolve.stages.engine.registry import StageDecl, decl_for
from gridsolve.stages.engine.tiles import plan_tiles

Ref = ArtifactRef | TiledRef


@dataclass(frozen=True)
class Step:
    """One stage of a plan: its kind, validated config, declaration and what it reads."""

    kind: str
    config: StageConfig
    decl: StageDecl
    #: the kinds whose outputs it reads: its required inputs and the optional ones present
    inputs: tuple[str, ...] = ()
    #: the configs of other kinds it reads (``StageDecl.peers``), by kind
    peers: Mapping[str, StageConfig] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """``kind/impl``, as messages and logs name a stage."""
        return f"{self.kind}/{self.decl.impl}"


@dataclass(frozen=True)
class Segment:
    """Stages that run together: one whole stage, or consecutive tiled stages."""

    tiled: bool
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Plan:
    """Stages in run order, grouped into segments."""

    steps: tuple[Step, ...]

    @property
    def segments(self) -> tuple[Segment, ...]:
        """Each whole stage alone, each run of consecutive tiled stages together, in order."""
        out: list[Segment] = []
        for s in self.steps:
            if s.decl.tiled and out and out[-1].tiled:
                out[-1] = Segment(True, (*out[-1].steps, s))
            else:
                out.append(Segment(s.decl.tiled, (s,)))
        return tuple(out)

    @property
    def tiled(self) -> tuple[Step, ...]:
        """Tiled stages, in order."""
        return tuple(s for s in self.steps if s.decl.tiled)

    def step(self, kind: str) -> Step:
        """The step of ``kind``."""
        for s in self.steps:
            if s.kind == kind:
                return s
        raise KeyError(kind)

    def tiles(
        self, refs: Mapping[str, Ref], memory_budget: int, tile_pixels: int | None
    ) -> list[Tile]:
        """The tile plan: a share of the budget for the heaviest prepared tiled stage per pixel.

        Tiled stages whose prepare step has not run yet (in a later segment) do
        not count: the plan is made once, for the whole run.
        """
        grid_steps = [s for s in self.steps if s.decl.grid is not None]
        if len(grid_steps) != 1:
            raise ConfigError(
                f"the plan needs exactly one stage that declares the grid; found "
                f"{[s.name for s in grid_steps] or 'none'}",
                fix="declare `grid` on the load implementation's StageDecl",
            )
        source = grid_steps[0]
        grid_meta = meta_of(refs[source.kind])
        assert source.decl.grid is not None
        ny, nx, *plane = source.decl.grid(grid_meta)
        align = (1, 1)
        for s in self.steps:
            if s.decl.alignment is not None:
                align = s.decl.alignment(s.config, grid_meta)
        if tile_pixels is None:
            per_px = max(
                [1]
                + [
                    int(s.decl.pixel_bytes(meta_of(refs[s.kind])))
                    for s in self.tiled
                    if s.decl.pixel_bytes is not None and s.kind in refs
                ]
            )
            tile_pixels = max(1, tile_share(memory_budget) // per_px)
        return plan_tiles(ny, nx, tile_pixels, *align, plane_rows=plane[0] if plane else None)


def meta_of(ref: Ref) -> dict[str, Any]:
    """Metadata of a whole stage's artifact, or of a tiled stage's prepare step."""
    return dict(ref.prepared.meta if isinstance(ref, TiledRef) else ref.meta)


def _steps(configs: Mapping[str, StageConfig]) -> tuple[dict[str, Step], list[str]]:
    """The active stages as steps (inputs and peers resolved), and every problem found."""
    active = {k: c for k, c in configs.items() if c.active}
    problems: list[str] = []
    steps: dict[str, Step] = {}
    for kind, conf in active.items():
        decl = decl_for(conf)
        name = f"{kind}/{decl.impl}"
        for k in decl.inputs:
            if k not in active:
                problems.append(f"{name} reads {k!r}, which no stage of the run provides")
        for k in decl.peers:
            if k not in configs:
                problems.append(f"{name} reads the config of {k!r}, which the run does not have")
        if decl.tiled and decl.prepare is None:
            problems.append(f"{name} is tiled but declares no prepare step")
        inputs = (*decl.inputs, *(k for k in decl.optional_inputs if k in active))
        peers = {k: configs[k] for k in decl.peers if k in configs}
        steps[kind] = Step(kind, conf, decl, inputs, peers)
    return steps, problems


def build_plan(configs: Mapping[str, StageConfig]) -> Plan:
    """The plan of validated stage configs (by kind), ordered by their declared inputs.

    Ties keep the order of ``configs``; inactive stages are left out. Every
    problem is reported at once: an input no stage provides, a cycle, a tiled
    stage without a prepare step.
    """
    steps, problems = _steps(configs)
    if problems:
        raise ConfigError(
            "the stages do not form a pipeline",
            violations=problems,
            fix="check each StageDecl's inputs, tiled and prepare fields",
        )
    order: list[Step] = []
    done: set[str] = set()
    while len(order) < len(steps):
        ready = [s for k, s in steps.items() if k not in done and all(i in done for i in s.inputs)]
        if not ready:
            left = sorted(set(steps) - done)
            raise ConfigError(
                f"the stages' inputs form a cycle among {left}",
                fix="a stage may only read stages that do not read it",
            )
        order.append(ready[0])
        done.add(ready[0].kind)
    return Plan(tuple(order))


def tile_inputs(
    step: Step,
    refs: Mapping[str, Ref],
    tile_refs: Mapping[str, Mapping[int, ArtifactRef]],
    tile: Tile,
) -> dict[str, Ref]:
    """The refs one tile of ``step`` reads: that tile of tiled inputs, whole inputs as they are.

    ``tile_refs`` holds the tiles of this segment's stages by tile index; a tiled
    input of an earlier segment is read from its ``TiledRef`` (tiles in plan order).
    """
    out: dict[str, Ref] = {}
    for k in step.inputs:
        ref = refs[k]
        if k in tile_refs:
            out[k] = tile_refs[k][tile.index]
        elif isinstance(ref, TiledRef):
            out[k] = ref.tiles[tile.index]
        else:
            out[k] = ref
    return out


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


def inputs_of(step: Step, refs: Mapping[str, Ref]) -> dict[str, Ref]:
    """The refs a whole stage or prepare step of ``step`` reads."""
    return {k: refs[k] for k in step.inputs}


def run_locally(
    plan: Plan,
    ctx: StageContext,
    *,
    tile_pixels: int | None = None,
    tiles: Sequence[Tile] | None = None,
    max_workers: int = 1,
    on_tile: Callable[[str, int, int], None] | None = None,
) -> dict[str, Ref]:
    """Run ``plan`` in this process with the generic runner (no Prefect); the refs by kind.

    Tiles run ``max_workers`` at a time (threads, as the flow's default runner does);
    ``on_tile(kind, done, total)`` is called for each finished tile, in plan order.
    """
    from gridsolve.stages.engine.runner import prepare_stage, run_stage, run_tile

    refs: dict[str, Ref] = {}
    tile_list = list(tiles) if tiles is not None else None
    for seg in plan.segments:
        if not seg.tiled:
            s = seg.steps[0]
            refs[s.kind] = run_stage(s.config, inputs_of(s, refs), ctx.with_peers(s.peers)).ref
            continue
        prepared: dict[str, ArtifactRef] = {}
        for s in seg.steps:
            run = prepare_stage(s.config, inputs_of(s, refs), ctx.with_peers(s.peers))
            prepared[s.kind] = run.ref
            refs[s.kind] = tiled_ref(s, run.ref)
        if tile_list is None:
            tile_list = plan.tiles(refs, ctx.memory_budget, tile_pixels)
        tile_refs: dict[str, dict[int, ArtifactRef]] = {}
        for s in seg.steps:

            def one(
                t: Tile,
                s: Step = s,
                tile_refs: Mapping[str, Mapping[int, ArtifactRef]] = tile_refs,
                prepared: Mapping[str, ArtifactRef] = prepared,
            ) -> ArtifactRef:
                # a context of its own per tile: the runner sets ``key`` on it
                sctx = ctx.with_peers(s.peers)
                inputs = tile_inputs(s, refs, tile_refs, t)
                return run_tile(s.config, inputs, prepared[s.kind], t, sctx).ref

            by_index: dict[int, ArtifactRef] = {}
            pool = ThreadPoolExecutor(max_workers=max(1, max_workers))
            try:
                for t, ref in zip(tile_list, pool.map(one, tile_list), strict=True):
                    by_index[t.index] = ref
                    if on_tile is not None:
                        on_tile(s.kind, len(by_index), len(tile_list))
            finally:  # a failed tile stops the rest that have not started
                pool.shutdown(wait=True, cancel_futures=True)
            tile_refs[s.kind] = by_index
            refs[s.kind] = tiled_ref(s, prepared[s.kind], [by_index[t.index] for t in tile_list])
    return refs
