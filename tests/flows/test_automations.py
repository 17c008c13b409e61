"""The automations `gridsolve deploy` installs, as specs (their effect: test_crash_retry.py)."""

from __future__ import annotations

import pytest
from prefect.events.schemas.automations import AutomationCore, Posture

from gridsolve.flows.automations import (
    CRASH_SILENT,
    SILENT_SECONDS,
    crash_silent_spec,
    retry_crashed_spec,
    silent_seconds,
)
from gridsolve.schemas.errors import ConfigError


def test_the_silent_run_window_defaults_to_600_s_and_can_be_set() -> None:
    assert silent_seconds({}) == SILENT_SECONDS == 600
    assert silent_seconds({"GRIDSOLVE_SILENT_RUN_SECONDS": "900"}) == 900
    assert (
        silent_seconds(
            {"GRIDSOLVE_SILENT_RUN_SECONDS": "120", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}
        )
        == 120
    )


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"GRIDSOLVE_SILENT_RUN_SECONDS": "300"}, "shorter than twice"),  # default 180 s beats
        (
            {"GRIDSOLVE_SILENT_RUN_SECONDS": "100", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "60"},
            "at least 180",
        ),
        ({"GRIDSOLVE_SILENT_RUN_SECONDS": "ten minutes"}, "not a whole number"),
    ],
)
def test_a_window_that_would_crash_live_runs_is_refused(env: dict[str, str], said: str) -> None:
    with pytest.raises(ConfigError) as err:
        silent_seconds(env)
    assert said in str(err.value) or said in (err.value.fix or ""), str(err.value)


def test_the_silent_run_automation_is_a_valid_proactive_trigger_on_heartbeats() -> None:
    spec = AutomationCore.model_validate(crash_silent_spec(120))
    assert spec.name == CRASH_SILENT
    trigger = spec.trigger
    assert trigger.posture == Posture.Proactive  # type: ignore[union-attr]
    assert trigger.after == {"prefect.flow-run.heartbeat"}  # type: ignore[union-attr]
    assert {"prefect.flow-run.Completed", "prefect.flow-run.Crashed"} <= trigger.expect  # type: ignore[union-attr]
    assert trigger.within.total_seconds() == 120  # type: ignore[union-attr]
    assert spec.actions[0].type == "change-flow-run-state"
    assert AutomationCore.model_validate(retry_crashed_spec()).enabled
