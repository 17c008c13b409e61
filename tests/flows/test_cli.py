"""The gridsolve command: real subprocesses, one clear message and exit 2 on bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import yaml

from gridsolve.schemas.contracts import STATUS_CODES

from testkit import CONTRACT, make_ds

GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")


def gridsolve(
    *args: str, cwd: Path | None = None, timeout: float = 900, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GRIDSOLVE, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )


#: `gridsolve ARGS` in this interpreter's main(), its own output swallowed; then its exit
#: code and which of the modules named in PROBED it imported.
IMPORT_PROBE = (
    "import os, sys, io, contextlib\n"
    "from gridsolve.flows.cli import main\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n"
    "    rc = main(sys.argv[1:])\n"
    "heavy = sorted(m for m in os.environ['PROBED'].split(',') if m in sys.modules)\n"
    "print(rc, ','.join(heavy) or '-')\n"
)


def cli_imports(*args: str, probed: tuple[str, ...] = ("h5py", "torch", "prefect")) -> str:
    """``"<exit code> <probed modules imported, or ->"`` of `gridsolve ARGS` in a fresh process."""
    res = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PROBED": ",".join(probed)},
    )
    lines = res.stdout.strip().splitlines()
    assert lines, res.stderr[-3000:]
    return lines[-1]


def write_config(tmp_path: Path, cube: Path, **extra: Any) -> Path:
    raw = {
        "load": {"path": str(cube)},
        "design": {"impl": "polynomial", "degree": 3},
        "model": {"input_dim": 2, "hidden_dim": 2},
        "write": {"path": "out.nc"},
        "cache": {"root": "cache"},
        **extra,
    }
    p = tmp_path / "gridsolve.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def assert_clean_failure(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    for n in needles:
        assert n in res.stderr, res.stderr


def test_schema_is_json_with_every_stage() -> None:
    res = gridsolve("schema")
    assert res.returncode == 0
    schema = json.loads(res.stdout)
    assert set(schema["properties"]) == {
        "load",
        "design",
        "normal_equations",
        "solve",
        "train",
        "model",
        "write",
        "cache",
        "execution",
    }


def test_validate_good_and_bad(tmp_path: Path) -> None:
    cube = tmp_path / "cube.nc"
    make_ds().to_netcdf(cube)
    cfg = write_config(tmp_path, cube)
    ok = gridsolve("validate", str(cfg))
    assert ok.returncode == 0 and "config is valid" in ok.stdout
    bad = gridsolve(
        "validate", str(cfg), "--set", "solve.polcy=ridge", "--set", "write.complevel=99"
    )
    assert_clean_failure(bad, "solve.polcy: unknown key", "write.complevel")


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_reading_commands_import_neither_torch_nor_prefect(tmp_path: Path) -> None:
    """`schema` and `validate` are cheap: they import neither torch nor Prefect."""
    cube = tmp_path / "cube.nc"
    make_ds().to_netcdf(cube)
    plain = write_config(tmp_path, cube).rename(tmp_path / "plain.yaml")
    cfg = write_config(
        tmp_path, cube, model={"impl": "module", "target": "torch.nn:Identity", "input_shape": [4]}
    )
    for args, expect in (
        (["schema"], "0 -"),
        (["validate", str(plain)], "0 -"),
        # a config that names a model class imports that class's module, as it must
        (["validate", str(cfg)], "0 torch"),
    ):
        assert cli_imports(*args) == expect, args
    bad = write_config(
        tmp_path, cube, model={"impl": "module", "target": "nosuch.mod:X", "input_shape": [4]}
    )
    assert_clean_failure(gridsolve("validate", str(bad)), "cannot import module 'nosuch.mod'")


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.server
@pytest.mark.usefixtures("prefect_server")
def test_missing_input_fails_cleanly_without_output(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, tmp_path / "missing.nc")
    # Prefect's default console level, as a user has it: its run log shows there too.
    res = gridsolve("run", str(cfg), PREFECT_LOGGING_LEVEL="INFO")
    assert_clean_failure(res, "input file not found", "load.path")
    assert res.stderr.count("input file not found") == 1, res.stderr  # printed once
    assert "Finished in state Failed" in res.stderr  # Prefect's own log is still there
    assert not (tmp_path / "out.nc").exists()


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_an_empty_prefect_api_url_counts_as_unset(tmp_path: Path) -> None:
    """`PREFECT_API_URL= gridsolve run …`: Prefect's temporary server, and no event errors."""
    cube = tmp_path / "cube.nc"
    make_ds(n_obs=12, ny=4, nx=5).to_netcdf(cube)
    res = gridsolve("run", str(write_config(tmp_path, cube)), PREFECT_API_URL="")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "ERROR" not in res.stderr, res.stderr[-3000:]
    assert (tmp_path / "out.nc").is_file()


@pytest.mark.parametrize("user_set", [None, "7"])
def test_the_wait_for_prefects_temporary_server_is_long_unless_the_user_set_it(
    monkeypatch: pytest.MonkeyPatch, user_set: str | None
) -> None:
    """Prefect's 20 s ended runs on a loaded host whose first temporary server was slower."""
    from gridsolve.flows import cli

    # set first, so that monkeypatch restores the variable main() sets as it was before
    monkeypatch.setenv(cli.STARTUP_TIMEOUT_ENV, user_set or "")
    if user_set is None:
        monkeypatch.delenv(cli.STARTUP_TIMEOUT_ENV)
    seen: list[str | None] = []
    monkeypatch.setitem(
        cli.COMMANDS, "schema", lambda args: seen.append(os.environ.get(cli.STARTUP_TIMEOUT_ENV))
    )
    assert cli.main(["schema"]) is None  # the stand-in command's return
    assert seen == [user_set or "120"]
    from prefect.settings import Settings

    # the name is the one Prefect reads (settings made afresh from the environment)
    assert str(Settings().server.ephemeral.startup_timeout_seconds) == seen[0]


def test_bad_override_syntax(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, tmp_path / "cube.nc")
    assert_clean_failure(gridsolve("run", str(cfg), "--set", "solve.ridge"), "key=value")


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.usefixtures("prefect_server")
def test_demo_then_rerun_hits_the_cache(tmp_path: Path) -> None:
    res = gridsolve("demo", "--out", str(tmp_path / "demo"))
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "demo" / "output.nc"
    with xr.open_dataset(out) as ds:
        assert set(ds.data_vars) >= CONTRACT
    again = gridsolve("run", str(tmp_path / "demo" / "gridsolve.yaml"))
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [
        line.split()
        for line in again.stdout.splitlines()
        if line.split()[:1]
        and line.split()[0] in ("load", "design", "normal_equations", "solve", "model", "write")
    ]
    assert len(rows) == 6 and all(r[3] == "hit" for r in rows), again.stdout
    # A rerun whose every stage is a hit imports no torch (the stages' code loads lazily),
    # no h5py (imported to write), no xarray or pandas (the input's digest is remembered
    # while the file is unchanged: stages/load/scanmemo.py), no matplotlib (the quick look
    # is left as it was drawn), no dask or scipy.
    picture = Path(f"{out}.quicklook.png")
    drawn = picture.stat().st_mtime_ns
    heavy = ("h5py", "torch", "prefect", "xarray", "pandas", "matplotlib", "dask", "scipy")
    rerun = cli_imports("run", str(tmp_path / "demo" / "gridsolve.yaml"), probed=heavy)
    assert rerun == "0 prefect"
    assert picture.stat().st_mtime_ns == drawn


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_seed_demo_matches_lstsq(tmp_path: Path) -> None:
    """The original problem: 50 obs × 500 × 500, coef 100 > obs 50, minimum norm, float32."""
    demo = tmp_path / "seed"
    res = gridsolve("demo", "--size", "seed", "--out", str(demo))
    assert res.returncode == 0, res.stderr[-3000:]
    with xr.open_dataset(demo / "output.nc") as out, xr.open_dataset(demo / "demo.nc") as cube:
        assert set(out.data_vars) >= CONTRACT
        assert out.sizes["coef"] == 100 and out.sizes["y"] == 500 and out.sizes["x"] == 500
        A = out["design"].values
        B = cube["signal"].values.astype(np.float64).reshape(50, -1)
        C = out["coefficients"].values.reshape(100, -1).astype(np.float64)
        # 50 rows cannot determine 100 coefficients: minimum norm, never labelled ok
        assert (out["status"].values == STATUS_CODES["underdetermined"]).all()
    ref = np.linalg.lstsq(A, B, rcond=None)[0]  # minimum norm, every pixel a right-hand side
    rel = np.linalg.norm(C - ref, axis=0) / np.linalg.norm(ref, axis=0)
    assert rel.max() < 1e-4, rel.max()
    for p in np.random.default_rng(0).choice(B.shape[1], 300, replace=False):
        one = np.linalg.lstsq(A, B[:, p], rcond=None)[0]
        assert np.linalg.norm(C[:, p] - one) / np.linalg.norm(one) < 1e-4

    # A well-posed design on the same cube, float64: 1 + trend + 4 harmonics = 10 coefficients.
    res = gridsolve(
        "run",
        str(demo / "gridsolve.yaml"),
        "--set",
        "design={impl: harmonic, harmonics: 4}",
        "--set",
        "solve.dtype=float64",
        "--set",
        "model.input_dim=10",
        "--set",
        "model.hidden_dim=1",
        "--set",
        "write.path=harmonic.nc",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    with xr.open_dataset(demo / "harmonic.nc") as out:
        A = out["design"].values
        C = out["coefficients"].values.reshape(10, -1)
    ref = np.linalg.lstsq(A, B, rcond=None)[0]
    rel = np.linalg.norm(C - ref, axis=0) / np.linalg.norm(ref, axis=0)
    assert rel.max() < 1e-6, rel.max()


def test_stages_lists_every_kind_in_order_and_every_implementation() -> None:
    from gridsolve.schemas.pipeline import DEFAULT_IMPL, STAGE_KINDS
    from gridsolve.stages.engine.registry import implementations

    proc = gridsolve("stages", timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    heads = [ln.split(" ")[0] for ln in lines if not ln.startswith(" ")]
    assert heads == list(STAGE_KINDS)
    for kind in STAGE_KINDS:
        block = lines[lines.index(next(ln for ln in lines if ln.startswith(f"{kind} ("))) :]
        for impl, decl in implementations(kind).items():
            if not decl.run.__module__.startswith("gridsolve."):
                continue  # a test plugin registered in this process only
            mark = " (default)" if DEFAULT_IMPL[kind] == impl else ""
            assert f"  {impl}{mark}: {decl.summary}" in block


OPENBLAS_PROBE = (
    "import io, os, contextlib\n"
    "from gridsolve.flows.cli import main\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n"
    "    main(['schema'])\n"
    "print(os.environ.get('OPENBLAS_NUM_THREADS', '-'))\n"
)


@pytest.mark.parametrize(("given", "expect"), [(None, "1"), ("3", "3")])
def test_the_command_keeps_openblas_on_one_thread_unless_told(
    given: str | None, expect: str
) -> None:
    """numpy's OpenBLAS: one thread in gridsolve's processes (flows/cli.py says why)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    res = subprocess.run(
        [sys.executable, "-c", OPENBLAS_PROBE], capture_output=True, text=True, env=env, timeout=600
    )
    assert res.stdout.strip().splitlines()[-1] == expect, res.stderr[-2000:]


def _profile_rows(stdout: str) -> tuple[float, dict[str, float]]:
    """The total and the rows (label → seconds) of `gridsolve run --profile`'s table."""
    lines = stdout.splitlines()
    (head,) = [i for i, line in enumerate(lines) if line.startswith("where the time went")]
    total = float(lines[head].split("(")[1].split()[0])
    rows: dict[str, float] = {}
    for line in lines[head + 1 :]:
        found = re.match(r"^(?P<label>.+?)\s+(?P<seconds>-?\d+\.\d\d) s(\s|$)", line)
        assert found, line
        rows[found["label"]] = float(found["seconds"])
    return total, rows


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.usefixtures("prefect_server")
def test_profile_adds_up_to_the_wall_time(tmp_path: Path) -> None:
    make_ds(20, 6, 5, nan_fraction=0.2).to_netcdf(tmp_path / "cube.nc")
    cfg = write_config(tmp_path, tmp_path / "cube.nc")
    t0 = time.perf_counter()
    res = gridsolve("run", str(cfg), "--profile", cwd=tmp_path)
    wall = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr[-3000:]
    total, rows = _profile_rows(res.stdout)
    stages = {k.strip() for k in rows if k.startswith("  ")}
    assert stages == {"load", "design", "normal_equations", "solve", "model", "write"}, rows
    # Its rows are the run from the process start: they add up to its total, which is
    # the wall time but for the interpreter's exit after the table was printed.
    assert sum(rows.values()) == pytest.approx(total, abs=0.05 + 0.005 * len(rows))
    # Within 10 % of the wall time (the bound), or 0.75 s on a loaded machine where
    # the interpreter's exit (Prefect flushing its events at exit) takes longer.
    assert total <= wall and wall - total <= max(0.1 * wall, 0.75), (total, wall, res.stdout)
    # The solve's phases name the import of its code (torch) as setup, and its compute.
    solve = next(line for line in res.stdout.splitlines() if line.startswith("  solve "))
    assert "setup" in solve and "compute" in solve, solve
