"""Registering implementations from outside gridsolve, and choosing them by config alone."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gridsolve.stages.engine.registry as registry
from gridsolve.schemas import catalog
from gridsolve.schemas.errors import ConfigError
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.pipeline import DEMO_DEFAULTS, PipelineConfig, build_config

from testkit import Chain


@pytest.fixture
def legendre() -> Any:
    import my_stage

    my_stage.install()
    yield my_stage
    my_stage.uninstall()


def test_explicit_registration_is_selected_by_config(
    legendre: Any, chain: Chain, cube_path: Path
) -> None:
    cfg = build_config({**DEMO_DEFAULTS, "design": {"impl": "legendre", "degree": 2}})
    assert type(cfg.design).__name__ == "LegendreDesign"
    chain.whole("load", NetCDFLoad(path=str(cube_path)))
    art = chain.whole("design", cfg.design)
    np.testing.assert_allclose(
        np.array(art.array("A"))[:, 2], 1.5 * np.linspace(-1, 1, 12) ** 2 - 0.5
    )
    assert '"enum": ["legendre"]' in str(PipelineConfig.model_json_schema()).replace("'", '"')
    with pytest.raises(ConfigError, match="less than or equal to 20"):
        build_config({**DEMO_DEFAULTS, "design": {"impl": "legendre", "degree": 99}})


def test_duplicate_and_mismatched_registrations_are_refused(legendre: Any) -> None:
    with pytest.raises(ConfigError, match="already registered"):
        registry.register(registry.StageDecl(**{**legendre.DECL.__dict__, "version": "2"}))
    with pytest.raises(ConfigError, match="impl default is 'legendre'"):
        registry.register(registry.StageDecl(**{**legendre.DECL.__dict__, "impl": "other"}))


def test_entry_point_plugin_is_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ep_plugin.py").write_text(
        "import my_stage\n\ndef register_all():\n    my_stage.install()\n"
    )
    dist = tmp_path / "gridsolve_ep_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: gridsolve-ep-plugin\nVersion: 0.1\n"
    )
    (dist / "entry_points.txt").write_text(
        "[gridsolve.stages]\nlegendre = ep_plugin:register_all\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setattr(catalog, "_plugins_loaded", False)
    try:
        assert "legendre" in registry.implementations("design")
        cfg = build_config({**DEMO_DEFAULTS, "design": {"impl": "legendre"}})
        assert cfg.design.impl == "legendre"
    finally:
        registry.unregister("design", "legendre")
    assert "ep_plugin" in sys.modules


def test_unknown_impl_lists_registered_ones() -> None:
    with pytest.raises(ConfigError) as err:
        registry.get("solve", "lsqr")
    assert "lstsq" in str(err.value) and "Did you mean 'lstsq'?" in str(err.value)


def test_a_plugin_replacing_a_built_in_before_first_use_wins(tmp_path: Path) -> None:
    """In a fresh process a plugin may register before any built-in has: it still wins."""
    import subprocess

    script = tmp_path / "plugin_first.py"
    script.write_text(
        "import sys\n"
        "from gridsolve.stages.engine import registry\n"
        "from gridsolve.schemas.kinds.solve import LstsqSolve\n"
        "def mine(*a, **k):\n"
        "    return None\n"
        "registry.register(registry.StageDecl(kind='solve', impl='lstsq', version='mine',\n"
        "    config=LstsqSolve, run=mine, prepare=mine, tiled=True), replace=True)\n"
        "print(registry.get('solve', 'lstsq').version,\n"
        "      sorted(registry.implementations('write')), 'torch' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split("\n")[-2] == "mine ['netcdf', 'zarr'] False", res.stdout
