"""Where runs may write: allowed roots, templated names that cannot climb out, loopback servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from gridsolve.schemas.errors import OutputError
from gridsolve.schemas.templating import render_template
from gridsolve.stages.engine.paths import ALLOWED_ROOTS_ENV, ensure_allowed
from gridsolve.stages.engine.store import Store


def test_allowed_roots_confine_outputs_and_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "data"
    root.mkdir()
    monkeypatch.setenv(ALLOWED_ROOTS_ENV, str(root))
    assert ensure_allowed(root / "out" / "x.nc", "output file") == (root / "out" / "x.nc").resolve()
    with pytest.raises(OutputError, match="outside the folders this worker may write to"):
        ensure_allowed(root / ".." / "elsewhere.nc", "output file")
    (root / "link").symlink_to(tmp_path)
    with pytest.raises(OutputError):
        ensure_allowed(root / "link" / "escape.nc", "output file")  # symbolic links are followed
    with pytest.raises(OutputError, match="cache folder"):
        Store(tmp_path / "cache")


def test_no_restriction_without_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ALLOWED_ROOTS_ENV, raising=False)
    assert ensure_allowed(tmp_path / "anywhere.nc", "output file").name == "anywhere.nc"


@pytest.mark.parametrize("name", ["../../etc/passwd", "a/b", "..", "x..y", "ok-name_1.2"])
def test_template_values_stay_one_path_component(name: str) -> None:
    out = render_template("/data/out/{flow_run_name}.nc", {"flow_run_name": name})
    assert out.startswith("/data/out/") and out.count("/") == 3 and ".." not in out
