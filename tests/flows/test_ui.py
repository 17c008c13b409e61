"""The Prefect UI in a real headless chromium: a Custom run with a changed solve section."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

from testkit import make_ds
from ui_form import ARGS, CHROMIUM, choose, field

pytestmark = [
    pytest.mark.slow,
    pytest.mark.browser,
    pytest.mark.usefixtures("worker"),
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason="needs Debian chromium (.ci/install installs it)"
    ),
]


def runs_of(deployment_id: str) -> list[Any]:
    with get_client(sync_client=True) as client:
        return list(
            client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
            )
        )


def test_custom_run_from_the_form(
    prefect_server: Any, deployments: dict[str, str], tmp_path: Path, write_cube: Any
) -> None:
    from playwright.sync_api import sync_playwright

    cube = write_cube(make_ds(n_obs=20, ny=12, nx=12))
    dep = deployments["on-demand"]
    # Prefill where the run reads and writes, as the UI's own "Custom run" link does;
    # the solve section is then changed in the form itself.
    prefill = {
        "load": {"impl": "netcdf", "path": str(cube)},
        "design": {"impl": "polynomial", "degree": 3},
        "model": {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 3},
        "write": {"impl": "netcdf", "path": str(tmp_path / "ui-{flow_run_name}.nc")},
        "cache": {"root": str(tmp_path / "cache")},
    }
    encoded = quote(quote(json.dumps(prefill), safe=""), safe="")  # as the UI's own links do
    url = f"{prefect_server.url}/deployments/deployment/{dep}/run?parameters={encoded}"
    before = {r.id for r in runs_of(dep)}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        try:
            page.goto(url)
            field(page, "Ridge (Optional)").wait_for(timeout=60_000)
            page.wait_for_timeout(500)
            page.screenshot(path=str(tmp_path / "ui-form.png"), full_page=True)
            # Each section's implementation is a described field, not a bare const box.
            text = page.inner_text("body")
            assert "is a const" not in text
            assert "The solve implementation of this section: lstsq." in text
            assert "Ridge λ" in text  # field descriptions are shown

            # An invalid value is refused by the form, and nothing is created.
            choose(page, "Policy (Optional)", "ridge")
            field(page, "Ridge (Optional)").locator("input").fill("-1")
            page.get_by_role("button", name="Submit").click()
            page.get_by_text(
                re.compile("must be greater than or equal to 0|minimum", re.I)
            ).first.wait_for(timeout=10_000)
            page.screenshot(path=str(tmp_path / "ui-invalid.png"), full_page=True)
            assert {r.id for r in runs_of(dep)} == before

            field(page, "Ridge (Optional)").locator("input").fill("0.25")
            field(page, "Ridge (Optional)").locator("input").press("Tab")  # commit the value
            # A submit that goes through creates the run (the UI then returns to the
            # deployment's page). On a loaded machine the form sometimes still holds the
            # earlier error when the click lands; only then is it clicked again.
            for attempt in range(4):
                page.get_by_role("button", name="Submit").click()
                wait_until = time.monotonic() + 20
                while time.monotonic() < wait_until and not [
                    r for r in runs_of(dep) if r.id not in before
                ]:
                    time.sleep(0.5)
                if [r for r in runs_of(dep) if r.id not in before]:
                    break
                page.screenshot(path=str(tmp_path / f"ui-submit-{attempt}.png"))
            deadline = time.monotonic() + 300
            new: list[Any] = []
            while time.monotonic() < deadline:
                new = [r for r in runs_of(dep) if r.id not in before]
                if new and new[0].state is not None and new[0].state.is_final():
                    break
                time.sleep(2)
            assert len(new) == 1, new
            run = new[0]
            assert run.state is not None and run.state.is_completed(), run.state
            assert (
                run.parameters["solve"]["policy"] == "ridge"
                and run.parameters["solve"]["ridge"] == 0.25
            )
            assert run.parameters["load"]["path"] == str(cube)
            assert (tmp_path / f"ui-{run.name}.nc").is_file()

            page.goto(f"{prefect_server.url}/runs/flow-run/{run.id}")
            page.get_by_text("Artifacts", exact=True).first.click()
            page.get_by_text("gridsolve-summary").first.wait_for(timeout=60_000)
            page.wait_for_timeout(1000)
            shot = tmp_path / "ui-run-artifacts.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000

            # The quick-look picture is visible in the UI itself.
            page.get_by_text("gridsolve-quicklook").first.click()
            img = page.locator("img[src^='data:image/png']").first
            img.wait_for(timeout=30_000)
            page.wait_for_timeout(500)
            assert img.evaluate("e => e.naturalWidth") > 100
            page.screenshot(path=str(tmp_path / "ui-quicklook.png"), full_page=True)
        finally:
            browser.close()


def test_failed_run_log_in_the_ui_shows_the_message_once_without_traceback(
    prefect_server: Any, deployments: dict[str, str], tmp_path: Path
) -> None:
    """What a team sees on a failed run's page: one message, named stage, no traceback."""
    from playwright.sync_api import sync_playwright
    from prefect.deployments import run_deployment

    missing = tmp_path / "nowhere.nc"
    params = {
        "load": {"impl": "netcdf", "path": str(missing)},
        "design": {"impl": "polynomial", "degree": 1},
        "write": {"impl": "netcdf", "path": str(tmp_path / "out.nc")},
        "cache": {"root": str(tmp_path / "cache")},
    }
    run = run_deployment("gridsolve/on-demand", parameters=params, timeout=600)
    assert run.state is not None and run.state.is_failed(), run.state
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        try:
            page.goto(f"{prefect_server.url}/runs/flow-run/{run.id}")
            page.get_by_text("input file not found").first.wait_for(timeout=60_000)
            page.wait_for_timeout(2000)  # the rest of the log arrives
            shot = tmp_path / "ui-failed-log.png"
            page.screenshot(path=str(shot), full_page=True)
            text = page.inner_text("body")
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    assert "Traceback" not in text, text
    lines = [ln for ln in text.splitlines() if "input file not found" in ln]
    # once in the log (the run's state message is shown apart, in the header)
    log_lines = [ln for ln in lines if "[load/netcdf]" in ln]
    assert len(log_lines) == 1, lines
    assert str(missing) in text
