"""Reading a config as written: strict ``--set`` values, duplicate keys, its folder's paths."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import xarray as xr
import yaml

from testkit import make_ds, run_yaml

GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")


def gridsolve(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GRIDSOLVE, *args], cwd=cwd, capture_output=True, text=True, timeout=900, env=os.environ
    )


def write_config(folder: Path, **sections: object) -> Path:
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(folder / "cube.nc")
    raw = {
        "load": {"path": "cube.nc"},
        "design": {"impl": "polynomial", "degree": 1},
        "model": {"input_dim": 2, "hidden_dim": 1},
        "write": {"path": "out.nc"},
        **sections,
    }
    p = folder / "gridsolve.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("design.degree=true", ["design.degree", "true is a bool"]),
        ("design.degree=0x10", ["design.degree", "'0x10'"]),
        ("design.degree=0o20", ["design.degree", "'0o20'"]),
        ("execution.max_workers=false", ["execution.max_workers", "false is a bool"]),
        ("solve.ridge=true", ["solve.ridge", "true is a bool"]),
        ("design.degree=1_0", ["design.degree", "'1_0' is text"]),
        ("solve.ridge=1_0.5", ["solve.ridge", "'1_0.5' is text"]),
    ],
)
def test_a_bool_or_hex_for_a_number_is_refused(
    tmp_path: Path, override: str, needles: list[str]
) -> None:
    res = gridsolve("validate", str(write_config(tmp_path)), "--set", override)
    assert res.returncode == 2, res.stdout
    assert "Traceback" not in res.stderr
    for needle in needles:
        assert needle in res.stderr, res.stderr


def test_digits_with_underscores_in_a_file_are_text_not_numbers(tmp_path: Path) -> None:
    """YAML 1.2 reads ``2_0`` as text: a number field refuses it, as it does ``0x10``."""
    config = write_config(tmp_path)
    text = config.read_text()
    assert "degree: 1\n" in text
    config.write_text(text.replace("degree: 1\n", "degree: 2_0\n"))
    res = gridsolve("validate", str(config))
    assert res.returncode == 2, res.stdout
    assert "design.degree" in res.stderr and "'2_0' is text" in res.stderr, res.stderr


def test_plain_numbers_and_bools_still_work(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    # validate opens the cube: a variable named "no" must be in the file
    make_ds(n_obs=8, ny=3, nx=4).rename(signal="no").to_netcdf(tmp_path / "cube.nc")
    res = gridsolve(
        "validate",
        str(config),
        "--set",
        "design.degree=3",
        "--set",
        "solve.policy=ridge",
        "--set",
        "solve.ridge=1e-3",
        "--set",
        "write.zlib=false",
        "--set",
        "load.variable=no",  # YAML 1.1's bool: a name here
    )
    assert res.returncode == 0, res.stderr
    shown = yaml.safe_load(res.stdout.rsplit("config is valid", 1)[0])
    assert shown["design"]["degree"] == 3
    assert shown["solve"]["ridge"] == 0.001
    assert shown["write"]["zlib"] is False
    assert shown["load"]["variable"] == "no"


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_duplicate_keys_name_the_key_and_both_lines(tmp_path: Path) -> None:
    make_ds(n_obs=8, ny=3, nx=4).to_netcdf(tmp_path / "cube.nc")
    cfg = tmp_path / "dup.yaml"
    cfg.write_text(
        "load:\n"  # 1
        "  path: cube.nc\n"  # 2
        "design:\n"  # 3
        "  impl: polynomial\n"  # 4
        "  degree: 1\n"  # 5
        "  degree: 2\n"  # 6
        "load:\n"  # 7
        "  path: other.nc\n"  # 8
    )
    for command in ("validate", "run"):
        res = gridsolve(command, str(cfg))
        assert res.returncode == 2, res.stdout
        assert "'load' on lines 1 and 7" in res.stderr, res.stderr
        assert "'design.degree' on lines 5 and 6" in res.stderr, res.stderr
    assert not (tmp_path / "gridsolve-output.nc").exists()


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.usefixtures("prefect_server")
def test_a_rerun_from_another_folder_hits_the_same_cache(tmp_path: Path) -> None:
    """No cache section: the default cache.root is in the config's folder, wherever it runs."""
    project = tmp_path / "project"
    project.mkdir()
    cfg = write_config(project)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    first = gridsolve("run", str(cfg), cwd=project)
    assert first.returncode == 0, first.stderr[-3000:]
    again = gridsolve("run", "../project/gridsolve.yaml", cwd=elsewhere)
    assert again.returncode == 0, again.stderr[-3000:]
    table = again.stdout.split("tiles:")[0].splitlines()
    rows = table[table.index(next(ln for ln in table if ln.startswith("---"))) + 1 :]
    assert len(rows) >= 5 and all(re.search(r"\bhit\b", ln) for ln in rows), again.stdout
    assert (project / ".gridsolve-cache").is_dir() and (project / "out.nc").is_file()
    assert not (tmp_path / ".gridsolve-cache").exists()
    assert not (elsewhere / ".gridsolve-cache").exists()


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.usefixtures("prefect_server")
def test_a_trend_without_a_model_section_writes_what_ran_and_is_cached(tmp_path: Path) -> None:
    """No model section: no model runs; the output holds solve's variables; a rerun all hits."""
    make_ds(n_obs=24, ny=4, nx=5, nan_fraction=0.1).to_netcdf(tmp_path / "cube.nc")
    raw = {
        "load": {"path": "cube.nc", "variable": "signal"},
        "design": {"impl": "polynomial", "degree": 1},
        "solve": {"uncertainty": "stderr"},
        "write": {"path": "out.nc"},
        "cache": {"root": "cache"},
    }
    first = run_yaml(tmp_path / "trend.yaml", raw)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "model" not in first.stdout.split("tiles:")[0]  # no model row in the stage table
    with xr.open_dataset(tmp_path / "out.nc") as ds:
        names = set(ds.data_vars)
        assert "prediction" not in names and "model_status" not in names
        assert not any(n.startswith(("grad_", "jac_")) for n in names)
        assert {"coefficients", "coef_stderr", "p_value", "trend", "status"} <= names
        assert "output" not in ds.dims
    again = run_yaml(tmp_path / "trend.yaml", raw)
    assert again.returncode == 0, again.stderr[-3000:]
    table = again.stdout.split("tiles:")[0]
    kinds = ("load", "design", "normal_equations", "solve", "write")
    rows = [line for line in table.splitlines() if line.split()[:1] and line.split()[0] in kinds]
    assert len(rows) == 5 and all(" hit " in r for r in rows), table
