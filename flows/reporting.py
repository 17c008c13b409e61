"""What a run reports: its summary table, and the artifacts a person looks at in Prefect.

The run summary (one row per stage: key, cache, seconds, pixels per second)
is printed by the CLI and published as a table artifact; the quick-look
picture and the loss curve (:mod:`gridsolve.report`) as markdown
artifacts. Reporting never fails a run that wrote its output.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from uuid import UUID

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.schemas.objects import State
from prefect.logging import get_run_logger
from prefect.runtime import flow_run as rt_flow_run
from pydantic import BaseModel, ConfigDict, Field

from gridsolve.flows.runtime import deployment_name
from gridsolve.report.pictures import (
    Caption,
    config_summary,
    drawn_before,
    write_loss_curve,
    write_quicklook,
)
from gridsolve.report.pictures import markdown as quicklook_markdown
from gridsolve.schemas.artifacts import StageRun
from gridsolve.schemas.pipeline import PipelineConfig
from gridsolve.stages.engine.timing import ordered


class StageSummary(BaseModel):
    """One row of the run summary."""

    model_config = ConfigDict(frozen=True)

    stage: str
    impl: str
    key: str
    cache: str
    hit: bool
    seconds: float
    pixels: int
    #: None for a stage that is not tiled over pixels (or took no measurable time)
    pixels_per_second: float | None
    #: seconds per runner phase (key, setup, read, compute, write, store, …), summed over
    #: the stage's parts; empty where Prefect's cache answered (its task never ran)
    phases: dict[str, float] = Field(default_factory=dict)


class RunSummary(BaseModel):
    """What a run did: one row per stage, the output path and status counts."""

    model_config = ConfigDict(frozen=True)

    stages: list[StageSummary]
    output: str
    #: per tiled stage that declares counts: e.g. pixel statuses, summed over tiles
    counts: dict[str, dict[str, int]]
    tiles: int
    flow_run_id: str | None = None

    @property
    def all_hit(self) -> bool:
        """Whether every stage was reused from the cache."""
        return all(s.hit for s in self.stages)

    def table(self) -> str:
        """The summary as a text table."""
        head = f"{'stage':<17}{'impl':<16}{'key':<14}{'cache':<20}{'seconds':>9}{'pixels/s':>14}"
        lines = [head, "-" * len(head)]
        for s in self.stages:
            pps = f"{s.pixels_per_second:,.0f}" if s.pixels_per_second is not None else ""
            lines.append(
                f"{s.stage:<17}{s.impl:<16}{s.key[:12]:<14}{s.cache:<20}{s.seconds:>9.2f}{pps:>14}"
            )
        return "\n".join(lines)


def was_hit(state: State[Any], run: StageRun) -> bool:
    """Whether a stage task's result was reused (Prefect's cache, or the store's)."""
    return state.name == "Cached" or run.hit


def cache_label(hits: Sequence[bool], tiled: bool = False) -> str:
    """'hit', 'miss', or which part hit ('12/38 tiles hit').

    A tiled stage's ``hits`` are its prepare step's, then each tile's; a
    partial hit is counted in tiles.
    """
    if all(hits):
        return "hit"
    if not any(hits):
        return "miss"
    if not tiled:
        return f"{sum(hits)}/{len(hits)} hit"
    tiles = hits[1:]
    label = f"{sum(tiles)}/{len(tiles)} tiles hit"
    return label if hits[0] else f"{label}, prepare missed"


def summary_row(
    kind: str,
    impl: str,
    key: str,
    hits: Sequence[bool],
    seconds: float,
    pixels: int,
    tiled: bool = False,
    phases: Mapping[str, float] | None = None,
) -> StageSummary:
    """The summary row of one stage from its parts' hits, its seconds, pixels and phases."""
    label = cache_label(hits, tiled)
    return StageSummary(
        stage=kind,
        impl=impl,
        key=key,
        cache=label,
        hit=all(hits),
        seconds=round(seconds, 4),
        pixels=pixels,
        pixels_per_second=round(pixels / seconds, 1) if seconds > 0 and pixels else None,
        phases={k: round(v, 4) for k, v in ordered(phases or {}).items()},
    )


def publish(
    summary: RunSummary,
    options: Mapping[str, Any] | None = None,
    cfg: PipelineConfig | None = None,
) -> None:
    """The run's artifacts in Prefect: the summary table and the quick-look picture."""
    logger = get_run_logger()
    counts = "; ".join(
        f"{kind}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
        for kind, c in summary.counts.items()
    )
    create_table_artifact(
        table=[
            {
                "stage": r.stage,
                "impl": r.impl,
                "key": r.key,
                "cache": r.cache,
                "seconds": float(r.seconds),
                # empty, not 0, for a stage that is not per pixel
                "pixels_per_second": r.pixels_per_second,
                # where its seconds went: setup, read, compute, write, store, Prefect's task
                "phases": _phase_line(r),
            }
            for r in summary.stages
        ],
        key="gridsolve-summary",
        description=f"gridsolve run summary: output {summary.output}; {counts}",
    )
    logger.info("wrote %s", summary.output)
    try:
        caption = Caption(
            run=rt_flow_run.name or None,
            deployment=deployment_name(),  # None for a CLI or local run
            config=config_summary(cfg) if cfg is not None else "",
        )
        later = _LATER.get()
        if later is not None and drawn_before(summary.output, caption) is None:
            job = _Pictures(str(rt_flow_run.id) if rt_flow_run.id else None)
            job.start(summary.output, options, caption)
            later.append(job)
            return
        for key, description, markdown in _draw(summary.output, options, caption):
            create_markdown_artifact(markdown=markdown, key=key, description=description)
    except Exception as exc:  # a picture must never fail a run that wrote its output
        logger.warning(NOT_MADE, exc)


NOT_MADE = "quick-look picture not made: %s"


def _draw(
    output: str, options: Mapping[str, Any] | None, caption: Caption
) -> list[tuple[str, str, str]]:
    """The pictures of ``output``, written beside it: (artifact key, description, markdown)."""
    picture, png, reused = write_quicklook(output, options, caption)
    out = [
        (
            "gridsolve-quicklook",
            "first coefficient and residual RMS maps",
            quicklook_markdown(png, picture, output, reused=reused),
        )
    ]
    curve = write_loss_curve(output, options)
    if curve is not None:
        out.append(
            (
                "gridsolve-loss-curve",
                "training and validation loss per epoch",
                quicklook_markdown(curve[1], curve[0], output, "training loss"),
            )
        )
    return out


class _Pictures:
    """A run's pictures drawn on a thread, then published as artifacts of its flow run."""

    def __init__(self, flow_run_id: str | None) -> None:
        self.flow_run_id = flow_run_id
        self.drawn: list[tuple[str, str, str]] = []
        self.error: Exception | None = None
        self.thread: threading.Thread | None = None

    def start(self, output: str, options: Mapping[str, Any] | None, caption: Caption) -> None:
        """Draw them on a thread (``finish`` publishes them)."""

        def draw() -> None:
            try:
                self.drawn = _draw(output, options, caption)
            except Exception as exc:  # reported by finish, as publish would
                self.error = exc

        self.thread = threading.Thread(target=draw, name="gridsolve-pictures", daemon=True)
        self.thread.start()

    def finish(self) -> None:
        """Wait for the drawing and create its artifacts on the flow run (a warning if not)."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactCreate

        if self.thread is not None:
            self.thread.join()
        try:
            if self.error is not None:
                raise self.error
            with get_client(sync_client=True) as client:
                run = {"flow_run_id": UUID(self.flow_run_id)} if self.flow_run_id else {}
                for key, description, markdown in self.drawn:
                    body = ArtifactCreate(
                        key=key, type="markdown", description=description, data=markdown, **run
                    ).model_dump(mode="json", exclude_unset=True)
                    # The route client.create_artifact posts to, without the event it then
                    # emits: the run's event worker was drained as the flow run ended, and
                    # an event sent after that is reported as lost work at exit.
                    client.request("POST", "/artifacts/", json=body).raise_for_status()
        except Exception as exc:  # a picture must never fail a run that wrote its output
            logging.getLogger("gridsolve").warning(NOT_MADE, exc)


#: Set by :func:`pictures_after_the_run`: where :func:`publish` leaves its pictures.
_LATER: contextvars.ContextVar[list[_Pictures] | None] = contextvars.ContextVar(
    "gridsolve_pictures_later", default=None
)


def finish_pictures() -> None:
    """Publish now the pictures being drawn for this run, if any.

    For work that opens other outputs (``write.keep_last``): netCDF4 and HDF5
    are not safe to call from two threads at once.
    """
    jobs = _LATER.get()
    while jobs:
        jobs.pop(0).finish()


@contextlib.contextmanager
def pictures_after_the_run() -> Iterator[None]:
    """Within, :func:`publish` draws the pictures on a thread, published as the block ends.

    For a run whose process waits for it (the CLI): the drawing (about 1 s of
    matplotlib for a first picture) overlaps the end of the flow run (its final
    state, Prefect's heartbeat thread joining, up to 1 s), and the artifacts
    join the flow run just after it finished. A deployment's run publishes them
    within the run, as :func:`publish` does outside this block.
    """
    jobs: list[_Pictures] = []
    token = _LATER.set(jobs)
    try:
        yield
    finally:
        _LATER.reset(token)
        for job in jobs:
            job.finish()


def _phase_line(row: StageSummary) -> str:
    """A stage's phases, then what its task cost beyond them (Prefect's part)."""
    parts = [f"{name} {sec:.2f}" for name, sec in row.phases.items() if sec >= 0.005]
    if not row.phases:
        return "Prefect's cache answered: its task never ran" if row.hit else ""
    rest = row.seconds - sum(row.phases.values())
    if rest >= -1e-3:  # the phases are rounded to 0.1 ms each
        parts.append(f"task {max(rest, 0.0):.2f}")
    else:  # tiles in parallel: their phases sum to more than the stage's wall time
        parts.append(f"tiles in parallel ({sum(row.phases.values()):.2f} s of work)")
    return " · ".join(parts)


def profile_table(
    summary: RunSummary, marks: Mapping[str, float], start: float | None, end: float
) -> tuple[str, float]:
    """Where a run's time went, from ``start`` (the process's) to ``end``; and that total.

    ``marks`` are the run's instants (``stages/engine/timing.py``: ``imported``,
    ``flow-call``, ``flow-begin``, ``stages-done``, ``flow-end``, ``flow-return``); the
    rows add up to the total by construction, each stage's row being its task's wall
    time split into the runner's phases and the task's rest.
    """
    t0 = start if start is not None else marks.get("imported", end)
    at = {name: marks.get(name, t0) for name in ("imported", "flow-call", "flow-begin")}
    at.update({name: marks.get(name, end) for name in ("stages-done", "flow-end", "flow-return")})
    stages = sum(r.seconds for r in summary.stages)
    rows: list[tuple[str, float, str]] = [
        ("start and imports", at["imported"] - t0, "the interpreter, gridsolve, Prefect"),
        ("config and checks", at["flow-call"] - at["imported"], "read, validate, refuse"),
        ("flow run start", at["flow-begin"] - at["flow-call"], "Prefect: the flow run, its API"),
    ]
    rows += [(f"  {r.stage}", r.seconds, _phase_line(r)) for r in summary.stages]
    rows += [
        (
            "between stages",
            at["stages-done"] - at["flow-begin"] - stages,
            "the flow's own code: plan, tiles, log",
        ),
        ("summary and cache", at["flow-end"] - at["stages-done"], "artifacts, housekeeping"),
        ("flow run end", at["flow-return"] - at["flow-end"], "Prefect: final state, heartbeat"),
        ("after the flow", end - at["flow-return"], "quick look published, summary"),
    ]
    total = end - t0
    width = max(len(label) for label, _, _ in rows)
    lines = [f"where the time went ({total:.2f} s from the process start)"]
    lines += [f"{label:<{width}}  {sec:6.2f} s  {what}".rstrip() for label, sec, what in rows]
    return "\n".join(lines), total
