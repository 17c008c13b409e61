"""The current flow run's deployment, read from the run's own context.

``prefect.runtime.deployment`` asks the API for the flow run on every read when
the run has no deployment (a CLI or local run), and the flow reads it several
times: about 0.1 s each with a server on this machine. The flow run in the
context already carries its deployment id.
"""

from __future__ import annotations

import functools
from uuid import UUID

from prefect.context import FlowRunContext
from prefect.runtime import deployment as rt_deployment


def deployment_id() -> str | None:
    """The id of the current flow run's deployment; None for a CLI or local run."""
    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow_run is not None:
        found = ctx.flow_run.deployment_id
        return str(found) if found else None
    outside = rt_deployment.id  # outside the flow's own context (e.g. on a Dask worker)
    return str(outside) if outside else None


def deployment_name() -> str | None:
    """The name of the current flow run's deployment; None for a CLI or local run."""
    found = deployment_id()
    return None if found is None else _name(found)


@functools.lru_cache(maxsize=16)
def _name(deployment: str) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_deployment(UUID(deployment)).name
