"""Flow-run heartbeats that stop as soon as the run ends.

Prefect's flow engine sends a flow run's heartbeats from a thread that sleeps in
one-second steps and joins it as the run ends: every run waited for the rest of
that second, 0.5 s on average (measured here: "flow run end" of
``gridsolve run --profile`` 0.14–0.84 s). This is the same heartbeat context
(``prefect.flow_engine._send_heartbeats``: the same events, the same interval,
no heartbeat once the run's state is final, the thread joined before the run
returns) with the thread waiting on its stop event instead, so that it ends
when told.

It was written against Prefect 3.9's, and replaces it (in every flow run of a
process that imported gridsolve's flow) only where Prefect's has the same
signature and the engine the methods and minimum interval it uses; elsewhere
Prefect's own runs, unchanged. Either way the heartbeats that mark a dead run
Crashed (``flows/automations.py``) are sent; tests/flows/test_heartbeat.py fails
when a Prefect upgrade changes the function's shape, so that this is looked at
again.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import threading
from collections.abc import Iterator
from typing import Any

#: Prefect's, as replaced (None until :func:`install` replaced it): the tests check its shape.
_ORIGINAL: Any = None


@contextlib.contextmanager
def send_heartbeats(engine: Any, join_on_exit: bool = True) -> Iterator[None]:
    """Heartbeats of ``engine``'s flow run every ``engine.heartbeat_seconds``, while inside."""
    from prefect.flow_engine import MINIMUM_HEARTBEAT_INTERVAL

    seconds = engine.heartbeat_seconds
    if seconds is None:
        yield
        return
    seconds = max(seconds, MINIMUM_HEARTBEAT_INTERVAL)
    resource, related = engine._build_heartbeat_event_template()
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            run = engine.flow_run
            if run and run.state and run.state.is_final():
                engine.logger.debug("Flow run in terminal state, stopping heartbeat")
                return
            try:
                engine._emit_flow_run_heartbeat(resource, related)
            except Exception:
                engine.logger.debug("Failed to emit heartbeat", exc_info=True)
            if stop.wait(seconds):
                return

    # As Prefect's: the thread sees the caller's settings (its PREFECT_API_URL).
    thread = threading.Thread(target=contextvars.copy_context().run, args=(beat,), daemon=True)
    thread.start()
    engine.logger.debug("Started flow run heartbeat context")
    try:
        yield
    finally:
        stop.set()
        if join_on_exit:
            thread.join(timeout=2)
        engine.logger.debug("Stopped flow run heartbeat context")


def _replaceable(engine_module: Any) -> bool:
    """Whether Prefect's heartbeat context is the one this module was written against."""
    original = getattr(engine_module, "_send_heartbeats", None)
    engine = getattr(engine_module, "FlowRunEngine", None)
    if original is None or engine is None:
        return False
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return False
    return (
        params == ["engine", "join_on_exit"]
        and isinstance(getattr(engine_module, "MINIMUM_HEARTBEAT_INTERVAL", None), int)
        and all(
            callable(getattr(engine, name, None))
            for name in ("_build_heartbeat_event_template", "_emit_flow_run_heartbeat")
        )
    )


def install() -> bool:
    """Use :func:`send_heartbeats` in Prefect's flow engine; whether it is in use."""
    global _ORIGINAL
    import prefect.flow_engine as engine_module

    if engine_module._send_heartbeats is send_heartbeats:
        return True
    if not _replaceable(engine_module):
        return False
    _ORIGINAL = engine_module._send_heartbeats
    engine_module._send_heartbeats = send_heartbeats
    return True
