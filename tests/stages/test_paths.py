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


def test_a_worker_confines_runs_by_default_and_its_operator_decides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gridsolve.schemas import confinement
    from gridsolve.schemas.errors import ConfigError, InputError
    from gridsolve.stages.engine import paths

    home = tmp_path / "gridsolve"
    env: dict[str, str] = {confinement.ALLOWED_MODULES_ENV: "gridsolve mylab"}  # set: it wins
    said = confinement.confine(env, home)
    assert env[confinement.ALLOWED_ROOTS_ENV] == str(home)
    assert env[confinement.ALLOWED_INPUTS_ENV] == str(home / "data")
    assert env[confinement.ALLOWED_URLS_ENV] == ""
    assert env[confinement.ALLOWED_MODULES_ENV] == "gridsolve mylab"
    assert f"write under {home}" in said and "buckets: nowhere" in said
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # what a UI custom run tried (issue 32): all refused under the defaults
    with pytest.raises(InputError, match="outside the places this worker may read from"):
        paths.ensure_input_allowed("/etc/passwd", "load.path")
    with pytest.raises(OutputError):
        paths.ensure_allowed(home / ".." / "elsewhere.nc", "output file")
    with pytest.raises(OutputError, match=r"\(none allowed\)"):
        paths.ensure_allowed_url("s3://anybucket/out.nc", "output URL")
    with pytest.raises(ConfigError, match="not one this worker may import"):
        paths.ensure_module_allowed("os")
    paths.ensure_input_allowed(str(home / "data" / "sst.nc"), "load.path")
    paths.ensure_module_allowed("mylab.models")
    assert paths.ensure_allowed(home / "outputs" / "x.nc", "output file").name == "x.nc"

    # --unconfined: '*' everywhere, nothing refused
    free: dict[str, str] = {}
    assert "anywhere" in confinement.confine(free, home, unconfined=True)
    for name, value in free.items():
        monkeypatch.setenv(name, value)
    paths.ensure_input_allowed("/etc/passwd", "load.path")
    paths.ensure_module_allowed("os")
    assert paths.ensure_allowed_url("s3://anybucket/out.nc", "output URL")
    assert paths.ensure_allowed(tmp_path / "anywhere.nc", "output file").name == "anywhere.nc"


def test_an_empty_allowance_is_unset_and_the_workers_line_says_what_is_enforced(
    tmp_path: Path,
) -> None:
    from gridsolve.schemas import confinement

    home = tmp_path / "gridsolve"
    env = {
        confinement.ALLOWED_ROOTS_ENV: "",
        confinement.ALLOWED_INPUTS_ENV: "  ",
    }  # compose's ${VAR:-}
    confinement.confine(env, home)
    assert env[confinement.ALLOWED_ROOTS_ENV] == str(home)
    assert env[confinement.ALLOWED_INPUTS_ENV] == str(home / "data")
    # local writes unconfined: so are bucket writes, and the line says so
    free = {confinement.ALLOWED_ROOTS_ENV: "*"}
    said = confinement.confine(free, home)
    assert "write under anywhere (buckets: anywhere)" in said
