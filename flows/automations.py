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
"""

from __future__ import annotations

from typing import Any

#: The tag of deployments whose runs are scheduled (the nightly one): see flows/pipeline.py.
SCHEDULED_TAG = "scheduled"
#: The flow's name (``@flow(name=...)`` in flows/pipeline.py).
FLOW_NAME = "gridsolve"
RETRY_CRASHED = "gridsolve: retry a crashed nightly run once"
#: How long a crashed run stays Crashed before the retry (the worker's late reports land).
SETTLE_SECONDS = 20


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


def install_automations() -> list[str]:
    """Create or update the shipped automations on the server of PREFECT_API_URL; their names."""
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    spec = AutomationCore.model_validate(retry_crashed_spec())
    with get_client(sync_client=True) as client:
        found = client.read_automations_by_name(spec.name)
        if found:
            # a team that paused it in the UI keeps it paused across deploys
            spec = spec.model_copy(update={"enabled": found[0].enabled})
            client.update_automation(found[0].id, spec)
            for extra in found[1:]:  # duplicates from older installs
                client.delete_automation(extra.id)
        else:
            client.create_automation(spec)
    return [spec.name]
