"""The documentation site (mkdocs.yml, docs/) and the README that points into it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).parent / "mkdocs"


def nav_pages() -> list[str]:
    """Every page the site's navigation lists, as paths under docs/."""
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    found: list[str] = []

    def walk(items: list[object]) -> None:
        for item in items:
            if isinstance(item, dict):
                for value in item.values():
                    walk(value if isinstance(value, list) else [value])
            elif isinstance(item, str):
                found.append(item)

    walk(nav)
    return found


@pytest.mark.slow  # builds the site and runs every example on it: ≈ 40 s
def test_the_site_builds_with_warnings_as_errors_and_its_examples_run(tmp_path: Path) -> None:
    # The phenology recipe runs `gridsolve run`. conftest.py points PREFECT_API_URL at
    # the session's server, which this test does not start; empty, the CLI takes it as
    # unset and Prefect starts its temporary server for the run, as on a reader's machine.
    res = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PREFECT_API_URL": ""},
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    # the executed pages hold their examples' output, not only their source
    page = (tmp_path / "site" / "getting-started" / "index.html").read_text()
    assert "trend at the equator:" in page and "degC per decade (made with" in page
    trend = (tmp_path / "site" / "recipes" / "trend-significance" / "index.html").read_text()
    assert "statsmodels p-value of t:" in trend and "data:image/png;base64," in trend
    pheno = (tmp_path / "site" / "recipes" / "phenology" / "index.html").read_text()
    assert "phenology.nc holds the same fit:" in pheno and "sos: RMS error" in pheno
    assert "data:image/png;base64," in pheno


def test_every_docs_page_is_in_the_navigation() -> None:
    pages = set(nav_pages())
    on_disk = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert on_disk == pages


def test_the_readme_is_short_and_links_every_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    links = set(re.findall(r"\]\((docs/[^)#]+)", readme))
    for link in links:
        assert (REPO / link).is_file(), link
    assert {f"docs/{p}" for p in nav_pages()} - {"docs/index.md"} <= links
