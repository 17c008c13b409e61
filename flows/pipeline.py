"""The gridsolve Prefect flow: one parameter per stage, one thin task per stage or tile.

Wiring only. Each task builds a :class:`StageContext` and calls the generic
runner in :mod:`stages.runner`; Prefect's cache policy computes the same key
as the runner, so a stage the store already holds shows as ``Cached`` in the
Prefect UI and is not run at all.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import CachePolicy
from prefect.client.schemas.objects import State
from prefect.context import TaskRunContext
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run as rt_flow_run
from pydantic import BaseModel, ConfigDict, Field

from gridsolve.flows.automations import FLOW_NAME, SCHEDULED_TAG
from gridsolve.flows.failures import install as install_failure_logging
from gridsolve.flows.failures import noting_user_errors
from gridsolve.flows.heartbeat import install as install_heartbeats
from gridsolve.flows.reporting import (
    RunSummary,
    StageSummary,
    finish_pictures,
    pictures_after_the_run,
    publish,
    summary_row,
    was_hit,
)
from gridsolve.flows.runtime import deployment_id, deployment_name
from gridsolve.schemas import templating
from gridsolve.schemas.artifacts import ArtifactRef, StageRun, Tile, TiledRef
from gridsolve.schemas.base import StageConfig
from gridsolve.schemas.errors import ConfigError, GridsolveError, is_transient
from gridsolve.schemas.execution import CacheConfig, ExecutionConfig
from gridsolve.schemas.kinds.load import DemoLoad
from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.kinds.train import NoTrain
from gridsolve.schemas.kinds.write import NetCDFWrite
from gridsolve.schemas.metadata import Published
from gridsolve.schemas.pipeline import (
    DEMO,
    DesignField,
    LoadField,
    ModelField,
    NormalEquationsField,
    PipelineConfig,
    SolveField,
    TrainField,
    WriteField,
    build_config,
)
from gridsolve.schemas.reading import deployment_home, resolved_path
from gridsolve.stages.engine import storage
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.overlap import refuse_destructive_outputs, run_reads
from gridsolve.stages.engine.paths import ensure_input_allowed, ensure_module_allowed
from gridsolve.stages.engine.plan import (
    Plan,
    Step,
    build_plan,
    inputs_of,
    summed_counts,
    tile_inputs,
    tiled_ref,
)
from gridsolve.stages.engine.prune import run_housekeeping
from gridsolve.stages.engine.registry import decl_for
from gridsolve.stages.engine.runner import (
    cache_key,
    prepare_stage,
    reusable,
    run_stage,
    run_tile,
    with_sources,
)
from gridsolve.stages.engine.store import open_store
from gridsolve.stages.engine.timing import add as add_phases
from gridsolve.stages.engine.timing import mark
from gridsolve.stages.write.retention import apply_keep_last
from gridsolve.stages.write.target import check_write_target

PREFECT_RECORDS = "prefect"

Ref = ArtifactRef | TiledRef


# ---------------------------------------------------------------- cache policy
@dataclass
class StoreCachePolicy(CachePolicy):
    """Prefect cache keyed by the store's own key; a miss in the store is a miss in Prefect."""

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        """The runner's key, after dropping Prefect's record if the store lost the artifact."""
        cache: CacheConfig = inputs["cache"]
        if not cache.enabled:
            return None
        t0 = time.perf_counter()
        key = self._key(inputs)
        if key is not None:  # the run summary counts it in the stage's "key" phase
            if len(_POLICY_SECONDS) > 10_000:  # a Dask worker's: its flow never reads them
                _POLICY_SECONDS.clear()
            _POLICY_SECONDS[key] = _POLICY_SECONDS.get(key, 0.0) + time.perf_counter() - t0
        return key

    def _key(self, inputs: dict[str, Any]) -> str | None:
        cache: CacheConfig = inputs["cache"]
        store = open_store(cache.root, cache.storage_options)
        ctx = StageContext(store=store, peers=inputs.get("peers") or {})
        config: StageConfig = inputs["config"]
        try:
            key = cache_key(
                config,
                inputs["refs"],
                ctx,
                prepared=inputs.get("prepared"),
                tile=inputs.get("tile"),
                prepare=inputs.get("part") == "prepare",
            )
        except GridsolveError:
            return None  # the task itself raises the same error, once, with its message
        if reusable(store, key, decl_for(config)) is None:
            # Never let Prefect return a cached reference to an artifact that is gone.
            (store.root / PREFECT_RECORDS / key).unlink(missing_ok=True)
        return key


#: Seconds the cache policy spent on each key in this process (the task runs after it).
_POLICY_SECONDS: dict[str, float] = {}


TASK_OPTIONS: dict[str, Any] = {
    "cache_policy": StoreCachePolicy(),
    "persist_result": True,
    "result_serializer": "json",
    "retries": 1,
    "retry_delay_seconds": 2,
}


def task_options(cache: CacheConfig) -> dict[str, Any]:
    """Per-run task options: Prefect's cache records live in the store's own folder."""
    return {"result_storage": records_folder(cache)}


def records_folder(cache: CacheConfig) -> Path:
    """Where Prefect's cache records are: in the store's folder (this host's copy for a bucket)."""
    return storage.at(cache.root).host_folder() / PREFECT_RECORDS


def _progress_artifact() -> Callable[[float, str], None]:
    """``progress(fraction, description)`` shown as a Prefect progress artifact of the task."""
    made: list[UUID] = []

    def report(fraction: float, description: str) -> None:
        try:
            if not made:
                made_id = create_progress_artifact(100.0 * fraction, description=description)
                assert isinstance(made_id, UUID)
                made.append(made_id)
            else:
                update_progress_artifact(made[0], 100.0 * fraction, description=description)
        except Exception as exc:  # showing progress must never fail the stage
            get_run_logger().debug("progress artifact not updated: %s", exc)

    return report


def _ctx(
    cache: CacheConfig,
    execution: ExecutionConfig,
    peers: Mapping[str, StageConfig] | None = None,
) -> StageContext:
    return StageContext(
        store=open_store(cache.root, cache.storage_options),
        memory_budget=execution.memory_budget_bytes,
        logger=get_run_logger(),  # type: ignore[arg-type]
        peers=dict(peers or {}),
        progress=_progress_artifact(),
    )


def _no_retry_for_user_errors(task: Any, task_run: Any, state: State[Any]) -> bool:
    """Retry transient failures (I/O), never bad input or config."""
    try:
        state.result()
    except Exception as exc:
        return is_transient(exc)
    return False


@task(name="stage", retry_condition_fn=_no_retry_for_user_errors, **TASK_OPTIONS)
def stage_task(
    config: StageConfig,
    refs: dict[str, Ref],
    cache: CacheConfig,
    execution: ExecutionConfig,
    part: str = "whole",
    peers: dict[str, StageConfig] | None = None,
) -> StageRun:
    """Run or reuse one whole stage."""
    with noting_user_errors():
        return run_stage(config, refs, _ctx(cache, execution, peers), use_cache=cache.enabled)


@task(name="prepare", retry_condition_fn=_no_retry_for_user_errors, **TASK_OPTIONS)
def prepare_task(
    config: StageConfig,
    refs: dict[str, Ref],
    cache: CacheConfig,
    execution: ExecutionConfig,
    part: str = "prepare",
    peers: dict[str, StageConfig] | None = None,
) -> StageRun:
    """Run or reuse the once-per-stage part of a tiled stage."""
    with noting_user_errors():
        ctx = _ctx(cache, execution, peers)
        return prepare_stage(config, refs, ctx, use_cache=cache.enabled)


@task(name="tile", retry_condition_fn=_no_retry_for_user_errors, **TASK_OPTIONS)
def tile_task(
    config: StageConfig,
    refs: dict[str, Ref],
    prepared: ArtifactRef,
    tile: Tile,
    cache: CacheConfig,
    execution: ExecutionConfig,
    part: str = "tile",
    peers: dict[str, StageConfig] | None = None,
) -> StageRun:
    """Run or reuse one tile of a tiled stage."""
    with noting_user_errors():
        ctx = _ctx(cache, execution, peers)
        return run_tile(config, refs, prepared, tile, ctx, use_cache=cache.enabled)


# ---------------------------------------------------------------- templating
def template_values() -> dict[str, str]:
    """Values for ``{date}``-style placeholders, from the current flow run."""
    scheduled = rt_flow_run.scheduled_start_time
    return templating.template_values(
        now=datetime.now(UTC),
        scheduled=scheduled if isinstance(scheduled, datetime) else None,
        flow_run_name=rt_flow_run.name,
        flow_run_id=str(rt_flow_run.id) if rt_flow_run.id else None,
        deployment=deployment_name(),
    )


def render_paths(cfg: PipelineConfig, values: Mapping[str, str]) -> PipelineConfig:
    """``cfg`` with placeholders in every stage's ``path`` filled in."""
    updates: dict[str, StageConfig] = {}
    for kind, conf in cfg.stage_configs().items():
        path = getattr(conf, "path", None)
        if isinstance(path, str) and "{" in path:
            updates[kind] = conf.model_copy(
                update={"path": templating.render_template(path, values)}
            )
        elif isinstance(path, list) and any("{" in p for p in path):
            rendered = [templating.render_template(p, values) for p in path]
            updates[kind] = conf.model_copy(update={"path": rendered})
    return cfg.model_copy(update=updates) if updates else cfg


# ---------------------------------------------------------------- flow
class PreparedStage(BaseModel):
    """The once-per-stage part of a tiled stage, as run (or reused) by the flow."""

    model_config = ConfigDict(frozen=True)

    run: StageRun
    hit: bool
    seconds: float
    phases: dict[str, float] = Field(default_factory=dict)


class TilePhase(BaseModel):
    """What the tiled stages produced: their refs, summary rows and summed tile counts."""

    model_config = ConfigDict(frozen=True)

    refs: dict[str, TiledRef]
    rows: list[StageSummary]
    counts: dict[str, dict[str, int]]


def completed_in_window(
    tiles: Sequence[Tile],
    submit: Callable[[Tile], PrefectFuture[StageRun]],
    window: int,
) -> Iterator[tuple[Tile, PrefectFuture[StageRun]]]:
    """Submit tiles keeping at most ``window`` in flight; yield each as it completes."""
    queue = iter(tiles)
    pending: dict[PrefectFuture[StageRun], Tile] = {}

    def fill() -> None:
        while len(pending) < window and (tile := next(queue, None)) is not None:
            pending[submit(tile)] = tile

    fill()
    while pending:
        fut = next(as_completed(list(pending)))
        tile = pending.pop(fut)
        fill()
        yield tile, fut


def _plan(cfg: PipelineConfig) -> Plan:
    return build_plan(cfg.stage_configs())


@dataclass
class _Progress:
    """The tiles-done progress artifact and log lines of one tile phase."""

    artifact: UUID
    total: int
    done: int = 0

    def one_more(self, kind: str) -> None:
        """Count one finished tile of stage ``kind``."""
        self.done += 1
        update_progress_artifact(self.artifact, progress=100.0 * self.done / self.total)
        if self.total > 2 and (
            self.done % max(1, self.total // 20) == 0 or self.done == self.total
        ):
            get_run_logger().info("tiles %d/%d done (%s)", self.done, self.total, kind)


def _window(execution: ExecutionConfig) -> int:
    """How many tile tasks to keep submitted at once."""
    # Threads: max_workers tiles at a time. Dask: each worker runs one tile at a time,
    # so keep every worker busy (an existing cluster may have many).
    if execution.runner == "threads":
        return execution.max_workers
    return max(64, 4 * execution.dask_workers)


def _stage_tiles(
    step: Step,
    prep: PreparedStage,
    tiles: list[Tile],
    upstream: tuple[dict[str, Ref], dict[str, dict[int, ArtifactRef]]],
    cfg: PipelineConfig,
    progress: _Progress,
    phases: dict[str, float],
) -> tuple[dict[int, ArtifactRef], list[bool]]:
    """Run (or reuse) every tile of one tiled stage: refs by tile index, and hits.

    The tiles' runner phases are added to ``phases``.
    """
    refs, tile_refs = upstream
    task_fn = tile_task.with_options(name=f"{step.kind}-tile", **task_options(cfg.cache))

    def submit(tile: Tile) -> Any:
        named = task_fn.with_options(task_run_name=f"{step.kind}-tile-{tile.index}")
        inputs = tile_inputs(step, refs, tile_refs, tile)
        return named.submit(
            step.config,
            inputs,
            prep.run.ref,
            tile,
            cfg.cache,
            cfg.execution,
            peers=dict(step.peers),
        )

    hits: list[bool] = [prep.hit]
    by_index: dict[int, ArtifactRef] = {}
    for tile, fut in completed_in_window(tiles, submit, _window(cfg.execution)):
        run = fut.result()
        by_index[tile.index] = run.ref
        hits.append(was_hit(fut.state, run))
        add_phases(phases, _ran(fut.state, run))
        progress.one_more(step.kind)
    return by_index, hits


def run_tiles(
    cfg: PipelineConfig,
    refs: dict[str, Ref],
    prepared: dict[str, PreparedStage],
    tiles: list[Tile],
    kinds: list[str],
) -> TilePhase:
    """Submit every tile of the tiled stages ``kinds`` (one segment) and collect them."""
    logger = get_run_logger()
    plan = _plan(cfg)
    steps = [plan.step(k) for k in kinds]
    refs = dict(refs)
    out_refs: dict[str, TiledRef] = {}
    rows: list[StageSummary] = []
    counts: dict[str, dict[str, int]] = {}
    names = " and ".join(kinds)
    artifact = create_progress_artifact(progress=0.0, description=f"tiles done ({names})")
    assert isinstance(artifact, UUID)
    progress = _Progress(artifact, total=len(steps) * len(tiles))
    tile_refs: dict[str, dict[int, ArtifactRef]] = {}
    for step in steps:
        prep = prepared[step.kind]
        t0 = time.perf_counter()
        phases = dict(prep.phases)
        by_index, hits = _stage_tiles(step, prep, tiles, (refs, tile_refs), cfg, progress, phases)
        tile_refs[step.kind] = by_index
        refs[step.kind] = out_refs[step.kind] = tiled_ref(
            step, prep.run.ref, [by_index[t.index] for t in tiles]
        )
        stage_counts = summed_counts(step, [by_index[t.index].meta for t in tiles])
        if stage_counts:
            counts[step.kind] = stage_counts
        pixels = sum(t.pixels for t in tiles)
        seconds = prep.seconds + time.perf_counter() - t0
        key = refs[step.kind].key
        rows.append(
            summary_row(
                step.kind, step.decl.impl, key, hits, seconds, pixels, tiled=True, phases=phases
            )
        )
        logger.info("%s: cache %s (%d tile(s))", step.name, rows[-1].cache, len(tiles))
    return TilePhase(refs=out_refs, rows=rows, counts=counts)


@flow(name="gridsolve-tiles", persist_result=False, validate_parameters=False)
def tiles_flow(
    cfg: PipelineConfig,
    refs: dict[str, Ref],
    prepared: dict[str, PreparedStage],
    tiles: list[Tile],
    kinds: list[str],
) -> TilePhase:
    """One segment's tiled stages on another task runner (Dask), as a subflow."""
    return run_tiles(cfg, refs, prepared, tiles, kinds)


def dask_runner(execution: ExecutionConfig) -> Any:
    """A DaskTaskRunner on the configured scheduler, or on a new LocalCluster."""
    from prefect.settings import get_current_settings
    from prefect_dask.task_runners import DaskTaskRunner

    if execution.dask_address:
        # Workers of an existing cluster need gridsolve, PREFECT_API_URL (and
        # PREFECT_API_AUTH_STRING with a login) and the store's path.
        return DaskTaskRunner(address=execution.dask_address)
    threads = str(max(1, (os.cpu_count() or 1) // execution.dask_workers))
    env = {
        # Without it every worker would start its own temporary Prefect server.
        "PREFECT_API_URL": str(get_current_settings().api.url or ""),
        "PREFECT_LOGGING_EXTRA_LOGGERS": "gridsolve",
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
    }
    auth = get_current_settings().api.auth_string
    if auth is not None and auth.get_secret_value():
        env["PREFECT_API_AUTH_STRING"] = auth.get_secret_value()  # a server with basic auth
    return DaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={
            "n_workers": execution.dask_workers,
            "threads_per_worker": 1,
            "processes": True,
            "host": "127.0.0.1",
            "dashboard_address": None,
            "env": env,
        },
    )


def _ran(state: State[Any], run: StageRun) -> dict[str, float]:
    """The phases of a task's run: its cache key's in Prefect's policy, then the runner's.

    Where Prefect's cache answered, the run's are those of the run that made it: left out.
    """
    policy = _POLICY_SECONDS.pop(run.ref.key, 0.0)
    if state.name == "Cached":
        return {}
    phases = dict(run.phases)
    if policy:
        phases["key"] = phases.get("key", 0.0) + policy
    return phases


def _this_runs_sources(
    step: Step, state: State[Any], cache: CacheConfig, execution: ExecutionConfig
) -> StageRun:
    """The task's run, with the per-run facts about its source files of this run.

    The runner attaches them when the task ran; a result Prefect returns from
    its cache carries those of the run that made it (another path, an older
    mtime), so only then are they looked up again.
    """
    run: StageRun = state.result()
    if state.name == "Cached":
        run = with_sources(step.config, run, _ctx(cache, execution, step.peers))
    return run


def _whole(
    step: Step, refs: Mapping[str, Ref], cfg: PipelineConfig, opts: Mapping[str, Any]
) -> tuple[StageRun, StageSummary]:
    """Run (or reuse) one whole stage as a task; its run and summary row."""
    cache, execution = cfg.cache, cfg.execution
    t0 = time.perf_counter()
    state = stage_task.with_options(name=step.kind, **opts)(
        step.config,
        inputs_of(step, refs),
        cache,
        execution,
        peers=dict(step.peers),
        return_state=True,
    )
    run: StageRun = _this_runs_sources(step, state, cache, execution)
    row = summary_row(
        step.kind,
        step.decl.impl,
        run.ref.key,
        [was_hit(state, run)],
        time.perf_counter() - t0,
        0,
        phases=_ran(state, run),
    )
    return run, row


def _prepare(
    steps: Sequence[Step], refs: dict[str, Ref], cfg: PipelineConfig, opts: Mapping[str, Any]
) -> dict[str, PreparedStage]:
    """Run (or reuse) the prepare step of each tiled stage of a segment; refs get their refs."""
    prepared: dict[str, PreparedStage] = {}
    for step in steps:
        t0 = time.perf_counter()
        state = prepare_task.with_options(name=f"{step.kind}-prepare", **opts)(
            step.config,
            inputs_of(step, refs),
            cfg.cache,
            cfg.execution,
            peers=dict(step.peers),
            return_state=True,
        )
        run = _this_runs_sources(step, state, cfg.cache, cfg.execution)
        prepared[step.kind] = PreparedStage(
            run=run,
            hit=was_hit(state, run),
            seconds=time.perf_counter() - t0,
            phases=_ran(state, run),
        )
        refs[step.kind] = tiled_ref(step, run.ref)
    return prepared


#: Flow runs of deployments tagged SCHEDULED_TAG (the nightly one) never process the
#: demo cube, and are retried once when they crash (flows/automations.py).


def in_deployment_home(cfg: PipelineConfig) -> PipelineConfig:
    """In a deployment's run, ``cfg`` with relative paths made absolute under GRIDSOLVE_HOME.

    A CLI config's paths were resolved against its folder already; a run
    outside a deployment keeps its working directory.
    """
    if deployment_id() is None:
        return cfg
    home = deployment_home()
    home.mkdir(parents=True, exist_ok=True)

    def under(v: Any) -> Any:
        if isinstance(v, str):
            return resolved_path(v, home)
        if isinstance(v, list):
            return [resolved_path(x, home) if isinstance(x, str) else x for x in v]
        return v

    updates: dict[str, Any] = {}
    for kind, conf in cfg.stage_configs().items():
        fields = {f: under(getattr(conf, f)) for f in type(conf).path_fields()}
        if any(fields[f] != getattr(conf, f) for f in fields):
            updates[kind] = conf.model_copy(update=fields)
    if under(cfg.cache.root) != cfg.cache.root:
        updates["cache"] = cfg.cache.model_copy(update={"root": under(cfg.cache.root)})
    return cfg.model_copy(update=updates) if updates else cfg


def refuse_demo_on_schedule(cfg: PipelineConfig) -> None:
    """ConfigError when a run of a deployment tagged ``scheduled`` would load the demo cube.

    A team that forgets ``load.path`` would otherwise get demo output every night.
    """
    if not isinstance(cfg.load, DemoLoad):
        return
    tags = set(rt_flow_run.tags or ())
    if SCHEDULED_TAG not in tags:
        return
    name = deployment_name() or "this deployment"
    raise ConfigError(
        f"the {name} deployment's load section is still the demo cube: load.path is not set",
        stage=f"load/{cfg.load.impl}",
        fix="set load.path (and load.impl: netcdf) in the deployment's parameters — "
        "prefect.yaml, or the UI's Edit → Parameters — e.g. /data/sst-{scheduled_date}.nc; "
        "runs of deployments tagged 'scheduled' never process the demo cube",
    )


def check_reads_allowed(cfg: PipelineConfig) -> None:
    """Before any read or import: inputs and model.target where this worker allows them.

    ``GRIDSOLVE_ALLOWED_INPUTS`` and ``GRIDSOLVE_ALLOWED_MODULES`` (unset: no
    restriction); globs are expanded first, so every file they match is checked.
    """
    from gridsolve.stages.load.where import expand, is_glob

    for kind, conf in cfg.stage_configs().items():
        label = f"{kind}/{conf.impl}"
        for field, value in conf.input_files().items():
            paths = [value] if isinstance(value, str) else list(value)
            local_globs = [p for p in paths if is_glob(p) and storage.at(p).lists_globs]
            for path in [*paths, *(expand(local_globs) if local_globs else [])]:
                ensure_input_allowed(path, f"{kind}.{field}", label)
        for module in conf.imported_modules():
            ensure_module_allowed(module, label)


def check_cache_allowed(cache: CacheConfig) -> None:
    """OutputError, before anything is written there, if the cache is outside the allowed roots.

    The store refuses it too when opened, but Prefect writes its cache records into
    the cache folder as the first task starts: this refuses the run before.
    """
    storage.at(cache.root).confine("cache folder", "cache")


def run_pipeline(cfg: PipelineConfig) -> RunSummary:
    """Run every stage of ``cfg``'s plan inside the current flow run; returns the summary."""
    logger = get_run_logger()
    cfg = render_paths(cfg, template_values())
    plan = _plan(cfg)
    with noting_user_errors():
        refuse_demo_on_schedule(cfg)
        check_reads_allowed(cfg)
        # Before any task: Prefect writes its cache records into the cache folder.
        check_cache_allowed(cfg.cache)
        # Here, on the rendered paths, so a run triggered in the UI is refused too.
        refuse_destructive_outputs(cfg)
        try:  # a bucket that refuses the output fails before any work
            check_write_target(cfg.write)
        except GridsolveError as exc:
            raise exc.with_stage(f"write/{cfg.write.impl}") from None
    opts = task_options(cfg.cache)
    execution = cfg.execution
    rows: list[StageSummary] = []
    refs: dict[str, Ref] = {}

    output = ""
    tiles: list[Tile] | None = None
    counts: dict[str, dict[str, int]] = {}
    for seg in plan.segments:
        if not seg.tiled:
            step = seg.steps[0]
            run, row = _whole(step, refs, cfg, opts)
            refs[step.kind] = run.ref
            rows.append(row)
            logger.info("%s %s (key %s)", step.name, row.cache, run.ref.key[:12])
            if step.decl.describe is not None:
                logger.info("%s: %s", step.kind, step.decl.describe(run.ref.meta))
            if tiles is not None:  # a stage after the tiles: the writer names the output
                output = Published.of(run.ref).path or output
            continue
        prepared = _prepare(seg.steps, refs, cfg, opts)
        if tiles is None:
            tiles = plan.tiles(refs, execution.memory_budget_bytes, execution.tile_pixels)
            logger.info("%d pixels in %d tile(s)", sum(t.pixels for t in tiles), len(tiles))
        kinds = [s.kind for s in seg.steps]
        if execution.runner == "dask":
            phase = tiles_flow.with_options(task_runner=dask_runner(execution))(
                cfg, refs, prepared, tiles, kinds
            )
        else:
            phase = run_tiles(cfg, refs, prepared, tiles, kinds)
        refs.update(phase.refs)
        rows.extend(phase.rows)
        counts.update(phase.counts)
    mark("stages-done")
    summary = RunSummary(
        stages=rows,
        output=output,
        counts=counts,
        tiles=len(tiles or []),
        flow_run_id=str(rt_flow_run.id) if rt_flow_run.id else None,
    )
    publish(summary, getattr(cfg.write, "storage_options", None), cfg)
    return summary


@flow(name=FLOW_NAME, persist_result=False, validate_parameters=True, log_prints=True)
def pipeline(
    load: LoadField = DEMO.load,
    design: DesignField = DEMO.design,
    normal_equations: NormalEquationsField = SVDNormalEquations(),
    solve: SolveField = LstsqSolve(),
    train: TrainField = NoTrain(),
    model: ModelField = DEMO.model,
    write: WriteField = NetCDFWrite(),
    cache: CacheConfig = CacheConfig(),
    execution: ExecutionConfig = ExecutionConfig(),
) -> RunSummary:
    """Fit every pixel; run the single-sample model with per-sample gradients if configured; write.

    The parameters' defaults are the demo's (what a deployment run from the UI
    starts from); a config without a model section passes ``model: {impl: none}``.

    Args:
        load: The cube to read (a NetCDF file), or the demo cube.
        design: The design matrix A (obs × coef) shared by every pixel.
        normal_equations: The shared factorisation of the design (float64).
        solve: How each pixel's least-squares problem is solved.
        train: Whether and how the model is trained on the target (none by default).
        model: The single-sample model run at every pixel, with per-sample gradients
            (impl none: no model).
        write: The output NetCDF file.
        cache: Where stage outputs are stored and reused.
        execution: Memory budget, tiles and task runner (never change results).

    """
    sections = dict(locals())  # the parameters, one per PipelineConfig field
    mark("flow-begin")
    _POLICY_SECONDS.clear()  # a failed task's of an earlier run in this process
    install_failure_logging()  # again: Prefect may have replaced its handlers since import
    started_ns = time.time_ns()
    cfg = in_deployment_home(build_config(sections))
    logger = get_run_logger()
    # A lease on the cache for the whole run (its artifacts are in use), then the size cap.
    with run_housekeeping(cfg.cache.root, cfg.cache.max_size_bytes, logger):
        summary = run_pipeline(cfg)
    reads = run_reads(render_paths(cfg, template_values()), _CONFIG_FILE.get())
    # keep_last deletes only outputs this deployment (or local runs) made from this template
    owner = deployment_name() or "local"
    if getattr(cfg.write, "keep_last", None) is not None:
        finish_pictures()  # keep_last opens older outputs: not beside the drawing thread
    apply_keep_last(cfg.write, summary.output, started_ns, logger, reads, owner)
    mark("flow-end")
    return summary


#: The config file the CLI runs, which write.keep_last must keep. Not a flow parameter:
#: a deployment's run has none, and the flow's signature stays the config's. A context
#: variable: two runs in one process (threads) each see their own.
_CONFIG_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "gridsolve_config_file", default=None
)


def run_config(cfg: PipelineConfig, config_file: str | Path | None = None) -> RunSummary:
    """Run the flow on a validated config (what the CLI calls), read from ``config_file``."""
    params = {k: getattr(cfg, k) for k in PipelineConfig.model_fields}
    token = _CONFIG_FILE.set(Path(config_file) if config_file is not None else None)
    try:
        with pictures_after_the_run():  # drawn while the flow run finishes
            mark("flow-call")
            summary: RunSummary = pipeline(**params)
            mark("flow-return")
    finally:
        _CONFIG_FILE.reset(token)
    return summary


# At import: a worker's engine subprocess and Dask workers import this module too.
install_failure_logging()
install_heartbeats()  # heartbeats that stop when the run ends (flows/heartbeat.py)
