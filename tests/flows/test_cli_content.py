"""`gridsolve run` after `touch` or a copy of the input: exit 0, every computing stage a hit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import xarray as xr
import yaml

from testkit import make_ds

GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")
STAGES = ("load", "design", "normal_equations", "solve", "model", "write")


def run(*args: str) -> dict[str, str]:
    res = subprocess.run(
        [GRIDSOLVE, "run", *args], capture_output=True, text=True, timeout=900, env=os.environ
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [line.split() for line in res.stdout.splitlines()]
    cache = {r[0]: r[3] for r in rows if len(r) > 3 and r[0] in STAGES}
    assert set(cache) == set(STAGES), res.stdout
    return cache


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.usefixtures("prefect_server")
def test_touched_or_copied_input_reruns_from_the_cache(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    cube = data / "demo.nc"
    make_ds(n_obs=12, ny=6, nx=5, nan_fraction=0.1).to_netcdf(cube)
    out = tmp_path / "out.nc"
    config = tmp_path / "gridsolve.yaml"
    raw = {
        "load": {"path": str(cube)},
        "design": {"impl": "polynomial", "degree": 3},
        "model": {"input_dim": 2, "hidden_dim": 2},
        "write": {"path": str(out)},
        "cache": {"root": str(tmp_path / "cache")},
    }
    config.write_text(yaml.safe_dump(raw))

    assert set(run(str(config)).values()) == {"miss"}

    st = cube.stat()  # touch: same bytes, new mtime
    os.utime(cube, ns=(st.st_atime_ns + 10**12, st.st_mtime_ns + 10**12))
    assert set(run(str(config)).values()) == {"hit"}  # Prefect-cached results included

    copy = data / "copy.nc"
    shutil.copy(cube, copy)
    cube.unlink()  # the old path is gone: only the copy can be read
    moved = run(str(config), "--set", f"load.path={copy}")
    # The output names the input it was computed from: only the write stage runs again.
    assert moved == {**dict.fromkeys(STAGES, "hit"), "write": "miss"}, moved
    with xr.open_dataset(out) as ds:
        assert json.loads(ds.attrs["gridsolve_config"])["load"]["path"] == str(copy)
    assert set(run(str(config), "--set", f"load.path={copy}").values()) == {"hit"}
