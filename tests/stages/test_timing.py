"""Where a run's time goes: phases of a stage part (stages/engine/timing.py) and the runner's."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from gridsolve.stages.engine import timing
from gridsolve.stages.engine.plan import build_plan, run_locally
from gridsolve.stages.engine.runner import reads, run_stage


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_nested_part_counts_in_itself_alone() -> None:
    clock = timing.Clock()
    t0 = time.perf_counter()
    with clock.phase("compute"):
        _busy(0.02)
        with timing.part("setup"):
            _busy(0.03)
            with timing.part("read"):
                _busy(0.01)
        _busy(0.01)
    spent = time.perf_counter() - t0
    got = clock.rounded()
    assert list(got) == ["setup", "read", "compute"]  # in PHASES order
    # each at least its own busy time (a loaded machine only adds); together the whole
    assert got["setup"] >= 0.03 - 1e-4 and got["read"] >= 0.01 - 1e-4
    assert got["compute"] >= 0.03 - 1e-4
    assert sum(clock.seconds.values()) == pytest.approx(spent, abs=1e-3)


def test_part_outside_a_clock_or_in_another_thread_is_a_no_op() -> None:
    with timing.part("setup"):
        pass
    clock = timing.Clock()
    seen: list[Any] = []
    with clock.phase("compute"):
        thread = threading.Thread(target=lambda: seen.append(timing._CURRENT.get()))
        thread.start()
        thread.join()
    assert seen == [None]
    assert set(clock.seconds) == {"compute"}


def test_the_process_start_is_when_the_process_started() -> None:
    before = time.time()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; from gridsolve.stages.engine.timing import process_start;"
            "print(process_start(), time.time())",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    start, now = float(out[0]), float(out[1])
    # /proc counts in clock ticks (10 ms) and /proc/uptime in 10 ms: a few ticks either way
    assert before - 0.05 <= start <= now


def test_the_runner_reports_its_phases(chain: Any, cube_path: Any) -> None:
    from gridsolve.schemas.pipeline import build_config

    cfg = build_config(
        {
            "load": {"path": str(cube_path)},
            "design": {"impl": "polynomial", "degree": 2},
            "write": {"path": str(cube_path.parent / "out.nc")},
        }
    )
    plan = build_plan(cfg.stage_configs())
    refs = run_locally(plan, chain.ctx)
    load = plan.step("load")
    again = run_stage(load.config, {}, chain.ctx.with_peers(load.peers))
    assert again.hit and set(again.phases) <= {"key", "lookup"}, again.phases
    write = plan.step("write")
    fresh = run_stage(
        write.config,
        {k: refs[k] for k in reads(write.decl, refs)},
        chain.ctx.with_peers(write.peers),
        use_cache=False,
    )
    # the writer's own function is counted as writing; every phase has time
    assert "write" in fresh.phases and "compute" not in fresh.phases, fresh.phases
    assert sum(fresh.phases.values()) <= fresh.seconds + 1e-3
