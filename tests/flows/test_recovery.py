"""Kills, concurrent runs, corrupted caches and reruns, with real `gridsolve run` processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import yaml

from gridsolve.stages.engine.store import Store

from testkit import make_ds, tiles_stored

GRIDSOLVE = str(Path(sys.executable).parent / "gridsolve")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]


def write_config(folder: Path, cube: Path, cache: Path, out: Path) -> Path:
    raw = {
        "load": {"path": str(cube)},
        "design": {"impl": "harmonic", "harmonics": 1},
        "model": {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 3},
        "write": {"path": str(out), "chunks": {"y": 8, "x": 128}},
        "cache": {"root": str(cache)},
        "execution": {"tile_pixels": 1024},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "gridsolve.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def start(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(
            [GRIDSOLVE, "run", str(cfg)], stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def finish(proc: subprocess.Popen[bytes], log: Path, timeout: float = 600) -> str:
    proc.wait(timeout=timeout)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    return text


def wait_for(pred: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        assert proc.poll() is None, "the run ended before the moment to kill it"
        time.sleep(0.02)
    raise AssertionError("timed out waiting for the moment to kill the run")


def cache_is_whole(cache: Path) -> None:
    Store._verified.clear()
    store = Store(cache)
    keys = [p.name for p in (cache / "objects").glob("*/*")]
    assert keys
    for key in keys:
        assert store.check(key)[0] == "hit", key


def same_content(path: Path, reference: dict[str, Any]) -> None:
    """Every variable bit-identical to the reference run's (global attrs name the output path)."""
    with xr.open_dataset(path) as a, xr.open_dataset(reference["path"]) as b:
        assert set(a.variables) == set(b.variables)
        for name in a.variables:
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
            np.testing.assert_equal(a[name].attrs, b[name].attrs, err_msg=name)
        assert a.attrs["gridsolve_input_hash"] == b.attrs["gridsolve_input_hash"]


def cache_column(log: str, stage: str) -> str:
    for line in log.splitlines():
        parts = line.split()
        if parts[:1] == [stage]:
            return parts[3]
    raise AssertionError(f"no {stage} row in:\n{log[-2000:]}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The cube, and its output from one undisturbed run."""
    root = tmp_path_factory.mktemp("reference")
    cube = root / "cube.nc"
    make_ds(n_obs=30, ny=128, nx=128, nan_fraction=0.1, dtype="float32").to_netcdf(cube)
    out = root / "out.nc"
    cfg = write_config(root, cube, root / "cache", out)
    finish(start(cfg, root / "log"), root / "log")
    return {"cube": cube, "path": out}


def test_kill_during_solve_then_resume(tmp_path: Path, reference: dict[str, Any]) -> None:
    cache, out = tmp_path / "cache", tmp_path / "out.nc"
    cfg = write_config(tmp_path, reference["cube"], cache, out)
    proc = start(cfg, tmp_path / "log1")
    wait_for(lambda: tiles_stored(cache, "solve") >= 2, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = tiles_stored(cache, "solve")
    assert not out.exists()
    cache_is_whole(cache)  # the kill left no half artifact under objects/
    log = finish(start(cfg, tmp_path / "log2"), tmp_path / "log2")
    assert cache_column(log, "load") == "hit" and cache_column(log, "normal_equations") == "hit"
    solve = cache_column(log, "solve")
    assert solve == "hit" or int(solve.split("/")[0]) >= done_before, solve
    same_content(out, reference)
    assert not list((cache / "tmp").iterdir())  # the killed writer's leftovers are swept


def test_kill_during_write_then_rerun(tmp_path: Path, reference: dict[str, Any]) -> None:
    cache, out = tmp_path / "cache", tmp_path / "out.nc"
    cfg = write_config(tmp_path, reference["cube"], cache, out)
    proc = start(cfg, tmp_path / "log1")
    wait_for(lambda: bool(list(tmp_path.glob(".out.nc.gridsolve~*.tmp"))), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()  # only the temporary was there
    cache_is_whole(cache)
    log = finish(start(cfg, tmp_path / "log2"), tmp_path / "log2")
    for stage in ("load", "design", "normal_equations", "solve", "model"):
        assert cache_column(log, stage) == "hit", (stage, log[-2000:])
    assert cache_column(log, "write") == "miss"
    same_content(out, reference)
    assert not list(tmp_path.glob(".out.nc.gridsolve~*.tmp"))


def test_two_runs_at_once_share_one_cache(tmp_path: Path, reference: dict[str, Any]) -> None:
    cache, out = tmp_path / "cache", tmp_path / "out.nc"
    cfg = write_config(tmp_path, reference["cube"], cache, out)
    a, b = start(cfg, tmp_path / "a.log"), start(cfg, tmp_path / "b.log")
    finish(a, tmp_path / "a.log")
    finish(b, tmp_path / "b.log")
    same_content(out, reference)
    cache_is_whole(cache)


def test_corrupted_artifact_is_reported_and_recomputed(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    cache, out = tmp_path / "cache", tmp_path / "out.nc"
    cfg = write_config(tmp_path, reference["cube"], cache, out)
    finish(start(cfg, tmp_path / "log1"), tmp_path / "log1")
    victim = next(
        m.parent
        for m in (cache / "objects").glob("*/*/manifest.json")
        if json.loads(m.read_text()).get("kind") == "model"
        and json.loads(m.read_text()).get("part") == "tile"
    )
    arr = victim / "a0.npy"
    data = bytearray(arr.read_bytes())
    data[-3] ^= 0x5A
    arr.write_bytes(bytes(data))
    log = finish(start(cfg, tmp_path / "log2"), tmp_path / "log2")
    assert "is corrupt" in log and victim.name in log  # reported
    assert cache_column(log, "solve") == "hit" and cache_column(log, "model") != "hit"
    same_content(out, reference)  # recomputed, bit-identical
    assert any(p.name.startswith(victim.name) for p in (cache / "corrupt").iterdir())


def epochs_stored(cache: Path) -> int:
    n = 0
    for manifest in (cache / "objects").glob("*/*/manifest.json"):
        info = json.loads(manifest.read_text())
        n += info.get("kind") == "train" and info.get("part") == "epoch"
    return n


def test_kill_during_training_then_resume_gives_the_same_weights(tmp_path: Path) -> None:
    cube = tmp_path / "cube.nc"
    ds = make_ds(n_obs=12, ny=96, nx=96, seed=5, datetime_obs=False)
    ds["tgt"] = (("y", "x"), ds["signal"].values.mean(axis=0) - 2.0)
    ds.to_netcdf(cube)

    def config(name: str) -> Path:
        folder = tmp_path / name
        path = write_config(folder, cube, folder / "cache", folder / "out.nc")
        raw = yaml.safe_load(path.read_text())
        raw["load"]["target"] = "tgt"
        raw["design"] = {"impl": "polynomial", "degree": 3}
        raw["model"] = {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 1}
        raw["train"] = {"impl": "adam", "epochs": 8, "batch_pixels": 16, "lr": 0.01}
        path.write_text(yaml.safe_dump(raw))
        return path

    straight = config("straight")
    finish(start(straight, tmp_path / "straight.log"), tmp_path / "straight.log")
    resumed = config("resumed")
    log = tmp_path / "resumed.log"
    proc = start(resumed, log)
    wait_for(lambda: epochs_stored(tmp_path / "resumed" / "cache") >= 2, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = epochs_stored(tmp_path / "resumed" / "cache")
    assert 2 <= done < 8, done  # killed mid-training
    finish(start(resumed, log), log)
    # resumed after the last stored epoch, not started again
    store = Store(tmp_path / "resumed" / "cache")
    [whole] = [
        m.parent.name
        for m in (tmp_path / "resumed" / "cache" / "objects").glob("*/*/manifest.json")
        if json.loads(m.read_text()).get("kind") == "train"
        and json.loads(m.read_text()).get("part") == "whole"
    ]
    assert store.get(whole).meta["resumed_after_epoch"] == done
    a = (tmp_path / "straight" / "out.nc.weights.safetensors").read_bytes()
    b = (tmp_path / "resumed" / "out.nc.weights.safetensors").read_bytes()
    assert a == b
    assert epochs_stored(tmp_path / "resumed" / "cache") == 8
    # the killed run's dataset files were swept
    assert not list((tmp_path / "resumed" / "cache" / "tmp").iterdir())
