"""Placeholders in templated paths (``load.path``, ``write.path``): which exist, how filled."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime


def template_values(
    *,
    now: datetime,
    scheduled: datetime | None,
    flow_run_name: str | None,
    flow_run_id: str | None,
    deployment: str | None,
) -> dict[str, str]:
    """The value of every placeholder for one run (``local`` where a run has no such fact)."""
    sched = scheduled.astimezone(UTC) if scheduled is not None else now.astimezone(UTC)
    return {
        "date": now.astimezone(UTC).strftime("%Y-%m-%d"),
        "scheduled_date": sched.strftime("%Y-%m-%d"),
        "scheduled_time": sched.strftime("%Y%m%dT%H%M%SZ"),
        "flow_run_name": flow_run_name or "local",
        "flow_run_id": flow_run_id or "local",
        "deployment": deployment or "local",
    }


#: Placeholders allowed in templated paths: exactly those :func:`template_values` fills.
TEMPLATE_FIELDS = frozenset(
    template_values(
        now=datetime(1970, 1, 1, tzinfo=UTC),
        scheduled=None,
        flow_run_name=None,
        flow_run_id=None,
        deployment=None,
    )
)


def check_template(text: str) -> str:
    """``text`` unchanged if its ``{placeholders}`` are all known, else ValueError."""
    unknown = set(re.findall(r"{(\w*)}", text)) - TEMPLATE_FIELDS
    if unknown:
        raise ValueError(
            f"unknown placeholder(s) {sorted(unknown)}; allowed: {sorted(TEMPLATE_FIELDS)}"
        )
    return text


def render_template(text: str, values: Mapping[str, str]) -> str:
    """``text`` with its ``{name}`` placeholders replaced by ``values``.

    Values become single path components: anything but letters, digits, ``-``,
    ``_`` and ``.`` is replaced by ``_``, and ``..`` cannot be produced, so a
    run name can never move a path to another folder.
    """

    def safe(name: str) -> str:
        value = re.sub(r"[^\w.-]", "_", values[name])
        return re.sub(r"\.\.+", "_", value) or "_"

    return re.sub(r"{(\w+)}", lambda m: safe(m.group(1)), text)
