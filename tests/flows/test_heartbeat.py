"""Flow-run heartbeats that stop when the run ends (flows/heartbeat.py)."""

from __future__ import annotations

import threading
import time
import types
from typing import Any

import prefect.flow_engine as engine_module

from gridsolve.flows import heartbeat


class _State:
    def __init__(self) -> None:
        self.final = False

    def is_final(self) -> bool:
        return self.final


class _Run:
    def __init__(self) -> None:
        self.state = _State()


class _Engine:
    """The parts of Prefect's FlowRunEngine the heartbeat context uses."""

    def __init__(self, seconds: int | None) -> None:
        self.heartbeat_seconds = seconds
        self.flow_run = _Run()
        self.beats: list[float] = []
        self.logger = __import__("logging").getLogger("test-heartbeat")

    def _build_heartbeat_event_template(self) -> tuple[dict[str, str], list[Any]]:
        return {"prefect.resource.id": "x"}, []

    def _emit_flow_run_heartbeat(self, resource: dict[str, str], related: list[Any]) -> None:
        self.beats.append(time.monotonic())


def test_prefect_uses_it_after_the_flow_module_is_imported() -> None:
    import gridsolve.flows.pipeline  # noqa: F401  (installs it at import)

    assert engine_module._send_heartbeats is heartbeat.send_heartbeats
    # Prefect's own, as it was replaced, has the shape this was written against: a Prefect
    # upgrade that changes it fails here (install() would then keep Prefect's).
    prefects = types.SimpleNamespace(
        _send_heartbeats=heartbeat._ORIGINAL,
        FlowRunEngine=engine_module.FlowRunEngine,
        MINIMUM_HEARTBEAT_INTERVAL=engine_module.MINIMUM_HEARTBEAT_INTERVAL,
    )
    assert heartbeat._ORIGINAL is not None and heartbeat._replaceable(prefects)


def test_one_beat_at_start_and_none_after_the_block() -> None:
    engine = _Engine(seconds=30)
    before = set(threading.enumerate())
    t0 = time.monotonic()
    with heartbeat.send_heartbeats(engine):
        started = set(threading.enumerate()) - before
        deadline = time.monotonic() + 5
        while not engine.beats and time.monotonic() < deadline:
            time.sleep(0.01)
    left = time.monotonic() - t0
    assert len(engine.beats) == 1  # the first at once; the next would be 30 s later
    # Prefect's thread slept out its current second: joined here without waiting for it.
    assert left < 0.9, left
    assert not any(t.is_alive() for t in started)
    time.sleep(0.05)
    assert len(engine.beats) == 1


def test_no_beat_once_the_run_is_final_and_none_without_an_interval() -> None:
    done = _Engine(seconds=30)
    done.flow_run.state.final = True
    with heartbeat.send_heartbeats(done):
        time.sleep(0.05)
    assert done.beats == []
    off = _Engine(seconds=None)
    with heartbeat.send_heartbeats(off):
        time.sleep(0.05)
    assert off.beats == []


def test_a_failing_emit_does_not_stop_the_run() -> None:
    engine = _Engine(seconds=30)
    tried: list[int] = []

    def fail(*args: Any) -> None:
        tried.append(1)
        raise ConnectionError("server gone")

    engine._emit_flow_run_heartbeat = fail  # type: ignore[method-assign]
    with heartbeat.send_heartbeats(engine):
        deadline = time.monotonic() + 5
        while not tried and time.monotonic() < deadline:
            time.sleep(0.01)
    assert tried == [1]  # tried once, its error swallowed (the block ran on and ended)


def test_an_engine_of_another_shape_keeps_prefects() -> None:
    class Other:
        @staticmethod
        def _send_heartbeats(engine: Any) -> None:  # another signature
            return None

        FlowRunEngine = object
        MINIMUM_HEARTBEAT_INTERVAL = 30

    assert not heartbeat._replaceable(Other)
