"""One import name: the wheel installs only ``gridsolve``; local folders cannot shadow it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_installs_only_the_gridsolve_top_level_name(tmp_path: Path) -> None:
    # Built from a copy (links kept as links) so that no build/ folder lands in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("gridsolve", "flows", "stages", "schemas"):
        shutil.copytree(
            REPO / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [wheel] = tmp_path.glob("gridsolve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"gridsolve"}
    # the links were followed: real files, the registry and the flow are inside
    assert "gridsolve/stages/engine/registry.py" in names
    assert "gridsolve/flows/pipeline.py" in names
    assert "gridsolve/schemas/kinds/solve.py" in names
    # every package of the tree is listed in pyproject's packages (none left out of the wheel)
    for top in ("flows", "stages", "schemas"):
        for init in (REPO / top).rglob("__init__.py"):
            assert f"gridsolve/{init.relative_to(REPO).as_posix()}" in names, init
    # the C sources the solve kernels are built from on first use (an installed, not
    # editable, gridsolve has no checkout to build them from)
    from gridsolve.stages.solve.kernel import CODE_FILES

    for f in CODE_FILES:
        assert f"gridsolve/stages/solve/{f}" in names, f


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.usefixtures("prefect_server")
def test_local_folders_named_like_the_packages_do_not_shadow_them(tmp_path: Path) -> None:
    # A project folder with its own flows/, stages/ and schemas/ (and tests/ on PYTHONPATH).
    for name in ("flows", "stages", "schemas"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('shadowed!')\n")
    config = tmp_path / "gridsolve.yaml"
    config.write_text("load: {impl: demo}\ndesign: {impl: polynomial, degree: 1}\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    gridsolve = Path(sys.executable).with_name("gridsolve")
    proc = subprocess.run(
        [str(gridsolve), "validate", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "shadowed" not in proc.stdout + proc.stderr
    # and the main job runs there too (the demo cube, on the test session's Prefect server)
    demo = subprocess.run(
        [str(gridsolve), "demo", "--out", str(tmp_path / "demo")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert (tmp_path / "demo" / "output.nc").is_file()
