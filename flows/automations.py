"""The Prefect automations that ship with the deployments (installed by `gridsolve deploy`).

**retry-crashed-nightly**: a run of a deployment tagged ``scheduled`` (the
nightly) that ends Crashed (its process killed, the machine rebooted, the
worker stopped) is put back to AwaitingRetry once, SETTLE_SECONDS after the
crash unless someone retried it first. A worker of the pool then
runs the same flow run again, with the same parameters and scheduled date, and
every stage and tile already in the cache is reused. "Once" is the event's run
count: the retry runs as run 2, and a crash of run 2 matches nothing, so a
run that crashes every time cannot loop. Failed runs (bad input, a bug) are
not retried: they would fail the same way.

**crash-silent-runs**: a run of gridsolve's flow whose process stops sending
heartbeats (Prefect's flow engine sends one every
``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds, 180 by default) and reaches no
final state is marked Crashed ``SILENT_SECONDS`` after its last heartbeat. A
worker notices its own child dying and reports the crash; nobody does when the
whole machine dies (power, OOM killer of every process, a container evicted) or
the flow's process loses the server for good: without this the run stays
Running for ever and the retry above never fires. The window is 600 s (more than
three missed heartbeats at Prefect's default); ``GRIDSOLVE_SILENT_RUN_SECONDS``
at ``gridsolve deploy`` changes it, and ``gridsolve deploy`` refuses a window
shorter than twice the heartbeat interval it sees (a slow run would be crashed
while alive).
"""

from __future__ import annotations

import os
from typing import Any

from gridsolve.schemas.errors import ConfigError

#: The tag of deployments whose runs are scheduled (the nightly one): see flows/pipeline.py.
SCHEDULED_TAG = "scheduled"
#: The flow's name (``@flow(name=...)`` in flows/pipeline.py).
FLOW_NAME = "gridsolve"
RETRY_CRASHED = "gridsolve: retry a crashed nightly run once"
#: How long a crashed run stays Crashed before the retry (the worker's late reports land).
SETTLE_SECONDS = 20
CRASH_SILENT = "gridsolve: mark a run that stopped sending heartbeats crashed"
#: Seconds without a heartbeat (or a final state) after which a run is marked Crashed.
SILENT_SECONDS = 600
SILENT_ENV = "GRIDSOLVE_SILENT_RUN_SECONDS"
#: Prefect's heartbeat setting and its default (prefect/settings/models/flows.py).
HEARTBEAT_ENV = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
HEARTBEAT_DEFAULT = 180


def retry_crashed_spec() -> dict[str, Any]:
    """The automation as Prefect's API takes it (an AutomationCore)."""
    return {
        "name": RETRY_CRASHED,
        "description": "A crashed run of a deployment tagged 'scheduled' is retried once; "
        "its cached stages and tiles are reused (gridsolve's flows/automations.py).",
        "enabled": True,
        "trigger": {
            # Proactive: a run-1 Crashed event not followed within SETTLE_SECONDS by the
            # run starting again (someone pressed Retry). The wait also lets the worker's
            # own, later crash report of the same process land on the crashed run
            # rather than on the retry (seen: it crashed a retry started at once).
            "type": "event",
            "posture": "Proactive",
            "after": ["prefect.flow-run.Crashed"],
            "expect": ["prefect.flow-run.Pending", "prefect.flow-run.Running"],
            "for_each": ["prefect.resource.id"],
            "match": {"prefect.resource.id": "prefect.flow-run.*", "prefect.run-count": "1"},
            # every entry must match: a run of gridsolve's flow AND tagged scheduled
            # (another project's crashed 'scheduled' run on a shared server is not ours)
            "match_related": [
                {"prefect.resource.role": "flow", "prefect.resource.name": FLOW_NAME},
                {
                    "prefect.resource.role": "tag",
                    "prefect.resource.id": f"prefect.tag.{SCHEDULED_TAG}",
                },
            ],
            "threshold": 1,
            "within": SETTLE_SECONDS,
        },
        "actions": [
            {
                "type": "change-flow-run-state",
                "state": "SCHEDULED",
                "name": "AwaitingRetry",
                "message": "gridsolve: retried once after a crash (cached work is reused)",
            }
        ],
    }


def silent_seconds(env: dict[str, str] | None = None) -> int:
    """The silent-run window: ``GRIDSOLVE_SILENT_RUN_SECONDS``, else :data:`SILENT_SECONDS`.

    ConfigError when it is not a whole number of seconds, or shorter than twice the
    heartbeat interval (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``) in ``env``.
    """
    env = dict(os.environ) if env is None else env
    raw = env.get(SILENT_ENV, "").strip()
    heartbeat_raw = env.get(HEARTBEAT_ENV, "").strip()
    try:
        window = int(raw) if raw else SILENT_SECONDS
        heartbeat = max(30, int(heartbeat_raw)) if heartbeat_raw else HEARTBEAT_DEFAULT
    except ValueError:
        raise ConfigError(
            f"{SILENT_ENV}={raw!r} or {HEARTBEAT_ENV}={heartbeat_raw!r} is not a whole number "
            "of seconds",
            fix=f"set {SILENT_ENV} to seconds (default {SILENT_SECONDS})",
        ) from None
    if window < 2 * heartbeat:
        raise ConfigError(
            f"{SILENT_ENV}={window} is shorter than twice the flow runs' heartbeat interval "
            f"({heartbeat} s): runs that are alive would be marked crashed",
            fix=f"set {SILENT_ENV} to at least {3 * heartbeat}, or lower {HEARTBEAT_ENV}",
        )
    return window


def crash_silent_spec(window: int = SILENT_SECONDS) -> dict[str, Any]:
    """The silent-run automation as Prefect's API takes it (an AutomationCore)."""
    return {
        "name": CRASH_SILENT,
        "description": f"A run of gridsolve's flow with no heartbeat and no final state for "
        f"{window} s (its machine died, or it lost the server) is marked Crashed, so that "
        "the crash retry can run it again (gridsolve's flows/automations.py).",
        "enabled": True,
        "trigger": {
            # Proactive: after a heartbeat, neither another heartbeat nor a final state
            # of the same run within the window.
            "type": "event",
            "posture": "Proactive",
            "after": ["prefect.flow-run.heartbeat"],
            "expect": [
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            ],
            "for_each": ["prefect.resource.id"],
            "match": {"prefect.resource.id": "prefect.flow-run.*"},
            "match_related": [
                {"prefect.resource.role": "flow", "prefect.resource.name": FLOW_NAME}
            ],
            "threshold": 1,
            "within": window,
        },
        "actions": [
            {
                "type": "change-flow-run-state",
                "state": "CRASHED",
                "message": f"gridsolve: no heartbeat for {window} s; the run's process or "
                "machine died, or it lost the server",
            }
        ],
    }


def install_automations() -> list[str]:
    """Create or update the shipped automations on the server of PREFECT_API_URL; their names."""
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    window = silent_seconds()
    specs = [
        AutomationCore.model_validate(retry_crashed_spec()),
        AutomationCore.model_validate(crash_silent_spec(window)),
    ]
    with get_client(sync_client=True) as client:
        for i, spec in enumerate(specs):
            found = client.read_automations_by_name(spec.name)
            if found:
                # a team that paused it in the UI keeps it paused across deploys
                specs[i] = spec = spec.model_copy(update={"enabled": found[0].enabled})
                client.update_automation(found[0].id, spec)
                for extra in found[1:]:  # duplicates from older installs
                    client.delete_automation(extra.id)
            else:
                client.create_automation(spec)
    return [spec.name for spec in specs]
