"""The cache's size cap and write.keep_last through the real command: runs, leases, prune.

Real ``gridsolve`` subprocesses on seeded cubes, one cache folder shared by
several runs; every output is checked against numpy's lstsq per pixel.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import yaml

from gridsolve.stages.engine.leases import LEASES
from gridsolve.stages.engine.prune import format_size, usage

from testkit import make_ds

GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")
REPO = Path(__file__).resolve().parents[2]
STAGES = ("load", "design", "normal_equations", "solve", "model", "write")


def gridsolve(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GRIDSOLVE, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )


def start(*args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [GRIDSOLVE, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


#: A single-sample model that takes its time: a run of it stays in progress for seconds.
# A model that waits while the file named by $SLOW_GATE exists: the test holds the long
# run inside its model stage for as long as it needs, however slow a loaded host makes
# the other run (a fixed sleep raced with it: under a CPU hog the short run outlasted it).
SLOW_MODEL = """
import os
import time
from torch import nn

class SlowLinear(nn.Module):
    def __init__(self, n_in: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, 1)

    def forward(self, x):
        gate, end = os.environ.get("SLOW_GATE"), time.monotonic() + 900
        if gate:
            open(gate + ".reached", "w").close()
        while gate and os.path.exists(gate) and time.monotonic() < end:
            time.sleep(0.05)
        return self.lin(x)
"""


def config(
    tmp_path: Path,
    name: str,
    seed: int,
    shape: tuple[int, int] = (6, 5),
    execution: dict[str, Any] | None = None,
    **cache: Any,
) -> Path:
    """A config on its own seeded cube, writing ``<name>.nc``, caching in ``tmp_path/cache``."""
    cube = tmp_path / f"{name}-cube.nc"
    make_ds(n_obs=14, ny=shape[0], nx=shape[1], seed=seed).to_netcdf(cube)
    raw = {
        "load": {"path": str(cube)},
        "design": {"impl": "polynomial", "degree": 3},
        "model": {"input_dim": 2, "hidden_dim": 2},
        "write": {"path": f"{name}.nc"},
        "cache": {"root": "cache", **cache},
        "execution": execution or {},
    }
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def assert_matches_lstsq(out: Path, cube: Path) -> None:
    """The output's coefficients are numpy's lstsq of every pixel on the output's design."""
    with xr.open_dataset(out) as ds, xr.open_dataset(cube) as src:
        A, coef, data = ds["design"].values, ds["coefficients"].values, src["signal"].values
    for j in range(data.shape[1]):
        for i in range(data.shape[2]):
            expected = np.linalg.lstsq(A, data[:, j, i], rcond=None)[0]
            np.testing.assert_allclose(coef[:, j, i], expected, rtol=1e-4, atol=1e-5)


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    """The run summary: stage -> (key prefix, hit|miss)."""
    out = {}
    for line in stdout.splitlines():
        f = line.split()
        if f and f[0] in STAGES:
            out[f[0]] = (f[2], f[3])
    return out


def keys(cache: Path) -> set[str]:
    return {e.key for e in usage(cache).artifacts}


def last_used(cache: Path) -> dict[str, int]:
    return {e.key: e.last_used_ns for e in usage(cache).artifacts}


def age(cache: Path, ordered: list[str], seconds_ago: float) -> None:
    """Give ``ordered`` distinct last uses, oldest first, starting ``seconds_ago``."""
    base = time.time() - seconds_ago
    for i, key in enumerate(ordered):
        os.utime(cache / "objects" / key[:2] / key / "manifest.json", (base + i, base + i))


def leases_now(cache: Path) -> list[Path]:
    return sorted((cache / LEASES).glob("*.json")) if (cache / LEASES).exists() else []


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.usefixtures("prefect_server")
def test_a_run_pruning_under_a_tiny_cap_spares_what_a_concurrent_run_uses(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    old = gridsolve("run", str(config(tmp_path, "old", seed=0)))
    assert old.returncode == 0, old.stderr[-3000:]
    old_keys = keys(cache)
    assert len(old_keys) > 6

    # Two runs share the cache, each capped at 1 byte: each prunes all that is not in use.
    # The long one (a slow model, six tiles) starts first; the short one starts once it
    # has made its first artifacts, and ends (and prunes) while the long one still works.
    long_cfg = config(
        tmp_path, "long", seed=1, execution={"tile_pixels": 5, "max_workers": 1}, max_size="1"
    )
    raw = yaml.safe_load(long_cfg.read_text())
    raw["model"] = {
        "impl": "module",
        "target": "slowmodel:SlowLinear",
        "kwargs": {"n_in": 4},
        "input_shape": [4],
    }
    long_cfg.write_text(yaml.safe_dump(raw))
    (tmp_path / "slowmodel.py").write_text(SLOW_MODEL)
    short_cfg = config(tmp_path, "short", seed=2, max_size="1")
    gate = tmp_path / "hold-the-long-run"
    gate.touch()
    slow = start("run", str(long_cfg), PYTHONPATH=str(tmp_path), SLOW_GATE=str(gate))
    try:
        deadline = time.monotonic() + 300
        reached = tmp_path / "hold-the-long-run.reached"
        while not reached.exists():  # the long run is in its model: load, design, … are made
            assert slow.poll() is None, slow.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        early = keys(cache) - old_keys  # what the long run made (and so used) so far
        assert len(early) >= 3, sorted(early)
        assert len(leases_now(cache)) == 1
        # Prefect's default console level, as a user has it: the prune's summary shows there
        fast = gridsolve("run", str(short_cfg), PREFECT_LOGGING_LEVEL="INFO")
        assert fast.returncode == 0, fast.stderr[-3000:]
        assert slow.poll() is None  # the long run was in progress all along
        left = keys(cache)
        # the short run's prune removed the old run's artifacts (used by no live run) and
        # nothing the long run had used
        assert early <= left, sorted(early - left)
        assert not old_keys & left
        said = re.search(rf"cache {cache}: freed .* \((\d+) folder\(s\)\)", fast.stderr)
        assert said and int(said[1]) == len(old_keys), fast.stderr[-3000:]
        assert re.search(r"still over the cap: \d+ artifact\(s\) are in use", fast.stderr)
        gate.unlink()
        stdout, stderr = slow.communicate(timeout=600)
    finally:
        gate.unlink(missing_ok=True)
        if slow.poll() is None:
            slow.kill()
            slow.wait()
    assert slow.returncode == 0, (stdout[-2000:], stderr[-3000:])
    assert leases_now(cache) == []  # both released theirs
    # the long run, last to end, kept all it used: its whole stages are still cached
    last, left = rows(stdout), keys(cache)
    assert set(last) == set(STAGES)
    for stage in ("load", "design", "normal_equations", "write"):
        assert any(k.startswith(last[stage][0]) for k in left), (stage, last[stage])
    assert_matches_lstsq(tmp_path / "long.nc", tmp_path / "long-cube.nc")
    assert_matches_lstsq(tmp_path / "short.nc", tmp_path / "short-cube.nc")

    # a later rerun of the short one still works, and gives the same coefficients
    again = gridsolve("run", str(short_cfg))
    assert again.returncode == 0, again.stderr[-3000:]
    assert_matches_lstsq(tmp_path / "short.nc", tmp_path / "short-cube.nc")


HOLDER = """
import sys
from pathlib import Path
from gridsolve.stages.engine import leases
from gridsolve.stages.engine.store import Store
root = Path(sys.argv[1])
lease = leases.acquire(root, "run")
store = Store(root)
for key in sys.argv[2:]:
    store.get(key)  # what a run in progress reads
print(lease.path, flush=True)
sys.stdin.read()
"""


def removed_keys(stdout: str) -> list[str]:
    return re.findall(r"^(?:would remove|removed) (\w+)", stdout, re.MULTILINE)


def owner(prefixes: list[str], among: list[str]) -> list[str]:
    return [next(k for k in among if k.startswith(p)) for p in prefixes]


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.usefixtures("prefect_server")
def test_prune_spares_what_a_live_run_uses_and_evicts_it_once_that_process_is_dead(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    cfg1, cfg2 = config(tmp_path, "one", seed=1), config(tmp_path, "two", seed=2)
    assert gridsolve("run", str(cfg1)).returncode == 0
    first = keys(cache)
    res = gridsolve("run", str(cfg2))
    assert res.returncode == 0, res.stderr[-3000:]
    second = keys(cache) - first
    assert first and second and len(first) == len(second)
    # the cap and keep_last are housekeeping only: in no key, so a rerun hits every stage
    res = gridsolve("run", str(cfg1), "--set", "cache.max_size=1GiB", "--set", "write.keep_last=3")
    assert res.returncode == 0, res.stderr[-3000:]
    assert {hit for _, hit in rows(res.stdout).values()} == {"hit"}, res.stdout
    assert keys(cache) == first | second  # under the cap: nothing removed

    lru1, lru2 = sorted(first), sorted(second)
    age(cache, lru1, 3600)  # run one's artifacts: least recently used
    age(cache, lru2, 1800)
    sizes = {e.key: e.size for e in usage(cache).artifacts}
    total = sum(sizes.values())

    res = gridsolve("cache", "size", "--root", str(cache))
    assert res.returncode == 0, res.stderr
    assert f"size: {format_size(total)} ({total} bytes)" in res.stdout, res.stdout
    assert f"artifacts: {len(sizes)} " in res.stdout and "live leases: 0" in res.stdout

    # a cap that needs two and a half artifacts gone removes the three least recently used
    cap = total - sizes[lru1[0]] - sizes[lru1[1]] - sizes[lru1[2]] // 2
    res = gridsolve("cache", "prune", "--max-size", str(cap), "--root", str(cache))
    assert res.returncode == 0, res.stderr
    assert owner(removed_keys(res.stdout), lru1) == lru1[:3]
    assert keys(cache) == set(lru1[3:]) | second
    freed = sizes[lru1[0]] + sizes[lru1[1]] + sizes[lru1[2]]
    assert f"freed {format_size(freed)} (3 folder(s))" in res.stdout, res.stdout

    # a run in progress (another process) holds its lease and has read run two's artifacts
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(cache), *lru2],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout is not None
        lease = Path(holder.stdout.readline().strip())
        assert lease.exists() and f"-{holder.pid}-" in lease.name
        res = gridsolve("cache", "size", "--root", str(cache))
        assert "live leases: 1" in res.stdout and f"pid {holder.pid}" in res.stdout

        dry = gridsolve("cache", "prune", "--max-size", "1", "--root", str(cache), "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert owner(removed_keys(dry.stdout), lru1) == lru1[3:]
        assert "would free" in dry.stdout and keys(cache) == set(lru1[3:]) | second

        res = gridsolve("cache", "prune", "--max-size", "1", "--root", str(cache))
        assert res.returncode == 0, res.stderr
        assert owner(removed_keys(res.stdout), lru1) == lru1[3:]  # still LRU order
        assert keys(cache) == second  # every artifact the live run used is still there
        assert "still over the cap" in res.stdout and f"{len(lru2)} artifact(s) are in use" in (
            res.stdout
        )

        holder.send_signal(signal.SIGKILL)  # the run dies: its lease file stays behind
        holder.wait()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert lease.exists()
    before = (tmp_path / "two.nc").read_bytes()
    res = gridsolve("cache", "prune", "--max-size", "1", "--root", str(cache))
    assert res.returncode == 0, res.stderr
    assert sorted(owner(removed_keys(res.stdout), lru2)) == lru2
    assert "swept 1 expired lease(s)" in res.stdout and not lease.exists()
    assert keys(cache) == set() and leases_now(cache) == []

    # a later run recomputes everything and writes the same file
    res = gridsolve("run", str(cfg2))
    assert res.returncode == 0, res.stderr[-3000:]
    assert {hit for _, hit in rows(res.stdout).values()} == {"miss"}, res.stdout
    assert (tmp_path / "two.nc").read_bytes() == before
    assert_matches_lstsq(tmp_path / "two.nc", tmp_path / "two-cube.nc")


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.usefixtures("prefect_server")
def test_keep_last_in_a_run_keeps_the_newest_outputs_and_their_pictures(tmp_path: Path) -> None:
    cfg = config(tmp_path, "kept", seed=4)
    raw = yaml.safe_load(cfg.read_text())
    raw["write"] = {"path": "outs/out-{flow_run_id}.nc", "keep_last": 2}
    cfg.write_text(yaml.safe_dump(raw))
    outs = tmp_path / "outs"
    outs.mkdir()
    foreign = outs / "out-00000000-0000-4000-8000-000000000000.nc"  # not gridsolve's
    xr.Dataset({"v": ("x", np.arange(3.0))}).to_netcdf(foreign)
    os.utime(foreign, (1, 1))

    written = []
    for _ in range(3):
        res = gridsolve("run", str(cfg))
        assert res.returncode == 0, res.stderr[-3000:]
        out = Path(re.findall(r"^output: (.+)$", res.stdout, re.MULTILINE)[-1])
        assert out.parent == outs and out.exists()
        written.append(out)
    assert len(set(written)) == 3
    left = sorted(p.name for p in outs.glob("out-*.nc"))
    assert left == sorted([foreign.name, written[1].name, written[2].name])
    for gone in (written[0], Path(f"{written[0]}.quicklook.png")):
        assert not gone.exists()
    for kept in written[1:]:
        assert Path(f"{kept}.quicklook.png").stat().st_size > 0
        assert_matches_lstsq(kept, tmp_path / "kept-cube.nc")


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_cache_command_messages_and_exit_codes(tmp_path: Path) -> None:
    bad = gridsolve("cache", "prune", "--max-size", "lots", "--root", str(tmp_path))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("config error: --max-size 'lots' is not a size"), bad.stderr
    assert "5GiB" in bad.stderr and bad.stdout == ""

    missing = tmp_path / "nowhere"
    for args in (("size",), ("prune", "--max-size", "1GiB")):
        res = gridsolve("cache", *args, "--root", str(missing))
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert res.stderr.startswith(f"store error: no cache folder at {missing}\n"), res.stderr
        assert not missing.exists()

    res = gridsolve("cache", "size", "--root", str(tmp_path))  # a folder, not a cache
    assert res.returncode == 2 and "is not a gridsolve cache folder" in res.stderr

    res = gridsolve("cache", "size", "--root", "s3://bucket/cache")
    assert res.returncode == 2 and "not pruned, local caches only" in res.stderr

    (tmp_path / "cache" / "objects").mkdir(parents=True)
    res = gridsolve("cache", "prune", "--root", str(tmp_path / "cache"))
    assert res.returncode == 2 and "needs a size cap" in res.stderr

    # a config names the cache (relative to the config's folder) and the cap
    cfg = config(tmp_path, "c", seed=0, max_size="2GiB")
    res = gridsolve("cache", "size", str(cfg), cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert f"cache: {tmp_path / 'cache'}" in res.stdout
    assert "size: 0 B (0 bytes)" in res.stdout and "cap (cache.max_size): 2GiB" in res.stdout
    res = gridsolve("cache", "prune", str(cfg))
    assert res.returncode == 0 and "freed 0 B (0 folder(s))" in res.stdout, res.stdout


def test_default_root_is_the_deployments_cache_under_gridsolve_home(tmp_path: Path) -> None:
    """On a worker's machine (GRIDSOLVE_HOME set) the default is where deployment runs cache."""
    home = tmp_path / "home"
    env = {**os.environ, "GRIDSOLVE_HOME": str(home)}
    res = subprocess.run(
        [GRIDSOLVE, "cache", "size"], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert res.returncode == 2
    assert f"no cache folder at {home / '.gridsolve-cache'}" in res.stderr, res.stderr
    (home / ".gridsolve-cache" / "objects").mkdir(parents=True)
    res = subprocess.run(
        [GRIDSOLVE, "cache", "size"], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert f"cache: {home / '.gridsolve-cache'}" in res.stdout and "artifacts: 0" in res.stdout


def test_without_gridsolve_home_the_default_is_here_else_the_workers_home(tmp_path: Path) -> None:
    """GRIDSOLVE_HOME unset: ./.gridsolve-cache when this folder has one (a local run's),
    else ~/gridsolve/.gridsolve-cache (where a worker's runs keep it by default)."""
    fake_home = tmp_path / "user"
    env = {k: v for k, v in os.environ.items() if k != "GRIDSOLVE_HOME"}
    env["HOME"] = str(fake_home)
    here = tmp_path / "project"
    here.mkdir()

    def size() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [GRIDSOLVE, "cache", "size"], env=env, cwd=here, capture_output=True, text=True
        )

    workers = fake_home / "gridsolve" / ".gridsolve-cache"
    res = size()
    assert res.returncode == 2 and f"no cache folder at {workers}" in res.stderr, res.stderr
    (workers / "objects").mkdir(parents=True)
    res = size()
    assert res.returncode == 0 and f"cache: {workers}" in res.stdout, res.stdout + res.stderr
    (here / ".gridsolve-cache" / "objects").mkdir(parents=True)
    res = size()
    assert res.returncode == 0 and f"cache: {here / '.gridsolve-cache'}" in res.stdout
