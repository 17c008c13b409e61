"""Driving Prefect's UI in Debian's headless chromium: launch arguments and form fields."""

from __future__ import annotations

import re
import shutil
from typing import Any

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]


def field(page: Any, label: str) -> Any:
    """The form property whose label is ``label`` (innermost)."""
    cls = "contains(concat(' ', normalize-space(@class), ' '), ' schema-form-property ')"
    return page.get_by_text(label, exact=True).locator(f"xpath=ancestor::div[{cls}][1]")


def choose(page: Any, label: str, option: str) -> None:
    """Pick ``option`` in the select field labelled ``label``."""
    field(page, label).locator("button.p-select-button__control").focus()
    page.keyboard.press("ArrowDown")
    page.locator(".p-select-option", has_text=re.compile(f"^{re.escape(option)}$")).click()
